"""``specdecode bench-serve``: concurrent streaming clients against an in-process server, three policies."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from specdecode import factory
from specdecode.commands import quiet_transformers, usage_errors
from specdecode.commands.options import (
    CategoriesOption,
    DraftOption,
    DtypeOption,
    GammaOption,
    GroupSizeOption,
    ProposerChoice,
    QuantizationOption,
    TargetOption,
    TemperatureOption,
    ThreadsOption,
    parse_gamma,
)

SHAREGPT_PROMPTS = 200


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"{what} must be a comma list of integers >= 1, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise ValueError(f"{what} must be a comma list of integers >= 1, got {text!r}")
    return values


def _policies(text: str) -> list[str]:
    from specdecode.serving.batching.policy import POLICIES

    chosen = [t.strip() for t in text.split(",") if t.strip()]
    unknown = [p for p in chosen if p not in POLICIES]
    if not chosen or unknown:
        raise ValueError(f"--policies must be a comma list of {', '.join(POLICIES)}, got {text!r}")
    return chosen


ProposerOption = Annotated[ProposerChoice, typer.Option(help="Proposer of the speculating policies.")]
PromptsOption = Annotated[
    str | None,
    typer.Option(help="FastChat JSONL (e.g. Spec-Bench's question.jsonl), 'sharegpt', or the built-in set."),
]
SuffixScopeOption = Annotated[
    str,
    typer.Option(
        help="--proposer suffix or eagle+suffix: global (the history keeps every finished request, so from the "
        "second run on it has seen the prompts: repeated traffic) or request (each request's own tokens only: "
        "fresh prompts)."
    ),
]


ClientsOption = Annotated[str, typer.Option(help="Comma list of concurrent streaming clients.")]
DurationOption = Annotated[float, typer.Option(help="Seconds of load per (clients, policy) run.")]
RepeatsOption = Annotated[int, typer.Option(help="Runs per (clients, policy), the policy order rotated (noise).")]
OutOption = Annotated[Path, typer.Option(help="Output folder (report, JSON, plots).")]
PoliciesOption = Annotated[str, typer.Option(help="Comma list of policies: always, never, auto.")]
MaxTokensOption = Annotated[int, typer.Option(help="max_tokens of every request (request i samples with seed i).")]
MaxBatchOption = Annotated[int | None, typer.Option(help="Server's max batch (default: the most clients).")]
PromptLimitOption = Annotated[int | None, typer.Option(help="At most N prompts per subtask (sharegpt: N prompts).")]
WarmupOption = Annotated[float, typer.Option(help="Seconds of untimed load before the runs.")]


def bench_serve(
    clients: ClientsOption = "1,4,16",
    duration: DurationOption = 60.0,
    repeats: RepeatsOption = 1,
    out: OutOption = Path("bench-serve-out"),
    target: TargetOption = "smollm2",
    proposer: ProposerOption = ProposerChoice.lookup,
    draft: DraftOption = None,
    gamma: GammaOption = "3",
    policies: PoliciesOption = "always,never,auto",
    prompts: PromptsOption = None,
    categories: CategoriesOption = None,
    limit: PromptLimitOption = None,
    max_tokens: MaxTokensOption = 128,
    temperature: TemperatureOption = 0.0,
    max_batch: MaxBatchOption = None,
    warmup: WarmupOption = 5.0,
    threads: ThreadsOption = None,
    suffix_scope: SuffixScopeOption = "global",
    dtype: DtypeOption = "auto",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
) -> None:
    """Load an in-process server with N streaming clients under each policy; report tokens/s, TTFT, ITL."""
    options = BenchServeOptions(**locals())  # every parameter, as typer parsed it (nothing else is bound yet)
    console = Console(stderr=True)
    with usage_errors():
        plan = _planned(options)
    import torch

    from specdecode.bench.serve_load import combine

    if threads is not None:
        torch.set_num_threads(threads)
    quiet_transformers()
    with console.status(f"loading {target}…"):
        loaded, server = _server(options, plan)
    bodies = _bodies(plan.turns, max_tokens, temperature)
    cells = _measured(options, plan, server, bodies, console)
    rows = [{"policy": p, **combine(cells[(n, p)])} for n in plan.counts for p in plan.policies]
    setup = {
        "target": target,
        "proposer": proposer.value,
        "draft": draft,
        "gamma": plan.gamma,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "prompts": f"{prompts or 'built-in set'} ({len(bodies)} prompts)",
        "duration": duration,
        "repeats": repeats,
        "max_batch": max_batch or max(plan.counts),
        "weights": loaded.quantization or "dense",
        "suffix_scope": suffix_scope,
    }
    _reported(rows, out, setup, console)


@dataclass(frozen=True)
class BenchServeOptions:
    """``bench_serve``'s options as given (see its parameters' help)."""

    clients: str
    duration: float
    repeats: int
    out: Path
    target: str
    proposer: ProposerChoice
    draft: str | None
    gamma: str
    policies: str
    prompts: str | None
    categories: str | None
    limit: int | None
    max_tokens: int
    temperature: float
    max_batch: int | None
    warmup: float
    threads: int | None
    suffix_scope: str
    dtype: str
    quantization: str
    group_size: int


@dataclass(frozen=True)
class _Plan:
    """The options parsed: client counts, policies, gamma and the prompts' text."""

    counts: list[int]
    policies: list[str]
    gamma: int | str
    turns: list[str]


