"""Load on the HTTP server: N concurrent streaming clients, their tokens/s and latencies, a report and plots.

Each client sends streaming requests back to back (OpenAI's chunk format, with vLLM's
``continuous_usage_stats`` so every chunk says how many tokens it carried). Time to first token is measured
from sending the request to the first chunk with a token; inter-token latency spreads each later chunk's
gap over the tokens it carried (a speculative step delivers several at once), so the samples are per token.
Tokens/s counts every token received inside the window.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import optional_import
from .report import machine_line

httpx = optional_import("httpx", "bench", "the load clients")

POLICY_ORDER = ("always", "never", "auto")


@dataclass
class Stream:
    """One streaming request as the client saw it."""

    prompt_index: int
    text: str = ""
    chunks: int = 0
    tokens: int = 0
    done: bool = False  # ended with data: [DONE]
    finish_reason: str | None = None
    error: str | None = None
    status: int | None = None


@dataclass
class LoadRecord:
    """Everything the clients measured in one run."""

    clients: int
    duration: float
    ttft: list[float] = field(default_factory=list)
    itl: list[float] = field(default_factory=list)
    tokens: int = 0
    streams: list[Stream] = field(default_factory=list)

    @property
    def completed(self) -> list[Stream]:
        return [s for s in self.streams if s.done and s.error is None]

    @property
    def errors(self) -> list[Stream]:
        return [s for s in self.streams if s.error is not None]

    def summary(self) -> dict[str, Any]:
        """tokens/s, requests finished, errors and latency percentiles (seconds)."""

        def pct(xs: list[float], q: float) -> float | None:
            return float(np.percentile(xs, q)) if xs else None

        return {
            "clients": self.clients,
            "duration_s": self.duration,
            "tokens": self.tokens,
            "tokens_per_s": self.tokens / self.duration if self.duration else 0.0,
            "requests_finished": len(self.completed),
            "errors": len(self.errors),
            "ttft_p50_s": pct(self.ttft, 50),
            "ttft_p99_s": pct(self.ttft, 99),
            "itl_p50_s": pct(self.itl, 50),
            "itl_p99_s": pct(self.itl, 99),
        }


async def stream_request(
    client: httpx.AsyncClient, path: str, body: dict[str, Any], record: LoadRecord, prompt_index: int = 0
) -> Stream:
    """Send one streaming request and record its chunks as they arrive (a cancelled stream keeps what came)."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    stream = Stream(prompt_index)
    record.streams.append(stream)
    sent = time.perf_counter()
    last: float | None = None
    try:
        async with client.stream("POST", path, json=body) as response:
            stream.status = response.status_code
            if response.status_code != 200:
                stream.error = f"HTTP {response.status_code}: {(await response.aread()).decode(errors='replace')}"
                return stream
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line.removeprefix("data: ")
                if data == "[DONE]":
                    stream.done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    stream.error = chunk["error"].get("message", "error")
                    continue
                stream.chunks += 1
                for choice in chunk.get("choices") or []:
                    stream.text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                    stream.finish_reason = choice.get("finish_reason") or stream.finish_reason
                usage = chunk.get("usage")
                new = (usage["completion_tokens"] - stream.tokens) if usage else 0
                if new > 0:
                    now = time.perf_counter()
                    if last is None:
                        record.ttft.append(now - sent)
                    else:
                        record.itl.extend([(now - last) / new] * new)
                    last = now
                    stream.tokens += new
                    record.tokens += new
    except httpx.HTTPError as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    return stream


def run_load(
    url: str,
    bodies: Sequence[dict[str, Any]],
    clients: int,
    duration: float,
    path: str = "/v1/chat/completions",
    api_key: str | None = None,
    drain: bool = False,
) -> LoadRecord:
    """``clients`` concurrent clients, each streaming requests back to back (client i starts at body i).

    After ``duration`` seconds, streams still running are cut (the client disconnects) unless ``drain``:
    then no new request starts and the running ones finish.
    """
    if not bodies:
        raise ValueError("no request bodies to send")
    record = LoadRecord(clients, duration)

    async def client(http: httpx.AsyncClient, i: int, end: float) -> None:
        j = i
        while time.perf_counter() < end:
            await stream_request(http, path, bodies[j % len(bodies)], record, j % len(bodies))
            j += clients

    async def main() -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        limits = httpx.Limits(max_connections=clients + 8, max_keepalive_connections=clients + 8)
        timeout = httpx.Timeout(600.0, connect=30.0)
        async with httpx.AsyncClient(base_url=url, headers=headers, limits=limits, timeout=timeout) as http:
            start = time.perf_counter()
            tasks = [asyncio.create_task(client(http, i, start + duration)) for i in range(clients)]
            if drain:
                await asyncio.gather(*tasks)
                record.duration = time.perf_counter() - start
                return
            await asyncio.sleep(duration)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())
    return record


