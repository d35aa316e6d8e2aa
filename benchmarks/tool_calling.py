"""Tool calling on a real model through the official ``openai`` client (issue 66): the accuracy set of
``specdecode.bench.tool_requests`` (24 requests over 6 tools, half needing none), greedy, ``tool_choice`` left to its
default (``"auto"``), sent to ``specdecode serve`` with speculation off and on (the same greedy answers are expected:
the same tool choices), and optionally to llama.cpp's ``llama-server --jinja`` (plain and with ``-md``) on the same
file and requests.

    .venv/bin/python benchmarks/tool_calling.py --target T.gguf --draft D.gguf \\
        [--llama-server BUILD/bin/llama-server] [--max-tokens 96] [--threads 2] [--json OUT.json]

Prints, per setting: calls made, calls whose arguments parse and validate, the right tool chosen (or none), and the
decode speed (completion tokens / the time of the answer after its first token, streamed); for llama-server, the
ways its answers' shape differs from ours. The server's own models are the defaults of the real pair
(``specdecode.bench.real_pair``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import openai

from specdecode.bench.real_pair import RealPair, find_real_pair
from specdecode.bench.serve_load import free_port, start_serve_process
from specdecode.bench.tool_requests import REQUESTS, TOOLS, score


@dataclass
class Answer:
    setting: str
    request: int
    message: dict
    finish_reason: str
    completion_tokens: int
    decode_seconds: float  # from the first streamed chunk to the last


def ask(client: openai.OpenAI, setting: str, index: int, args: argparse.Namespace, extra: dict) -> Answer:
    """One request, streamed (for the timing) and assembled as OpenAI's stream helper does."""
    messages = [{"role": "user", "content": REQUESTS[index].text}]
    first = None
    with client.chat.completions.stream(
        model=args.model, messages=messages, tools=TOOLS, temperature=0, max_tokens=args.max_tokens,
        stream_options={"include_usage": True}, extra_body=extra,
    ) as stream:  # fmt: skip
        for _ in stream:
            first = first or time.perf_counter()
        try:
            completion = stream.get_final_completion()
        except openai.LengthFinishReasonError as cut:  # the helper refuses a cut answer; its text is still there
            completion = cut.completion
    last = time.perf_counter()
    choice = completion.choices[0]
    message = choice.message.model_dump(include={"content", "tool_calls"}, exclude_none=True)
    for call in message.get("tool_calls", ()):
        call["function"] = {k: call["function"][k] for k in ("name", "arguments")}
    tokens = completion.usage.completion_tokens if completion.usage else 0
    return Answer(setting, index, message, choice.finish_reason, tokens, last - (first or last))


def run_setting(url: str, setting: str, args: argparse.Namespace, extra: dict) -> list[Answer]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    ask(client, setting, 0, args, extra)  # untimed: page cache, threads
    answers = [ask(client, setting, i, args, extra) for i in range(len(REQUESTS))]
    report(setting, answers)
    return answers


def report(setting: str, answers: list[Answer]) -> None:
    figures = score(REQUESTS, [a.message for a in answers])
    tokens = sum(a.completion_tokens for a in answers)
    seconds = sum(a.decode_seconds for a in answers)
    print(
        f"| {setting} | {figures.calls} | {figures.valid} | {figures.right}/{figures.requests} "
        f"({figures.accuracy:.0%}) | {tokens / seconds:.1f} |",
        flush=True,
    )


def ours(pair: RealPair, args: argparse.Namespace) -> list[Answer]:
    port = free_port()
    log = Path(tempfile.mkdtemp()) / "serve.log"
    options = ["--draft", str(pair.draft), "--gamma", str(args.gamma), "--policy", "always",
               "--served-model-name", args.model]  # fmt: skip
    if args.threads:
        options += ["--threads", str(args.threads)]
    server = start_serve_process(str(pair.target), port, log, options)
    try:
        url = f"http://127.0.0.1:{port}"
        plain = run_setting(url, "specdecode, plain", args, {"speculative": False})
        spec = run_setting(url, f"specdecode, draft 0.5B gamma {args.gamma}", args, {})
    finally:
        server.terminate()
        server.wait(timeout=60)
    same = sum(a.message == b.message or _same_calls(a.message, b.message) for a, b in zip(plain, spec, strict=True))
    print(f"\nspecdecode: {same}/{len(plain)} answers identical with and without speculation\n")
    return plain + spec


def _same_calls(a: dict, b: dict) -> bool:
    """The same answer but for the calls' ids (fresh per answer)."""

    def strip(message: dict) -> dict:
        calls = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", ())]
        return {**message, "tool_calls": calls}

    return strip(a) == strip(b)


def llama(pair: RealPair, args: argparse.Namespace) -> list[Answer]:
    answers = []
    for setting, extra in (("llama-server, plain", []), ("llama-server, -md 0.5B", ["-md", str(pair.draft),
                           "--spec-type", "draft-simple", "--spec-draft-n-max", str(args.gamma)])):  # fmt: skip
        port = free_port()
        command = [str(args.llama_server), "-m", str(pair.target), "--host", "127.0.0.1", "--port", str(port),
                   "-c", "8192", "-t", str(args.threads or 2), "-np", "1", "--no-webui", "--jinja", *extra]  # fmt: skip
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if process.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"llama-server did not start ({process.returncode})")
                time.sleep(0.5)
            answers += run_setting(f"http://127.0.0.1:{port}", setting, args, {})
            raw = httpx.post(
                f"http://127.0.0.1:{port}/v1/chat/completions",
                json={
                    "messages": [{"role": "user", "content": REQUESTS[0].text}],
                    "tools": TOOLS,
                    "temperature": 0,
                    "max_tokens": args.max_tokens,
                },  # fmt: skip
                timeout=600,
            ).json()
            print(f"{setting}: a raw answer: {json.dumps(raw['choices'][0])[:600]}\n")
        finally:
            process.terminate()
            process.wait(timeout=60)
    return answers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, help="default: the real pair's target")
    parser.add_argument("--draft", type=Path, help="default: the real pair's draft")
    parser.add_argument("--llama-server", type=Path, help="also run llama.cpp's llama-server (plain and -md)")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--model", default="qwen2.5-coder-1.5b")
    parser.add_argument("--skip-ours", action="store_true", help="only llama-server")
    parser.add_argument("--json", type=Path, help="write every answer here")
    args = parser.parse_args()
    pair = find_real_pair()
    if isinstance(pair, str) and not (args.target and args.draft):
        raise SystemExit(pair)
    pair = RealPair(args.target or pair.target, args.draft or pair.draft)
    print("| setting | calls | valid calls | right tool | decode tok/s |\n| --- | --- | --- | --- | --- |")
    answers = [] if args.skip_ours else ours(pair, args)
    if args.llama_server:
        answers += llama(pair, args)
    if args.json:
        args.json.write_text(json.dumps([asdict(a) for a in answers], indent=1))


if __name__ == "__main__":
    main()