def _planned(options: BenchServeOptions) -> _Plan:
    """Every option checked, the prompts read and the output folder made, before the slow load."""
    from specdecode.bench.workloads import default_items, load_items, select_items

    counts = _ints(options.clients, "--clients")
    chosen = _policies(options.policies)
    gamma_value = parse_gamma(options.gamma)
    factory.parse_quantization(options.quantization)
    if options.duration <= 0 or options.warmup < 0 or options.repeats < 1 or options.max_tokens < 1:
        raise ValueError("--duration must be > 0, --warmup >= 0, --repeats >= 1 and --max-tokens >= 1")
    if options.proposer is ProposerChoice.none:
        raise ValueError("--proposer none leaves nothing to compare: choose lookup or draft")
    if options.suffix_scope not in ("global", "request"):
        raise ValueError(f"--suffix-scope must be global or request, got {options.suffix_scope!r}")
    if options.prompts == "sharegpt":
        from specdecode.bench.workloads import sharegpt_turns

        turns = sharegpt_turns(options.limit or SHAREGPT_PROMPTS, seed=0)
    else:
        items = load_items(options.prompts) if options.prompts else default_items()
        items = select_items(items, [c for c in (options.categories or "").split(",") if c] or None, options.limit)
        turns = [item.turns[0] for item in items if isinstance(item.turns[0], str)]
    if not turns:
        raise ValueError("no text prompts to send")
    options.out.mkdir(parents=True, exist_ok=True)
    return _Plan(counts, chosen, gamma_value, turns)


def _server(options: BenchServeOptions, plan: _Plan) -> tuple[Any, Any]:
    """(the target loaded, an in-process ``Server`` over it with the options' proposer, gamma and batch)."""
    from specdecode.serving.config import ServerConfig
    from specdecode.serving.server import Server

    loaded = factory.load(options.target, options.dtype, options.quantization, options.group_size)
    server = Server(
        ServerConfig(
            target=loaded,
            proposer=options.proposer.value,
            draft=options.draft,
            gamma=plan.gamma,
            max_batch=options.max_batch or max(plan.counts),
            dtype=options.dtype,
            quantization=options.quantization,
            group_size=options.group_size,
            suffix_scope=options.suffix_scope,
        )
    )
    return loaded, server


def _bodies(turns: list[str], max_tokens: int, temperature: float) -> list[dict[str, Any]]:
    """One chat-completion request body per prompt (request i sampled with seed i when ``temperature`` > 0)."""
    bodies: list[dict[str, Any]] = []
    for i, turn in enumerate(turns):
        body: dict[str, Any] = {"messages": [{"role": "user", "content": turn}], "max_tokens": max_tokens}
        body["temperature"] = temperature
        if temperature > 0:
            body["seed"] = i
        bodies.append(body)
    return bodies