def free_port() -> int:
    """A port free on the loopback interface now (the kernel's pick)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_serve_process(target: str, port: int, log: Path, options: Sequence[str] = ()) -> subprocess.Popen:
    """``specdecode serve --target TARGET --port PORT [OPTIONS]`` in a process of its own, its stderr written to
    ``log`` (a file, not a pipe: a full pipe would stall the server), once ``/health`` answers. Exits with the log's
    end if it does not start within 10 minutes."""
    command = [sys.executable, "-c", "from specdecode.cli import main; main()", "serve", "--target", target,
               "--port", str(port), *options]  # fmt: skip
    with open(log, "w") as log_file:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log_file)
    deadline = time.monotonic() + 600
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            sys.exit(f"the server did not start: {log.read_text()[-2000:]}")
        time.sleep(0.5)


def scrape(url: str, api_key: str | None = None) -> dict[str, float]:
    """The server's /metrics as {name{labels}: value} (counters, gauges, histogram sums and counts)."""
    from prometheus_client.parser import text_string_to_metric_families

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()) if k != "le")
            if "le" in sample.labels:
                continue
            values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return values


def server_side(before: dict[str, float], after: dict[str, float]) -> dict[str, float | None]:
    """What the server did during a run: the share of steps that speculated and the draft acceptance."""

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    spec = delta('specdecode:engine_steps_total{speculating="true"}')
    plain = delta('specdecode:engine_steps_total{speculating="false"}')
    drafted = delta("specdecode:spec_decode_num_draft_tokens_total")
    accepted = delta("specdecode:spec_decode_num_accepted_tokens_total")
    return {
        "steps": spec + plain,
        "speculating_share": spec / (spec + plain) if spec + plain else None,
        "drafted": drafted,
        "acceptance": accepted / drafted if drafted else None,
    }


# --- report -------------------------------------------------------------------------------------------


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.1f}"


