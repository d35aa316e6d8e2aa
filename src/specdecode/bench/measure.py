"""What ``specdecode plan`` measures. ``--measure``: α (overall and per position), c and v(k), then every gamma
predicted and one recommended: our plain decode and one proposer run at a few gammas on the same prompts (interleaved,
as the bench does), so that every predicted speedup can be set next to a measured one. ``--memory``: the models
loaded and what they hold (``memory.loaded_footprint``), and how many sequences fit a budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models.loaded import LoadedModel
from ..models.memory import Footprint
from ..planner import MAX_GAMMA, MemoryPlan, ModelMemory, VerifyCost, expected_tokens_per_position, speedup
from .methods import PLAIN, build_methods
from .metrics import OVERALL, merged_stats
from .runner import BenchConfig, BenchResult, run_bench
from .verify_curve import measure_verify_cost
from .workloads import WorkItem


@dataclass(frozen=True)
class GammaPrediction:
    """Predicted speedup at one γ: i.i.d. α formula and per-position product; measured where run."""

    gamma: int
    iid: float
    per_position: float
    measured: float | None


@dataclass(frozen=True)
class Measurement:
    """What plan --measure found: α, per-position acceptance, c, v(k), predictions and the verdict."""

    proposer: str
    alpha: float
    per_position: list[float]
    cost: float
    verify_cost: dict[int, float]
    predictions: list[GammaPrediction]
    result: BenchResult

    @property
    def best(self) -> GammaPrediction:
        """The γ with the highest per-position prediction."""
        return max(self.predictions, key=lambda p: p.per_position)

    @property
    def pays(self) -> bool:
        return self.best.per_position > 1.0


def per_position_speedup(
    acceptance: Sequence[float], alpha: float, gamma: int, cost: float, curve: VerifyCost
) -> float:
    """(1 + Σ_{i≤γ} Π_{j≤i} a_j) / (v(γ+1) + γc); positions never measured use the pooled α."""
    rates = [*acceptance[:gamma], *[alpha] * max(0, gamma - len(acceptance))]
    return expected_tokens_per_position(rates) / (curve(gamma + 1) + gamma * cost)


def measure(
    target: LoadedModel,
    proposer: str,
    draft: str | None,
    items: Sequence[WorkItem],
    gammas: Sequence[int] = (2, 4, 8),
    max_new_tokens: int = 128,
    curve_repeats: int = 3,
    on_progress: Callable[[str], None] | None = None,
) -> Measurement:
    """Measure v(k) for k ≤ 17, then run plain and ``proposer`` at ``gammas``; predict γ = 1..16."""
    verify_cost = measure_verify_cost(target, MAX_GAMMA + 1, repeats=curve_repeats)
    curve = VerifyCost.from_json({str(k): v for k, v in verify_cost.items()})
    methods = build_methods(target, [proposer], gammas, draft, transformers=False)
    if len(methods) < 2:
        raise ValueError("the draft proposer needs --draft PATH or --draft self:N")
    result = run_bench(target, items, methods, BenchConfig(max_new_tokens=max_new_tokens), verify_cost, on_progress)
    speculative = [m for m in methods if m.name != PLAIN]
    widest = max(speculative, key=lambda m: m.spec.gamma)
    stats = merged_stats(r for r in result.records if r.method == widest.name)
    if stats is None or not stats.drafted:
        raise ValueError(f"the {proposer} proposer drafted nothing on these prompts: speculation cannot pay")
    rows = result.aggregates[OVERALL]
    costs = [rows[m.name]["draft_cost"] for m in speculative if rows[m.name]["draft_cost"] is not None]
    cost = sum(costs) / len(costs)
    measured = {m.spec.gamma: rows[m.name]["speedup_vs_plain"] for m in speculative}
    predictions = [
        GammaPrediction(
            g,
            speedup(stats.alpha, g, cost, curve),
            per_position_speedup(stats.per_position_rate, stats.alpha, g, cost, curve),
            measured.get(g),
        )
        for g in range(1, MAX_GAMMA + 1)
    ]
    return Measurement(proposer, stats.alpha, stats.per_position_rate, cost, verify_cost, predictions, result)


def measurement_summary(found: Measurement, quantization: str | None) -> dict[str, Any]:
    """plan.json: α, c, v(k), the predictions per gamma, and the gamma recommended (0: decode plainly)."""
    best = found.best
    verdict = (
        f"recommend {found.proposer} with gamma {best.gamma}: predicted {best.per_position:.2f}x"
        if found.pays
        else f"speculation with {found.proposer} will NOT pay here: best predicted {best.per_position:.2f}x at gamma "
        f"{best.gamma}; decode plainly (or use --gamma auto, which switches itself off)"
    )
    return {
        "proposer": found.proposer,
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


def write_measurement(found: Measurement, summary: dict[str, Any], title: str, out: Path) -> None:
    """plan.json (``summary``) and plan.png (the predictions per gamma beside the measured speedups) in ``out``."""
    import json

    from .plots import plot_plan_measurement

    (out / "plan.json").write_text(json.dumps(summary, indent=2))
    preds = found.predictions
    plot_plan_measurement(
        [p.gamma for p in preds],
        [p.iid for p in preds],
        [p.per_position for p in preds],
        {p.gamma: p.measured for p in preds if p.measured is not None},
        title,
        out / "plan.png",
    )


@dataclass(frozen=True)
class MemoryReport:
    """``plan --memory``: the plan, and each model's footprint as loaded and how its weights are stored."""

    plan: MemoryPlan
    target: Footprint
    target_stored: str
    draft: Footprint | None
    draft_stored: str | None

    def summary(self) -> dict[str, Any]:
        """Flat JSON-ready numbers (bytes and sequence counts), each footprint's figures named by its role."""
        result = self.plan
        figures = {
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
        found = _footprint_figures("target", self.target, result.context)
        found |= _footprint_figures("draft", self.draft, result.context)
        return figures | found | {"target_stored": self.target_stored, "draft_stored": self.draft_stored}


def memory_report(
    target: str,
    draft: str | None,
    context: int,
    budget_bytes: int | None,
    dtype: str,
    quantization: str,
    group_size: int,
) -> MemoryReport:
    """Load ``target`` (and ``draft``) as asked (``quantization`` as the CLI words it) and plan ``context``-token
    sequences in ``budget_bytes`` (default: the memory available now, ``memory.available_memory``)."""
    from ..models.memory import available_memory

    if budget_bytes is None:
        available = available_memory()
        if available is None:
            raise ValueError("cannot tell the memory available here: give --budget (GiB)")
        budget_bytes = available[0]
    target_found, target_stored = _measured_memory(target, dtype, quantization, group_size)
    draft_found, draft_stored = (
        (None, None) if draft is None else _measured_memory(draft, dtype, quantization, group_size)
    )
    plan = MemoryPlan(
        _model_memory(target_found, context),
        None if draft_found is None else _model_memory(draft_found, context),
        context,
        budget_bytes,
    )
    return MemoryReport(plan, target_found, target_stored, draft_found, draft_stored)


def _model_memory(found: Footprint, context: int) -> ModelMemory:
    """The planner's view of a footprint: all weights, the KV cache and position tables per token, and the scratch
    of the largest pass at ``context``."""
    return ModelMemory(found.weights, found.kv_per_token, found.scratch(context), found.tables_per_token)


def _measured_memory(source: str, dtype: str, quantization: str, group_size: int) -> tuple[Footprint, str]:
    """Memory of a model as loaded (``memory.loaded_footprint``: the bytes its weights are held in, the KV cache
    per token in the dtype its runner keeps it, float16 on the compiled kernels; scratch), and how its weights are
    stored (``quantization`` as the CLI words it)."""
    from .. import factory
    from ..errors import SpecDecodeError
    from ..models.memory import loaded_footprint

    try:
        loaded = factory.load(source, dtype, quantization, group_size)
    except (OSError, SpecDecodeError) as e:
        raise ValueError(f"cannot load model {source!r}: {e}") from e
    if loaded.quantization is None:
        stored = "dense"
    else:
        stored = f"int4 (group {group_size})" if loaded.quantization == "int4" else loaded.quantization
    return loaded_footprint(loaded), stored


def _footprint_figures(role: str, found: Footprint | None, context: int) -> dict[str, int | None]:
    """A footprint's figures as JSON fields named ``{role}_...``."""
    figures = {
        "mapped_bytes": None if found is None else found.mapped,
        "repacked_bytes": None if found is None else found.repacked,
        "tables_bytes_per_token": None if found is None else found.tables_per_token,
        "scratch_bytes_per_row": None if found is None else found.scratch_per_row,
        "scratch_bytes": None if found is None else found.scratch(context),
    }
    return {f"{role}_{name}": value for name, value in figures.items()}
