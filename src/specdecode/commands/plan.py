"""`specdecode plan`: predict the speedup from α and c, or (--memory) how many sequences fit, or (--measure) measure
α, c and v(k) and recommend a gamma; what it loads and measures is ``bench.measure``'s."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.table import Table

from specdecode import factory
from specdecode.commands import usage_errors
from specdecode.commands.options import (
    CategoriesOption,
    GroupSizeOption,
    LimitOption,
    MaxNewTokensOption,
    PromptsOption,
    TargetOption,
)
from specdecode.planner import SpeedupPlan, VerifyCost, dtype_bytes, plan_speedup, speedup_table

if TYPE_CHECKING:
    from specdecode.bench.measure import Measurement, MemoryReport

GIB = 2**30

AlphaOption = Annotated[float | None, typer.Option(help="Per-token acceptance probability α in [0, 1].")]
CostOption = Annotated[float | None, typer.Option(help="Cost c of one draft step relative to one target step (>= 0).")]
GammaOption = Annotated[
    int | None, typer.Option(help="Draft tokens per round (>= 1); default: the best gamma in 1..16.")
]
VerifyCostOption = Annotated[
    Path | None,
    typer.Option(
        "--verify-cost",
        help='JSON file, {"k": cost, ...} or a list of costs for k = 1, 2, ...: the cost of a '
        "k-token target forward relative to a 1-token one.",
    ),
]
JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]
MemoryOption = Annotated[
    bool,
    typer.Option(
        "--memory",
        help="Plan memory instead: the weights in RAM and mapped from the file, the KV cache and position "
        "tables per token, the scratch per row and at --context, and how many sequences fit --budget.",
    ),
]
DraftOption = Annotated[str | None, typer.Option(help="The draft model: --memory counts it, --measure drafts with it.")]
ContextOption = Annotated[int | None, typer.Option(help="--memory: tokens per sequence (prompt and output).")]
BudgetOption = Annotated[
    float | None, typer.Option(help="--memory: memory budget in GiB (default: what is available now).")
]
DtypeOption = Annotated[str, typer.Option(help="--memory/--measure: dtype of weights and KV cache.")]
QuantizationOption = Annotated[
    str,
    typer.Option(
        help="--memory/--measure: how the weights are stored: auto (a GGUF's own blocks, else dense), gguf, "
        "gguf-a8, int8, int4 or none (dense); --memory applies it to the draft too. Quantized weights keep a "
        "float32 KV cache."
    ),
]
MeasureOption = Annotated[
    bool,
    typer.Option(
        "--measure",
        help="Measure α, c and the verify-cost curve on --target with --proposer/--draft over --prompts, "
        "then predict every gamma and recommend one.",
    ),
]
ProposerOption = Annotated[str, typer.Option(help="--measure: lookup or draft (with --draft PATH or self:N).")]
GammasOption = Annotated[str, typer.Option(help="--measure: gammas to run and compare with predictions.")]
OutOption = Annotated[Path, typer.Option(help="--measure: folder for plan.json and plan.png.")]


def plan(
    alpha: AlphaOption = None,
    cost: CostOption = None,
    gamma: GammaOption = None,
    verify_cost: VerifyCostOption = None,
    json_output: JsonOption = False,
    memory: MemoryOption = False,
    target: TargetOption = "smollm2",
    draft: DraftOption = None,
    context: ContextOption = None,
    budget: BudgetOption = None,
    dtype: DtypeOption = "float32",
    quantization: QuantizationOption = "auto",
    group_size: GroupSizeOption = 32,
    measure: MeasureOption = False,
    proposer: ProposerOption = "lookup",
    prompts: PromptsOption = None,
    categories: CategoriesOption = None,
    limit: LimitOption = None,
    gammas: GammasOption = "2,4,8",
    max_new_tokens: MaxNewTokensOption = 128,
    out: OutOption = Path("plan-out"),
) -> None:
    """Predict the speedup for α, c and γ; or measure them (--measure); or plan memory (--memory)."""
    with usage_errors():
        _check_weights(quantization, group_size)
        if measure:
            _run_measure(target, draft, proposer, prompts, categories, limit, gammas, max_new_tokens, dtype,
                         quantization, group_size, out, json_output)  # fmt: skip
        elif memory:
            _run_memory(target, draft, context, budget, dtype, quantization, group_size, json_output)
        else:
            _run_speedup(alpha, cost, gamma, verify_cost, json_output)


def _check_weights(quantization: str, group_size: int) -> None:
    """``--quantization`` and ``--group-size`` checked before any model loads."""
    from specdecode.models.formats.weights import GROUP_SIZES

    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    factory.parse_quantization(quantization)


def load_verify_cost(path: Path) -> VerifyCost:
    """Read a verify-cost curve from a JSON file."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read --verify-cost file {path}: {e.strerror or e}") from e
    except json.JSONDecodeError as e:
        raise ValueError(f"--verify-cost file {path} is not valid JSON: {e}") from e
    return VerifyCost.from_json(data)