def _num(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def markdown(rows: list[dict[str, Any]], setup: dict[str, Any], machine: dict[str, Any]) -> str:
    """The report: one table row per (clients, policy), then the best fixed policy vs auto per client count."""
    lines = [
        "# bench-serve",
        "",
        f"Target `{setup['target']}`, proposer `{setup['proposer']}`, gamma `{setup['gamma']}`, "
        f"{setup['max_tokens']} tokens per request, temperature {setup['temperature']}, prompts: {setup['prompts']}; "
        f"{setup['duration']:.0f} s per run × {setup['repeats']} repeat(s) (policy order rotated each repeat).",
        "",
        f"Machine: {machine_line(machine)}.",
        "",
        "| clients | policy | tokens/s | ± | finished | errors | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms "
        "| speculating steps | acceptance |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        share, acc = r.get("speculating_share"), r.get("acceptance")
        lines.append(
            f"| {r['clients']} | {r['policy']} | {r['tokens_per_s']:.1f} | {_num(r['spread'])} | "
            f"{r['requests_finished']} | {r['errors']} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
            f"{_ms(r['itl_p50_s'])} | {_ms(r['itl_p99_s'])} | {'–' if share is None else f'{share:.0%}'} | "
            f"{'–' if acc is None else f'{acc:.0%}'} |"
        )
    lines += ["", "| clients | best fixed policy | its tokens/s | auto tokens/s | auto / best | noise (± half-range) |"]
    lines.append("| ---: | --- | ---: | ---: | ---: | ---: |")
    for clients in sorted({r["clients"] for r in rows}):
        by = {r["policy"]: r for r in rows if r["clients"] == clients}
        fixed = [by[p] for p in ("always", "never") if p in by]
        if not fixed or "auto" not in by:
            continue
        best = max(fixed, key=lambda r: r["tokens_per_s"])
        auto = by["auto"]
        spreads = [r["spread"] for r in by.values() if r["spread"] is not None]
        noise = max(spreads) if spreads else None
        ratio = auto["tokens_per_s"] / best["tokens_per_s"] if best["tokens_per_s"] else float("nan")
        lines.append(
            f"| {clients} | {best['policy']} | {best['tokens_per_s']:.1f} | {auto['tokens_per_s']:.1f} | "
            f"{ratio:.3f} | {_num(noise)} |"
        )
    lines += [
        "",
        "tokens/s: tokens received by all clients inside the window ÷ its length (mean over repeats; ± = half "
        "the range over repeats). TTFT: request sent → first token. ITL: each chunk's gap spread over its "
        "tokens. Speculating steps and acceptance are the server's own counts (/metrics).",
        "",
        f"Command: `{machine.get('command')}`",
        "",
    ]
    return "\n".join(lines)


def plots(rows: list[dict[str, Any]], out: Path) -> list[Path]:
    """tokens/s, TTFT and ITL (p50 solid, p99 dashed) against the number of clients, one line per policy."""
    matplotlib = optional_import("matplotlib", "bench", "the load plots")

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    policies = [p for p in POLICY_ORDER if any(r["policy"] == p for r in rows)]
    written = []
    panels: list[tuple[str, str, Callable[[dict], tuple[float | None, ...]]]] = [
        ("serve_tokens_per_s.png", "tokens/s (all clients)", lambda r: (r["tokens_per_s"],)),
        ("serve_ttft.png", "time to first token (ms)", lambda r: (r["ttft_p50_s"], r["ttft_p99_s"])),
        ("serve_itl.png", "inter-token latency (ms)", lambda r: (r["itl_p50_s"], r["itl_p99_s"])),
    ]
    for name, label, values in panels:
        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for i, policy in enumerate(policies):
            mine = sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["clients"])
            xs = [r["clients"] for r in mine]
            series = list(zip(*(values(r) for r in mine), strict=True))
            scale = 1.0 if name == "serve_tokens_per_s.png" else 1000.0
            for j, ys in enumerate(series):
                ys = [None if y is None else y * scale for y in ys]
                ax.plot(
                    xs,
                    ys,
                    marker="o",
                    color=f"C{i}",
                    linestyle="-" if j == 0 else "--",
                    label=policy if j == 0 else f"{policy} p99",
                )
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["clients"] for r in rows}), [str(c) for c in sorted({r["clients"] for r in rows})])
        ax.set_xlabel("concurrent streaming clients")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_title(label + (" — p50 solid, p99 dashed" if len(values(rows[0])) > 1 else ""))
        fig.tight_layout()
        path = out / name
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def combine(records: list[tuple[LoadRecord, dict[str, float | None]]]) -> dict[str, Any]:
    """One row from the repeats of a (clients, policy) cell: mean tokens/s and its half-range, pooled latencies."""
    pooled = LoadRecord(records[0][0].clients, sum(r.duration for r, _ in records))
    for record, _ in records:
        pooled.ttft += record.ttft
        pooled.itl += record.itl
        pooled.tokens += record.tokens
        pooled.streams += record.streams
    row = pooled.summary()
    rates = [r.tokens / r.duration for r, _ in records]
    row["tokens_per_s"] = float(np.mean(rates))
    row["spread"] = (max(rates) - min(rates)) / 2 if len(rates) > 1 else None
    row["runs_tokens_per_s"] = rates
    drafted = sum(s["drafted"] or 0 for _, s in records)
    steps = sum(s["steps"] or 0 for _, s in records)
    spec_steps = sum((s["speculating_share"] or 0) * (s["steps"] or 0) for _, s in records)
    accepted = sum((s["acceptance"] or 0) * (s["drafted"] or 0) for _, s in records)
    row["speculating_share"] = spec_steps / steps if steps else None
    row["acceptance"] = accepted / drafted if drafted else None
    return row


def write_report(rows: list[dict[str, Any]], out: Path, setup: dict[str, Any], machine: dict[str, Any]) -> list[Path]:
    """results.json, report.md and the PNG plots in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    results = out / "serve_results.json"
    results.write_text(json.dumps({"setup": setup, "machine": machine, "rows": rows}, indent=2))
    report = out / "serve_report.md"
    report.write_text(markdown(rows, setup, machine))
    return [results, report, *plots(rows, out)]
