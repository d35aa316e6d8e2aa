"""`specdecode plan`: predict the speedup from α and c, or (--memory) how many sequences fit."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from specdecode.commands import parse_quantization, usage_errors
from specdecode.planner import (
    MemoryPlan,
    ModelMemory,
    SpeedupPlan,
    VerifyCost,
    dtype_bytes,
    plan_speedup,
    speedup_table,
)

if TYPE_CHECKING:
    from specdecode.models.memory import Footprint

GIB = 2**30


VerifyCostOption = Annotated[
    Path | None,
    typer.Option(
        "--verify-cost",
        help='JSON file, {"k": cost, ...} or a list of costs for k = 1, 2, ...: the cost of a '
        "k-token target forward relative to a 1-token one.",
    ),
]
MemoryOption = Annotated[
    bool,
    typer.Option(
        "--memory",
        help="Plan memory instead: the weights in RAM and mapped from the file, the KV cache and position "
        "tables per token, the scratch per row and at --context, and how many sequences fit --budget.",
    ),
]
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


def plan(
    alpha: Annotated[float | None, typer.Option(help="Per-token acceptance probability α in [0, 1].")] = None,
    cost: Annotated[
        float | None, typer.Option(help="Cost c of one draft step relative to one target step (>= 0).")
    ] = None,
    gamma: Annotated[
        int | None, typer.Option(help="Draft tokens per round (>= 1); default: the best gamma in 1..16.")
    ] = None,
    verify_cost: VerifyCostOption = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    memory: MemoryOption = False,
    target: Annotated[str | None, typer.Option(help="--memory: the target (name, folder or .gguf).")] = None,
    draft: Annotated[str | None, typer.Option(help="--memory: the draft model, if any.")] = None,
    context: Annotated[int | None, typer.Option(help="--memory: tokens per sequence (prompt and output).")] = None,
    budget: Annotated[
        float | None, typer.Option(help="--memory: memory budget in GiB (default: what is available now).")
    ] = None,
    dtype: Annotated[str, typer.Option(help="--memory/--measure: dtype of weights and KV cache.")] = "float32",
    quantization: QuantizationOption = "auto",
    group_size: Annotated[int, typer.Option(help="--memory/--measure: int4 group size (32, 64, 128, 256).")] = 32,
    measure: MeasureOption = False,
    proposer: Annotated[str, typer.Option(help="--measure: lookup or draft.")] = "lookup",
    prompts: Annotated[
        Path | None, typer.Option(help="--measure: FastChat JSONL (default: the bench's built-in set).")
    ] = None,
    categories: Annotated[str | None, typer.Option(help="--measure: comma list of subtasks to keep.")] = None,
    limit: Annotated[int | None, typer.Option(help="--measure: at most N questions per subtask.")] = None,
    gammas: Annotated[str, typer.Option(help="--measure: gammas to run and compare with predictions.")] = "2,4,8",
    max_new_tokens: Annotated[int, typer.Option(help="--measure: new tokens per answer.")] = 128,
    out: Annotated[Path, typer.Option(help="--measure: folder for plan.json and plan.png.")] = Path("plan-out"),
) -> None:
    """Predict the speedup for α, c and γ; or measure them (--measure); or plan memory (--memory)."""
    with usage_errors():
        stored = _quantization(quantization, group_size)
        if measure:
            _run_measure(
                target or "smollm2",
                draft,
                proposer,
                prompts,
                categories,
                limit,
                gammas,
                max_new_tokens,
                dtype,
                stored,
                group_size,
                out,
                json_output,
            )
        elif memory:
            _run_memory(target, draft, context, budget, dtype, stored, group_size, json_output)
        else:
            _run_speedup(alpha, cost, gamma, verify_cost, json_output)


def _quantization(text: str, group_size: int) -> str | None:
    """``--quantization`` as ``load_model`` takes it, checked before any model loads."""
    from specdecode.models.formats.weights import GROUP_SIZES

    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size}")
    return parse_quantization(text)


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
        raise ValueError("give --alpha and --cost (or --memory with --target, --context and --budget)")
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
    target: str | None,
    draft: str | None,
    context: int | None,
    budget: float | None,
    dtype: str,
    quantization: str | None,
    group_size: int,
    json_output: bool,
) -> None:
    if target is None or context is None:
        raise ValueError("--memory needs --target and --context (tokens per sequence); --budget is optional")
    # Fail on bad values before spending time loading models.
    if context < 1:
        raise ValueError(f"--context must be >= 1 token, got {context}")
    if budget is not None and not budget > 0:
        raise ValueError(f"--budget must be > 0 GiB, got {budget}")
    dtype_bytes(dtype)
    budget_bytes = _budget_bytes(budget)
    target_found, target_stored = _measured_memory(target, dtype, quantization, group_size)
    draft_found, draft_stored = (
        (None, None) if draft is None else _measured_memory(draft, dtype, quantization, group_size)
    )
    result = MemoryPlan(
        _model_memory(target_found, context),
        None if draft_found is None else _model_memory(draft_found, context),
        context,
        budget_bytes,
    )
    if json_output:
        found = _footprint_summary("target", target_found, context) | _footprint_summary("draft", draft_found, context)
        summary = memory_summary(result) | found | {"target_stored": target_stored, "draft_stored": draft_stored}
        typer.echo(json.dumps(summary))
    else:
        draft_label = None if draft is None else f"{draft}, {draft_stored}"
        table = _memory_table(result, f"{target}, {target_stored}", draft_label, dtype, target_found, draft_found)
        Console().print(table)


def _budget_bytes(budget: float | None) -> int:
    """``--budget`` GiB in bytes; by default the memory available now (``memory.available_memory``)."""
    if budget is not None:
        return int(budget * GIB)
    from specdecode.models.memory import available_memory

    available = available_memory()
    if available is None:
        raise ValueError("cannot tell the memory available here: give --budget (GiB)")
    return available[0]


def _model_memory(found: Footprint, context: int) -> ModelMemory:
    """The planner's view of a footprint: all weights, the KV cache and position tables per token, and the scratch
    of the largest pass at ``context``."""
    return ModelMemory(found.weights, found.kv_per_token, found.scratch(context), found.tables_per_token)


def _measured_memory(source: str, dtype: str, quantization: str | None, group_size: int) -> tuple[Footprint, str]:
    """Memory of a model as loaded (``memory.loaded_footprint``: the bytes its weights are held in, the KV cache
    per token in the dtype its runner keeps it, float16 on the compiled kernels; scratch), and how its weights are
    stored."""
    import specdecode  # deferred: loading models pulls in torch and transformers
    from specdecode.models.memory import loaded_footprint

    try:
        loaded = specdecode.load_model(source, dtype=dtype, quantization=quantization, group_size=group_size)
    except (OSError, specdecode.SpecDecodeError) as e:
        raise ValueError(f"cannot load model {source!r}: {e}") from e
    return loaded_footprint(loaded), _stored_as(loaded.quantization, group_size)


def _footprint_summary(role: str, found: Footprint | None, context: int) -> dict[str, int | None]:
    """A footprint's figures as JSON fields named ``{role}_...``."""
    figures = {
        "mapped_bytes": None if found is None else found.mapped,
        "repacked_bytes": None if found is None else found.repacked,
        "tables_bytes_per_token": None if found is None else found.tables_per_token,
        "scratch_bytes_per_row": None if found is None else found.scratch_per_row,
        "scratch_bytes": None if found is None else found.scratch(context),
    }
    return {f"{role}_{name}": value for name, value in figures.items()}