def _run_speedup(
    alpha: float | None, cost: float | None, gamma: int | None, verify_cost: Path | None, json_output: bool
) -> None:
    if alpha is None or cost is None:
        raise ValueError("give --alpha and --cost (or --memory with --context, or --measure)")
    curve = None if verify_cost is None else load_verify_cost(verify_cost)
    result = plan_speedup(alpha, cost, gamma, curve)
    if json_output:
        typer.echo(json.dumps(dataclasses.asdict(result)))
        return
    console = Console()
    console.print(_speedup_table(alpha, cost, curve, result.gamma))
    console.print(_speedup_summary(result))


def _speedup_table(alpha: float, cost: float, curve: VerifyCost | None, chosen: int) -> Table:
    table = Table(title=f"α = {alpha:g}, c = {cost:g}" + (", measured verify cost" if curve else ""))
    for name in ("γ", "tokens/round", "round cost", "speedup"):
        table.add_column(name, justify="right")
    for row in speedup_table(alpha, cost, curve):
        table.add_row(
            str(row.gamma),
            f"{row.expected_tokens:.2f}",
            f"{row.round_cost:.2f}",
            f"{row.speedup:.2f}×",
            style="bold" if row.gamma == chosen else None,
        )
    return table


def _speedup_summary(result: SpeedupPlan) -> str:
    lines = [
        f"γ = {result.gamma}: {result.expected_tokens:.2f} tokens per round, round cost "
        f"{result.round_cost:.2f}, speedup {result.speedup:.2f}×",
        f"best γ in 1..16: {result.best_gamma} ({result.best_speedup:.2f}×)"
        + ("; plain decoding (γ = 0, 1.00×) is better" if result.best_speedup <= 1.0 else ""),
    ]
    if result.break_even_alpha is None:
        lines.append(f"break-even α at γ = {result.gamma}: none (speculation never pays at this cost)")
    else:
        lines.append(f"break-even α at γ = {result.gamma}: {result.break_even_alpha:.3f}")
    return "\n".join(lines)


def _run_memory(
    target: str,
    draft: str | None,
    context: int | None,
    budget: float | None,
    dtype: str,
    quantization: str,
    group_size: int,
    json_output: bool,
) -> None:
    from specdecode.bench.measure import memory_report

    if context is None:
        raise ValueError("--memory needs --context (tokens per sequence); --target and --budget are optional")
    # Fail on bad values before spending time loading models.
    if context < 1:
        raise ValueError(f"--context must be >= 1 token, got {context}")
    if budget is not None and not budget > 0:
        raise ValueError(f"--budget must be > 0 GiB, got {budget}")
    dtype_bytes(dtype)
    report = memory_report(target, draft, context, None if budget is None else int(budget * GIB), dtype, quantization,
                           group_size)  # fmt: skip
    if json_output:
        typer.echo(json.dumps(report.summary()))
    else:
        Console().print(_memory_table(report, target, draft, dtype))


