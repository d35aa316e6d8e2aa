"""Soak test of `specdecode serve`: many clients for a long time with mixed traffic, clients that disconnect
mid-stream and fuzzed bodies interleaved; the server process's RSS, open file descriptors and threads sampled
throughout (they should stay flat after the first minutes), then a SIGINT that must end it with exit code 0.

    python benchmarks/soak_serve.py --target smollm2 --clients 32 --minutes 30 --out soak.json [-- SERVE OPTIONS]
    python benchmarks/soak_serve.py --target /tmp/tiny-model --clients 4 --minutes 0.1   # a check that it works

Traffic, per client in a loop: 80% streamed completions (greedy or sampled, 16-128 tokens), 10% streams dropped
after their first chunk, 10% fuzzed bodies (a field removed, retyped or out of range; these must get a 4xx, never
a 5xx). Prints a summary and writes every sample and count as JSON (the server's stderr beside it, .server.log).
Run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

PROMPTS = [
    "The quick brown fox",
    "List three colours and one fruit of each colour:",
    "def fibonacci(n):",
    "Once upon a time, in a small town by the sea,",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
FUZZ = [
    lambda b: {k: v for k, v in b.items() if k != "prompt"},
    lambda b: {**b, "max_tokens": -5},
    lambda b: {**b, "temperature": "hot"},
    lambda b: {**b, "top_p": 7},
    lambda b: {**b, "stop": [1, 2]},
    lambda b: {**b, "logprobs": 99},
    lambda b: {**b, "speculative": {"proposer": "nonexistent"}},
    lambda b: {**b, "prompt": ""},
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def process_sample(pid: int) -> dict[str, float]:
    """RSS (MiB), threads and open file descriptors of ``pid``, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = {line.split(":")[0]: line.split(":")[1].split() for line in status}
    return {
        "rss_mib": int(fields["VmRSS"][0]) / 1024,
        "threads": int(fields["Threads"][0]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


def client(url: str, seed: int, until: float, counts: Counter, lock: threading.Lock) -> None:
    rng = random.Random(seed)
    with httpx.Client(base_url=url, timeout=120) as http:
        while time.monotonic() < until:
            body = {
                "prompt": rng.choice(PROMPTS),
                "max_tokens": rng.randint(16, 128),
                "temperature": rng.choice([0.0, 0.8]),
                "stream": True,
            }
            roll = rng.random()
            try:
                if roll < 0.1:
                    response = http.post("/v1/completions", json=rng.choice(FUZZ)(body))
                    outcome = "fuzz_4xx" if 400 <= response.status_code < 500 else f"fuzz_{response.status_code}"
                else:
                    with http.stream("POST", "/v1/completions", json=body) as response:
                        outcome = f"http_{response.status_code}"
                        for line in response.iter_lines():
                            if roll < 0.2 and line.startswith("data: "):
                                outcome = "dropped"
                                break
                            if line == "data: [DONE]":
                                outcome = "done"
                            elif '"error"' in line:
                                outcome = "stream_error"
            except httpx.HTTPError as error:
                outcome = f"client_{type(error).__name__}"
            with lock:
                counts[outcome] += 1


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
    command = [sys.executable, "-c", "from specdecode.cli import main; main()", "serve", "--target", args.target,
               "--port", str(port), *args.serve_options]  # fmt: skip
    log = args.out.with_suffix(".server.log")  # a file, not a pipe: a full pipe would stall the server
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file, text=True)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)
    counts: Counter = Counter()
    lock = threading.Lock()
    started = time.monotonic()
    until = started + args.minutes * 60
    threads = [
        threading.Thread(target=client, args=(url, seed, until, counts, lock), daemon=True)
        for seed in range(args.clients)
    ]
    for thread in threads:
        thread.start()
    samples = []
    while time.monotonic() < until:
        samples.append({"seconds": round(time.monotonic() - started, 1), **process_sample(server.pid)})
        print(json.dumps({**samples[-1], **counts}), flush=True)
        time.sleep(min(args.sample_seconds, max(0.0, until - time.monotonic())))
    for thread in threads:
        thread.join(180)
    samples.append({"seconds": round(time.monotonic() - started, 1), **process_sample(server.pid)})
    server.send_signal(signal.SIGINT)
    server.wait(timeout=120)
    stderr = log.read_text()
    result = {
        "target": args.target,
        "clients": args.clients,
        "minutes": args.minutes,
        "counts": dict(counts),
        "samples": samples,
        "exit_code": server.returncode,
        "traceback_on_stop": "Traceback" in stderr,
        "last_line": (stderr.strip().splitlines() or [""])[-1],
    }
    args.out.write_text(json.dumps(result, indent=1))
    first, last = samples[min(1, len(samples) - 1)], samples[-1]
    print(
        f"{sum(counts.values())} requests {dict(counts)}; RSS {first['rss_mib']:.0f} -> {last['rss_mib']:.0f} MiB, "
        f"fds {first['fds']} -> {last['fds']}, threads {first['threads']} -> {last['threads']}; server exit "
        f"{server.returncode}{' with a traceback' if result['traceback_on_stop'] else ''}; written to {args.out}"
    )


if __name__ == "__main__":
    main()