def _stored_as(quantization: str | None, group_size: int) -> str:
    if quantization is None:
        return "dense"
    return f"int4 (group {group_size})" if quantization == "int4" else quantization


def memory_summary(result: MemoryPlan) -> dict[str, int | None]:
    """The memory plan as flat JSON-ready numbers (bytes and sequence counts)."""
    return {
        "context": result.context,
        "budget_bytes": result.budget_bytes,
        "target_weight_bytes": result.target.weight_bytes,
        "target_kv_bytes_per_token": result.target.kv_bytes_per_token,
        "draft_weight_bytes": None if result.draft is None else result.draft.weight_bytes,
        "draft_kv_bytes_per_token": None if result.draft is None else result.draft.kv_bytes_per_token,
        "speculation_fixed_bytes": result.draft_weight_bytes,
        "speculation_bytes_per_sequence": result.draft_bytes_per_sequence,
        "sequences_without_draft": result.sequences_without_draft,
        "sequences_with_draft": result.sequences_with_draft,
    }


def _memory_table(
    result: MemoryPlan,
    target: str,
    draft: str | None,
    dtype: str,
    target_found: Footprint,
    draft_found: Footprint | None,
) -> Table:
    budget = _bytes(result.budget_bytes)
    table = Table(title=f"memory at {dtype}, {result.context} tokens/sequence, budget {budget}")
    table.add_column("")
    table.add_column("value", justify="right")
    for role, label, found in (("target", target, target_found), ("draft", draft, draft_found)):
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
    quantization: str | None,
    group_size: int,
    out: Path,
    json_output: bool,
) -> None:
    """``plan --measure``: α, c and v(k) measured on the workloads, every gamma predicted (plan.json, plan.png)."""
    from rich.progress import Progress

    from specdecode.bench.measure import measure as run_measure
    from specdecode.bench.plots import plot_plan_measurement
    from specdecode.bench.workloads import default_items, load_items, select_items
    from specdecode.commands.bench import _gammas, _split

    if proposer not in ("lookup", "draft"):
        raise ValueError(f"--proposer must be lookup or draft, got {proposer!r}")
    gamma_list = _gammas(gammas, allow_auto=False)
    items = select_items(load_items(prompts) if prompts else default_items(), _split(categories, "--categories"), limit)
    out.mkdir(parents=True, exist_ok=True)
    import specdecode

    loaded = specdecode.load_model(target, dtype=dtype, quantization=quantization, group_size=group_size)
    console = Console(stderr=True)
    with Progress(console=console) as progress:
        task = progress.add_task("measuring", total=len(items) * (len(gamma_list) + 1))
        found = run_measure(
            loaded,
            proposer,
            draft,
            items,
            gamma_list,
            max_new_tokens,
            on_progress=lambda what: progress.update(task, advance=1, description=what),
        )
    summary = _measure_summary(found, proposer, loaded.quantization)
    (out / "plan.json").write_text(json.dumps(summary, indent=2))
    preds = found.predictions
    plot_plan_measurement(
        [p.gamma for p in preds],
        [p.iid for p in preds],
        [p.per_position for p in preds],
        {p.gamma: p.measured for p in preds if p.measured is not None},
        f"{target}, {proposer}: α={found.alpha:.2f}, c={found.cost:.3f}, measured v(k)",
        out / "plan.png",
    )
    if json_output:
        typer.echo(json.dumps(summary))
        return
    Console().print(_measure_table(found, target, proposer))
    Console().print(summary["verdict"])
    console.print(f"wrote plan.json and plan.png in {out}")


def _measure_summary(found: Any, proposer: str, quantization: str | None) -> dict[str, Any]:
    """plan.json: α, c, v(k), the predictions per gamma, and the gamma recommended (0: decode plainly)."""
    best = found.best
    verdict = (
        f"recommend {proposer} with gamma {best.gamma}: predicted {best.per_position:.2f}x"
        if found.pays
        else f"speculation with {proposer} will NOT pay here: best predicted {best.per_position:.2f}x at gamma "
        f"{best.gamma}; decode plainly (or use --gamma auto, which switches itself off)"
    )
    return {
        "proposer": proposer,
        "quantization": quantization,
        "alpha": found.alpha,
        "per_position": found.per_position,
        "cost": found.cost,
        "verify_cost": found.verify_cost,
        "predictions": [dataclasses.asdict(p) for p in found.predictions],
        "recommended_gamma": best.gamma if found.pays else 0,
        "predicted_speedup": best.per_position if found.pays else 1.0,
        "verdict": verdict,
    }


def _measure_table(found: Any, target: str, proposer: str) -> Table:
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
