"""``specdecode plan --measure``: measure α (overall and per position), c and v(k), then predict and recommend.

Runs our plain decode and one proposer at a few gammas on the same prompts (interleaved, as the bench does),
so that every predicted speedup can be set next to a measured one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..models.loaded import LoadedModel
from ..planner import MAX_GAMMA, VerifyCost, expected_tokens_per_position, speedup
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