def _memory_table(report: MemoryReport, target: str, draft: str | None, dtype: str) -> Table:
    """Each model's footprint as loaded, then what speculation adds and how many sequences fit."""
    result = report.plan
    target = f"{target}, {report.target_stored}"
    draft = None if draft is None else f"{draft}, {report.draft_stored}"
    budget = _bytes(result.budget_bytes)
    table = Table(title=f"memory at {dtype}, {result.context} tokens/sequence, budget {budget}")
    table.add_column("")
    table.add_column("value", justify="right")
    for role, label, found in (("target", target, report.target), ("draft", draft, report.draft)):
        if found is None:
            continue
        table.add_row(f"{role} weights in RAM ({label})", _bytes(found.repacked))
        table.add_row(f"{role} weights mapped from the file", _bytes(found.mapped))
        table.add_row(f"{role} KV cache per token", _bytes(found.kv_per_token))
        table.add_row(f"{role} position tables per token", _bytes(found.tables_per_token))
        table.add_row(f"{role} scratch per row", _bytes(found.scratch_per_row))
        table.add_row(f"{role} scratch at {result.context} tokens (prefill)", _bytes(found.scratch(result.context)))
        table.add_row(f"{role}: one sequence of {result.context} tokens", _bytes(found.total(result.context)))
    table.add_row("speculation: fixed extra (draft weights, scratch)", _bytes(result.draft_weight_bytes))
    table.add_row("speculation: extra per sequence (draft KV)", _bytes(result.draft_bytes_per_sequence))
    table.add_row("sequences that fit without draft", str(result.sequences_without_draft))
    if result.draft is not None:
        table.add_row("sequences that fit with draft", str(result.sequences_with_draft))
    return table


def _bytes(n: int) -> str:
    """n bytes in binary units: B, KiB, MiB or GiB."""
    for unit, size in (("GiB", GIB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def _run_measure(
    target: str,
    draft: str | None,
    proposer: str,
    prompts: Path | None,
    categories: str | None,
    limit: int | None,
    gammas: str,
    max_new_tokens: int,
    dtype: str,
    quantization: str,
    group_size: int,
    out: Path,
    json_output: bool,
) -> None:
    """``plan --measure``: α, c and v(k) measured on the workloads, every gamma predicted (plan.json, plan.png)."""
    from rich.progress import Progress

    from specdecode.bench.measure import measure as run_measure
    from specdecode.bench.measure import measurement_summary, write_measurement
    from specdecode.bench.session import parse_gammas, split_list
    from specdecode.bench.workloads import default_items, load_items, select_items

    if proposer not in ("lookup", "draft"):
        raise ValueError(f"--proposer must be lookup or draft, got {proposer!r}")
    gamma_list = parse_gammas(gammas, allow_auto=False)
    wanted = split_list(categories, "--categories")
    items = select_items(load_items(prompts) if prompts else default_items(), wanted, limit)
    out.mkdir(parents=True, exist_ok=True)
    loaded = factory.load(target, dtype, quantization, group_size)
    console = Console(stderr=True)
    with Progress(console=console) as progress:
        task = progress.add_task("measuring", total=len(items) * (len(gamma_list) + 1))
        found = run_measure(
            loaded, proposer, draft, items, gamma_list, max_new_tokens,
            on_progress=lambda what: progress.update(task, advance=1, description=what),
        )  # fmt: skip
    summary = measurement_summary(found, loaded.quantization)
    write_measurement(
        found, summary, f"{target}, {proposer}: α={found.alpha:.2f}, c={found.cost:.3f}, measured v(k)", out
    )
    if json_output:
        typer.echo(json.dumps(summary))
        return
    Console().print(_measure_table(found, target, proposer))
    Console().print(summary["verdict"])
    console.print(f"wrote plan.json and plan.png in {out}")


def _measure_table(found: Measurement, target: str, proposer: str) -> Table:
    """The predictions per gamma next to the measured speedups, the best gamma in bold."""
    best = found.best
    table = Table(title=f"{target}, {proposer}: α = {found.alpha:.3f}, c = {found.cost:.3f}, measured v(k)")
    for name in ("γ", "v(γ+1)", "predicted (i.i.d. α)", "predicted (per position)", "measured"):
        table.add_column(name, justify="right")
    for p in found.predictions:
        table.add_row(
            str(p.gamma),
            f"{found.verify_cost[p.gamma + 1]:.2f}",
            f"{p.iid:.2f}×",
            f"{p.per_position:.2f}×",
            "" if p.measured is None else f"{p.measured:.2f}×",
            style="bold" if p is best else None,
        )
    return table
