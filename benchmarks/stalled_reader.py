"""Inter-token latency of other requests beside a client that stops reading its stream.

Starts `specdecode serve` and runs `bench-serve`'s clients (streamed chat completions of Spec-Bench questions,
back to back) in phases, alternated round by round:

- ``alone``: the clients only;
- ``reader``: one more request, a long stream (the same 3,500 greedy tokens each time, with 20 top logprobs each:
  ~6 MB of events), whose client reads it: the engine's batch is one larger, the cost any extra request has;
- ``stalled``: the same request from a client that never reads (a 2 KB receive buffer). Its events fill the
  server's socket buffer (Linux grows it to 4 MB) and uvicorn's, then writes wait: the engine goes on (the request
  runs to its end at the batch's pace, its text held in memory) and the connection is cut once a write has waited
  the stall bound (30 s).

Both extra clients handle bytes only (no parsing), so the clients measured share the machine alike. "Unaffected"
means ``stalled`` costs the others no more than ``reader``. Prints each phase's median and p90 inter-token latency
and tokens/s, medians over rounds, and writes every figure as JSON.

    python benchmarks/stalled_reader.py --clients 4 --phase-seconds 75 --rounds 3 --out stalled.json
"""

from __future__ import annotations

import argparse
import json
import signal
import socket
import statistics
import threading
import time
from pathlib import Path

from specdecode.bench.serve_load import free_port, run_load, start_serve_process
from specdecode.bench.workloads import default_items

# greedy, with the end-of-text tokens banned (SmolLM2's 0 and 2): the same 3,500 tokens in every phase
EXTRA = {"messages": [{"role": "user", "content": "Tell me a very long story about a lighthouse keeper."}],
         "max_tokens": 3500, "temperature": 0, "logit_bias": {"0": -100, "2": -100}, "logprobs": True,
         "top_logprobs": 20, "stream": True}  # fmt: skip
PHASES = ("alone", "reader", "stalled")


def send_extra(port: int, receive_buffer: int | None) -> socket.socket:
    """A raw client that sends the extra request (with a small receive buffer if given) and returns its socket."""
    client = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if receive_buffer is not None:
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    client.connect(("127.0.0.1", port))
    data = json.dumps(EXTRA).encode()
    head = f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
    client.sendall(head.encode() + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return client


def stall_cuts(log: Path) -> int:
    """The server's cuts so far (its log's warning lines)."""
    return log.read_text().count("stopped reading its stream")


def extra_client(phase: str, port: int, stop: threading.Event) -> None:
    """The phase's extra request until ``stop``: read and dropped (``reader``) or never read (``stalled``)."""
    if phase == "alone":
        return
    client = send_extra(port, None if phase == "reader" else 2048)
    client.settimeout(0.5)
    with client:
        while not stop.is_set():
            if phase == "stalled":
                stop.wait(0.5)
                continue
            try:
                if not client.recv(65536):
                    stop.wait()
            except TimeoutError:
                pass


def run_phase(phase: str, url: str, port: int, log: Path, bodies: list[dict], clients: int, seconds: float) -> dict:
    cuts = stall_cuts(log)
    stop = threading.Event()
    extra = threading.Thread(target=extra_client, args=(phase, port, stop), daemon=True)
    extra.start()
    time.sleep(1.0)  # the extra request is in the batch before the clients start
    record = run_load(url, bodies, clients, seconds)
    stop.set()
    extra.join(30)
    summary = record.summary()
    itl = sorted(record.itl)
    return {
        "phase": phase,
        "itl_p50_ms": 1000 * summary["itl_p50_s"],
        "itl_p90_ms": 1000 * itl[int(0.9 * (len(itl) - 1))],
        "itl_p99_ms": 1000 * summary["itl_p99_s"],
        "tokens_per_s": summary["tokens_per_s"],
        "errors": summary["errors"],
        "cuts": stall_cuts(log) - cuts,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--phase-seconds", type=float, default=75.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("stalled.json"))
    args = parser.parse_args()
    questions = [item.turns[0] for item in default_items() if isinstance(item.turns[0], str)]
    bodies = [{"messages": [{"role": "user", "content": q}], "max_tokens": args.max_tokens, "temperature": 0}
              for q in questions]  # fmt: skip
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = args.out.with_suffix(".server.log")
    server = start_serve_process(args.target, port, log)
    try:
        run_load(url, bodies, args.clients, 10.0)  # warm-up
        phases = []
        for round_ in range(args.rounds):
            for phase in PHASES if round_ % 2 == 0 else PHASES[::-1]:
                phases.append(
                    {"round": round_, **run_phase(phase, url, port, log, bodies, args.clients, args.phase_seconds)}
                )
                print(json.dumps(phases[-1]), flush=True)
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
    medians = {
        phase: {key: statistics.median(p[key] for p in phases if p["phase"] == phase)
                for key in ("itl_p50_ms", "itl_p90_ms", "itl_p99_ms", "tokens_per_s", "errors", "cuts")}
        for phase in PHASES
    }  # fmt: skip
    args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "phases": phases,
                                    "medians": medians}, indent=1))  # fmt: skip
    for phase, m in medians.items():
        latency = f"ITL p50 {m['itl_p50_ms']:.1f} ms, p90 {m['itl_p90_ms']:.1f} ms, p99 {m['itl_p99_ms']:.1f} ms"
        print(f"{phase:8s} {latency}, {m['tokens_per_s']:.1f} tokens/s, errors {m['errors']:g}, cuts {m['cuts']:g}")


if __name__ == "__main__":
    main()
