"""llama.cpp's plain decoding and its own draft-model speculation on the same requests as ours, through its
``llama-server`` (one binary for both: without ``-md``, and with ``-md DRAFT --spec-type draft-simple
--spec-draft-n-max N``). Each request is
rendered through the target's chat template by our tokenizer and sent to ``/completion`` as that text (so both engines
see the same tokens), prompt cache off; speed and acceptance come from the server's own ``timings``.

    .venv/bin/python benchmarks/llamacpp_speculative.py --server BUILD/bin/llama-server \\
        --target T.gguf --draft D.gguf [--prompts FILE.jsonl] [--max-new-tokens 192] [--n-max 3,8,16] \\
        [--temperature 0] [--threads 2] [--json OUT.json]

The server is built from the llama.cpp sources that llama-cpp-python's sdist vendors (``cmake -B build
vendor/llama.cpp && cmake --build build --target llama-server``; not a dependency, never built by CI). Settings run one
server at a time on loopback, each first answering one untimed request; at T > 0 each request has its own seed and
llama.cpp's samplers are set to plain temperature sampling (top-k 0, top-p 1, min-p 0). Prints a Markdown table (decode
tok/s, tok/s with the prompt's processing, × llama.cpp plain, accepted / drafted); ``--json`` writes every request.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
import urllib.request
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from specdecode.bench.serve_load import free_port
from specdecode.bench.workloads import default_items, load_items
from specdecode.models.loading.sources import load_tokenizer


@dataclass(frozen=True)
class Answer:
    question: str
    setting: str  # "plain" or "draft n-max N"
    new_tokens: int
    decode_ms: float
    prompt_ms: float
    drafted: int
    accepted: int


@contextmanager
def server(args: argparse.Namespace, n_max: int | None):
    """A llama-server on a free loopback port (plain, or speculating with ``n_max`` draft tokens), until exit."""
    port = free_port()
    command = [str(args.server), "-m", str(args.target), "--host", "127.0.0.1", "--port", str(port), "-c", "4096",
               "-t", str(args.threads), "-np", "1", "--no-webui"]  # fmt: skip
    if n_max is not None:
        command += ["-md", str(args.draft), "--spec-type", "draft-simple", "--spec-draft-n-max", str(n_max),
                    "--spec-draft-n-min", "0"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if process.poll() is not None:
                raise SystemExit(f"llama-server exited ({process.returncode}): {process.stderr.read()[-800:]}")
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise SystemExit("llama-server did not become healthy in 120 s") from None
                time.sleep(0.5)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def complete(url: str, prompt: str, args: argparse.Namespace, seed: int) -> dict:
    body = {
        "prompt": prompt, "n_predict": args.max_new_tokens, "temperature": args.temperature, "top_k": 0,
        "top_p": 1.0, "min_p": 0.0, "seed": seed, "cache_prompt": False, "stream": False,
    }  # fmt: skip
    request = urllib.request.Request(
        f"{url}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", required=True, type=Path, help="path to llama-server")
    parser.add_argument("--target", required=True, type=Path)
    parser.add_argument("--draft", required=True, type=Path)
    parser.add_argument("--prompts", type=Path, help="FastChat JSONL (first turns are used); default: the built-in set")
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--n-max", default="3,8,16", help="comma list of llama.cpp's --spec-draft-n-max to run")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0, help="request i uses seed + i")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write every request's figures here")
    args = parser.parse_args()
    items = load_items(args.prompts) if args.prompts else default_items()
    tokenizer = load_tokenizer(str(args.target))
    prompts = [
        (str(item.question_id), tokenizer.apply_chat_template(
            [{"role": "user", "content": item.turns[0]}], add_generation_prompt=True, tokenize=False))
        for item in items
    ]  # fmt: skip
    answers: list[Answer] = []
    for n_max in [None, *(int(n) for n in args.n_max.split(","))]:
        setting = "plain" if n_max is None else f"draft n-max {n_max}"
        with server(args, n_max) as url:
            complete(url, prompts[0][1], args, args.seed)  # untimed: page cache, threads
            for index, (question, prompt) in enumerate(prompts):
                timings = complete(url, prompt, args, args.seed + index)["timings"]
                answers.append(Answer(question, setting, timings["predicted_n"], timings["predicted_ms"],
                                      timings["prompt_ms"], timings.get("draft_n", 0),
                                      timings.get("draft_n_accepted", 0)))  # fmt: skip
        mine = [a for a in answers if a.setting == setting]
        print(
            f"{setting}: {sum(a.new_tokens for a in mine) / sum(a.decode_ms for a in mine) * 1e3:.2f} tok/s", flush=True
        )
    print("\n| llama.cpp | tok/s, decode | tok/s, with the prompt | × llama.cpp plain | accepted / drafted |")
    print("| --- | --- | --- | --- | --- |")
    plain = None
    for setting in dict.fromkeys(a.setting for a in answers):
        mine = [a for a in answers if a.setting == setting]
        tokens = sum(a.new_tokens for a in mine)
        decode = tokens / sum(a.decode_ms for a in mine) * 1e3
        total = tokens / sum(a.decode_ms + a.prompt_ms for a in mine) * 1e3
        plain = plain or total
        drafted, accepted = sum(a.drafted for a in mine), sum(a.accepted for a in mine)
        rate = f"{accepted / drafted:.3f}" if drafted else "–"
        print(f"| {setting} | {decode:.2f} | {total:.2f} | {total / plain:.2f} | {rate} |")
    print(f"\n{len(prompts)} requests, {args.max_new_tokens} new tokens at most, temperature {args.temperature}")
    if args.json:
        args.json.write_text(json.dumps([asdict(a) for a in answers], indent=1))


if __name__ == "__main__":
    main()
