"""Soak test of `specdecode serve`: many clients for a long time with mixed traffic, clients that disconnect
mid-stream and fuzzed bodies interleaved; the server process's RSS, open file descriptors and threads sampled
throughout (they should stay flat after the first minutes), then a SIGINT that must end it with exit code 0.

    python benchmarks/soak_serve.py --target smollm2 --clients 32 --minutes 30 --out soak.json -- --prefix-cache-gb 0.25
    python benchmarks/soak_serve.py --target /tmp/tiny-model --clients 4 --minutes 0.1   # a check that it works

Traffic, per client in a loop: 80% streamed requests, half of them `bench-serve`'s (a chat completion of a
Spec-Bench question) and half completions of short prompts, greedy or sampled, 16-128 tokens, with the server's
proposer, another one or none, sometimes with logprobs; 10% streams dropped after their first chunk; 10% fuzzed
bodies (a field removed, retyped or out of range; these must get a 4xx, never a 5xx). A greedy request's text must
be the same every time the same request is sent (whatever else is in the batch): a difference counts as
``greedy_differs``. Prints a summary and writes every sample and count as JSON (the server's stderr beside it,
.server.log). Run it on an otherwise idle machine. A small prefix cache (as above) fills in the first minutes, so the
rest of the run also exercises its eviction.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

from specdecode.bench.serve_load import free_port, scrape, start_serve_process
from specdecode.bench.workloads import default_items

PROMPTS = [
    "The quick brown fox",
    "List three colours and one fruit of each colour:",
    "def fibonacci(n):",
    "Once upon a time, in a small town by the sea,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
FUZZ = [
    lambda b: {k: v for k, v in b.items() if k not in ("prompt", "messages")},
    lambda b: {**b, "max_tokens": -5},
    lambda b: {**b, "temperature": "hot"},
    lambda b: {**b, "top_p": 7},
    lambda b: {**b, "stop": [1, 2]},
    lambda b: {**b, "logprobs": 99},
    lambda b: {**b, "speculative": {"proposer": "nonexistent"}},
    lambda b: {**b, "prompt": ""} if "prompt" in b else {**b, "messages": []},
]


def process_sample(pid: int, url: str) -> dict[str, float]:
    """RSS (MiB), threads and open file descriptors of ``pid``, from /proc, and the server's prefix cache (MiB:
    memory it holds by design, up to ``--prefix-cache-gb``; the rest of RSS should stay flat)."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status}
    try:
        cache = scrape(url).get("specdecode:prefix_cache_bytes", 0.0) / 2**20
    except httpx.HTTPError:
        cache = float("nan")
    return {
        "rss_mib": int(fields["VmRSS"][0]) / 1024,
        "prefix_cache_mib": cache,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def request_body(rng: random.Random, questions: list[str]) -> tuple[str, dict]:
    """(the route, a streamed body): bench-serve's chat request or a completion, with the options mixed."""
    body: dict = {"max_tokens": rng.choice([16, 32, 64, 128]), "temperature": rng.choice([0.0, 0.8]), "stream": True}
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": rng.choice(questions)}]
    else:
        path, body["prompt"] = "/v1/completions", rng.choice(PROMPTS)
        if rng.random() < 0.25:
            body["logprobs"] = 2
    body["speculative"] = rng.choice([None, None, {"proposer": "none"}, {"proposer": "lookup"}])
    if body["speculative"] is None:
        del body["speculative"]
    if body["temperature"] > 0:
        body["seed"] = rng.randrange(1000)
    return path, body


def client(url: str, seed: int, until: float, counts: Counter, greedy: dict, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    questions = [item.turns[0] for item in default_items() if isinstance(item.turns[0], str)]
    with httpx.Client(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            path, body = request_body(rng, questions)
            roll = rng.random()
            text = []
            try:
                if roll < 0.1:
                    response = http.post(path, json=rng.choice(FUZZ)(body))
                    outcome = "fuzz_4xx" if 400 <= response.status_code < 500 else f"fuzz_{response.status_code}"
                else:
                    with http.stream("POST", path, json=body) as response:
                        outcome = f"http_{response.status_code}"
                        for line in response.iter_lines():
                            if roll < 0.2 and line.startswith("data: "):
                                outcome = "dropped"
                                break
                            if line == "data: [DONE]":
                                outcome = "done"
                            elif '"error"' in line:
                                outcome = "stream_error"
                            elif line.startswith("data: "):
                                for choice in json.loads(line[6:]).get("choices") or []:
                                    text.append(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            except httpx.HTTPError as error:
                outcome = f"client_{type(error).__name__}"
            with lock:
                counts[outcome] += 1
                if outcome == "done" and body["temperature"] == 0:
                    key = json.dumps([path, body], sort_keys=True)
                    if greedy.setdefault(key, "".join(text)) != "".join(text):
                        counts["greedy_differs"] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--sample-seconds", type=float, default=10.0)
    parser.add_argument("--out", type=Path, default=Path("soak.json"))
    parser.add_argument("serve_options", nargs="*", help="after --: more `specdecode serve` options")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out.with_suffix(".server.log")
    server = start_serve_process(args.target, port, log, args.serve_options)
    counts: Counter = Counter()
    greedy: dict[str, str] = {}
    lock = threading.Lock()
    started = time.monotonic()
    until = started + args.minutes * 60
    threads = [
        threading.Thread(target=client, args=(url, seed, until, counts, greedy, lock), daemon=True)
        for seed in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    samples = []
    while time.monotonic() < until:
        samples.append({"seconds": round(time.monotonic() - started, 1), **process_sample(server.pid, url)})
        print(json.dumps({**samples[-1], **counts}), flush=True)
        time.sleep(min(args.sample_seconds, max(0.0, until - time.monotonic())))
    for thread in threads:
        thread.join(180)
    samples.append({"seconds": round(time.monotonic() - started, 1), **process_sample(server.pid, url)})
    server.send_signal(signal.SIGINT)
    server.wait(timeout=120)
    stderr = log.read_text()
    result = {
        "target": args.target,
        "clients": args.clients,
        "minutes": args.minutes,
        "counts": dict(counts),
        "greedy_requests_repeated": len(greedy),
        "samples": samples,
        "exit_code": server.returncode,
        "traceback_on_stop": "Traceback" in stderr,
        "last_line": (stderr.strip().splitlines() or [""])[-1],
    }
    args.out.write_text(json.dumps(result, indent=1))
    first, last = samples[min(1, len(samples) - 1)], samples[-1]
    print(
        f"{sum(counts.values())} requests {dict(counts)}; RSS {first['rss_mib']:.0f} -> {last['rss_mib']:.0f} MiB "
        f"(prefix cache {first['prefix_cache_mib']:.0f} -> {last['prefix_cache_mib']:.0f} MiB), "
        f"fds {first['fds']} -> {last['fds']}, threads {first['threads']} -> {last['threads']}; server exit "
        f"{server.returncode}{' with a traceback' if result['traceback_on_stop'] else ''}; written to {args.out}"
    )


if __name__ == "__main__":
    main()