def _measured(
    options: BenchServeOptions, plan: _Plan, server: Any, bodies: list[dict[str, Any]], console: Console
) -> dict[tuple[int, str], list]:
    """Per (clients, policy), each run's client record and server-side figures: the warm-up, then the runs in
    ``run_order``, each under a fresh policy that has learned nothing, the server idle between runs."""
    from specdecode.bench.serve_load import run_load, scrape, server_side
    from specdecode.serving.app import create_app
    from specdecode.serving.batching.policy import SpeculationPolicy
    from specdecode.serving.local import LocalServer

    runs = run_order(plan.counts, options.repeats, plan.policies)
    cells: dict[tuple[int, str], list] = {}
    columns = (TextColumn("{task.description:<34}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with LocalServer(create_app(server)) as local, Progress(*columns, console=console) as progress:
        task = progress.add_task("warm-up", total=len(runs))
        if options.warmup:
            server.scheduler.policy = SpeculationPolicy("always")
            run_load(local.url, bodies, max(plan.counts), options.warmup)
            _wait_idle(local.url)
        for n, _, policy in runs:
            progress.update(task, description=f"{n} clients, policy {policy}")
            server.scheduler.policy = SpeculationPolicy(policy)  # a fresh policy: no pass costs carried over
            server.scheduler.forget_learned()  # nor acceptance priors and draft costs learned by the run before
            before = scrape(local.url)
            record = run_load(local.url, bodies, n, options.duration)
            _wait_idle(local.url)
            cells.setdefault((n, policy), []).append((record, server_side(before, scrape(local.url))))
            progress.advance(task)
    return cells


def _reported(rows: list[dict[str, Any]], out: Path, setup: dict[str, Any], console: Console) -> None:
    """The report, JSON and plots written into ``out``; the table of rows printed."""
    from specdecode.bench.report import machine_info
    from specdecode.bench.serve_load import write_report

    written = write_report(rows, out, setup, machine_info())
    table = Table("clients", "policy", "tokens/s", "±", "TTFT p50/p99 ms", "ITL p50/p99 ms", "errors", "spec steps")
    for r in rows:
        share = r["speculating_share"]
        table.add_row(
            str(r["clients"]),
            r["policy"],
            f"{r['tokens_per_s']:.1f}",
            "–" if r["spread"] is None else f"{r['spread']:.1f}",
            f"{_ms(r['ttft_p50_s'])}/{_ms(r['ttft_p99_s'])}",
            f"{_ms(r['itl_p50_s'])}/{_ms(r['itl_p99_s'])}",
            str(r["errors"]),
            "–" if share is None else f"{share:.0%}",
        )
    Console().print(table)
    console.print(f"wrote {', '.join(p.name for p in written)} in {out}")


def run_order(counts: list[int], repeats: int, policies: list[str]) -> list[tuple[int, int, str]]:
    """(clients, repeat, policy) in the order they run: for each client count and repeat the policies in turn,
    the order rotated by one at every (count, repeat) so that no policy always runs first or after the same one."""
    runs = []
    for i, n in enumerate(counts):
        for r in range(repeats):
            runs += [(n, r, p) for p in _rotated(policies, i * repeats + r)]
    return runs


def _rotated(items: list[str], shift: int) -> list[str]:
    shift %= len(items)
    return items[shift:] + items[:shift]


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{1000 * x:.0f}"


def _wait_idle(url: str, timeout: float = 60.0) -> None:
    """Until the server reports no running or waiting request (cut streams are freed at the next step)."""
    from specdecode.bench.serve_load import scrape

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = scrape(url)
        if not metrics.get("specdecode:num_requests_running") and not metrics.get("specdecode:num_requests_waiting"):
            return
        time.sleep(0.05)
