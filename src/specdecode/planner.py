"""The analytic model of speculative decoding: tokens per round, cost, speedup, best gamma, memory.

Units: the cost of one target forward over a single token is 1. A round drafts γ tokens (each costing
``cost`` = c) and verifies them in one target forward over γ+1 tokens, whose cost is 1 or, given a
measured curve, v(γ+1). With i.i.d. per-token acceptance α, a round yields E(α, γ) tokens, counting the
recovered/bonus token.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from operator import mul
from typing import Any

import numpy as np

MAX_GAMMA = 16
TABLE_GAMMAS = range(1, 11)

DTYPE_BYTES = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}


def _check_alpha(alpha: float) -> None:
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1] (a per-token acceptance probability), got {alpha}")


def _check_cost(cost: float) -> None:
    if not cost >= 0.0 or math.isinf(cost):
        raise ValueError(
            f"cost must be a finite number >= 0 (a draft step's cost relative to one target step), got {cost}"
        )


def _check_gamma(gamma: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, numbers.Integral) or gamma < 1:
        raise ValueError(f"gamma must be an integer >= 1 (draft tokens per round), got {gamma!r}")


@dataclass(frozen=True)
class VerifyCost:
    """Measured cost v(k) of a k-token target forward relative to a 1-token one, linear between points."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        for k, v in self.points:
            if isinstance(k, bool) or not isinstance(k, int) or k < 1:
                raise ValueError(f"verify-cost k must be an integer >= 1, got {k!r}")
            if not 0.0 < v < math.inf:
                raise ValueError(f"verify-cost values must be finite and > 0, got {v!r} at k={k}")
        ks = [k for k, _ in self.points]
        if not ks or ks[0] != 1:
            raise ValueError("a verify-cost curve needs its first point at k=1 (the 1-token forward)")
        if ks != sorted(set(ks)):
            raise ValueError(f"verify-cost points must have distinct, increasing k, got k={ks}")

    @classmethod
    def from_json(cls, data: Mapping[str, Any] | Sequence[Any]) -> VerifyCost:
        """Build from {"k": cost, ...} or a list [v(1), v(2), ...]; values are divided by v(1) if given."""
        if isinstance(data, Mapping):
            try:
                raw = {int(k): float(v) for k, v in data.items()}
            except (TypeError, ValueError) as e:
                raise ValueError(f'verify-cost must map integer k to a number, e.g. {{"1": 1.0}}: {e}') from e
        elif isinstance(data, Sequence) and not isinstance(data, str):
            try:
                raw = {k: float(v) for k, v in enumerate(data, start=1)}
            except (TypeError, ValueError) as e:
                raise ValueError(f"verify-cost list must hold numbers [v(1), v(2), ...]: {e}") from e
        else:
            raise ValueError('verify-cost must be a JSON object {"k": cost, ...} or a list [v(1), v(2), ...]')
        if not raw:
            raise ValueError("verify-cost curve is empty")
        if raw.get(1, 1.0) <= 0.0:
            raise ValueError(f"verify-cost values must be > 0, got {raw[1]} at k=1")
        base = raw.setdefault(1, 1.0)
        return cls(tuple((k, raw[k] / base) for k in sorted(raw)))

    @property
    def max_k(self) -> int:
        """Largest measured k."""
        return self.points[-1][0]

    def __call__(self, k: int) -> float:
        """v(k), linearly interpolated between measured points; no extrapolation past max_k."""
        if not 1 <= k <= self.max_k:
            raise ValueError(
                f"verify-cost curve covers k in [1, {self.max_k}] but k={k} was needed "
                f"(gamma={k - 1} verifies {k} tokens); measure larger k or use a smaller gamma"
            )
        ks, costs = zip(*self.points, strict=True)
        return float(np.interp(k, ks, costs))


def expected_tokens(alpha: float, gamma: int) -> float:
    """E(α, γ) = Σ_{i=0..γ} α^i = (1 - α^(γ+1)) / (1 - α); γ+1 at α = 1, 1 at α = 0."""
    _check_alpha(alpha)
    _check_gamma(gamma)
    return math.fsum(alpha**i for i in range(gamma + 1))


def expected_tokens_per_position(acceptance: Sequence[float]) -> float:
    """E = 1 + Σ_{i=1..γ} Π_{j≤i} a_j, with a_j = P(accept position j | positions < j accepted)."""
    if len(acceptance) < 1:
        raise ValueError("need at least one per-position acceptance probability (gamma >= 1)")
    for a in acceptance:
        _check_alpha(a)
    return 1.0 + math.fsum(accumulate(acceptance, mul))


def round_cost(gamma: int, cost: float, verify_cost: VerifyCost | None = None) -> float:
    """Cost of a round: 1 + γc, or v(γ+1) + γc with a measured verify-cost curve."""
    _check_gamma(gamma)
    _check_cost(cost)
    verify = 1.0 if verify_cost is None else verify_cost(gamma + 1)
    return verify + gamma * cost


def speedup(alpha: float, gamma: int, cost: float, verify_cost: VerifyCost | None = None) -> float:
    """Speedup over plain decoding: E(α, γ) / round cost."""
    return expected_tokens(alpha, gamma) / round_cost(gamma, cost, verify_cost)


@dataclass(frozen=True)
class GammaRow:
    """One γ's prediction: expected tokens per round, round cost, speedup = expected_tokens / round_cost."""

    gamma: int
    expected_tokens: float
    round_cost: float
    speedup: float


def gamma_row(alpha: float, gamma: int, cost: float, verify_cost: VerifyCost | None = None) -> GammaRow:
    """The prediction for one γ."""
    tokens = expected_tokens(alpha, gamma)
    cost_of_round = round_cost(gamma, cost, verify_cost)
    return GammaRow(gamma, tokens, cost_of_round, tokens / cost_of_round)


def _gammas(gammas: Iterable[int], verify_cost: VerifyCost | None) -> list[int]:
    """The γ values a verify-cost curve covers (γ+1 ≤ max_k); all of them without a curve."""
    return [g for g in gammas if verify_cost is None or g + 1 <= verify_cost.max_k]


def speedup_table(
    alpha: float, cost: float, verify_cost: VerifyCost | None = None, gammas: Iterable[int] = TABLE_GAMMAS
) -> tuple[GammaRow, ...]:
    """Rows for each γ in ``gammas`` (those a verify-cost curve covers)."""
    return tuple(gamma_row(alpha, g, cost, verify_cost) for g in _gammas(gammas, verify_cost))


@dataclass(frozen=True)
class BestGamma:
    """argmax_γ speedup over γ in 1..max_gamma (smallest γ on ties); plain decoding (γ=0) is 1.0×."""

    gamma: int
    speedup: float

    @property
    def plain_is_better(self) -> bool:
        """True when no γ ≥ 1 beats plain decoding's 1.0×."""
        return self.speedup <= 1.0


def best_gamma(
    alpha: float, cost: float, verify_cost: VerifyCost | None = None, max_gamma: int = MAX_GAMMA
) -> BestGamma:
    """The γ in 1..max_gamma with the highest speedup."""
    _check_gamma(max_gamma)
    rows = speedup_table(alpha, cost, verify_cost, range(1, max_gamma + 1))
    if not rows:
        raise ValueError("the verify-cost curve must cover k=2 (gamma=1 verifies 2 tokens)")
    best = max(rows, key=lambda r: (r.speedup, -r.gamma))
    return BestGamma(best.gamma, best.speedup)


def break_even_alpha(gamma: int, cost: float, verify_cost: VerifyCost | None = None) -> float | None:
    """The α in [0, 1) where E(α, γ) = round cost (speedup 1); None if even α → 1 does not pay."""
    from .errors import optional_import  # here: scipy costs ~0.3 s at `import specdecode`, and only this needs it

    brentq = optional_import("scipy.optimize", "bench", "the break-even α").brentq

    target = round_cost(gamma, cost, verify_cost)
    if target <= 1.0:
        return 0.0
    if target >= gamma + 1:
        return None
    return float(brentq(lambda a: expected_tokens(a, gamma) - target, 0.0, 1.0, xtol=1e-12, rtol=1e-12))


@dataclass(frozen=True)
class SpeedupPlan:
    """The planner's answer for one (α, c, γ): the prediction, the best γ and the break-even α."""

    alpha: float
    cost: float
    gamma: int
    expected_tokens: float
    round_cost: float
    speedup: float
    best_gamma: int
    best_speedup: float
    break_even_alpha: float | None


def plan_speedup(
    alpha: float, cost: float, gamma: int | None = None, verify_cost: VerifyCost | None = None
) -> SpeedupPlan:
    """Predict for γ (default: the best γ in 1..16) and report the best γ and the break-even α."""
    _check_alpha(alpha)
    _check_cost(cost)
    best = best_gamma(alpha, cost, verify_cost)
    row = gamma_row(alpha, best.gamma if gamma is None else gamma, cost, verify_cost)
    return SpeedupPlan(
        alpha=alpha,
        cost=cost,
        gamma=row.gamma,
        expected_tokens=row.expected_tokens,
        round_cost=row.round_cost,
        speedup=row.speedup,
        best_gamma=best.gamma,
        best_speedup=best.speedup,
        break_even_alpha=break_even_alpha(row.gamma, cost, verify_cost),
    )


# --- memory -------------------------------------------------------------------------------------------


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype given by name ("bfloat16") or as a torch.dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {', '.join(DTYPE_BYTES)}")
    return DTYPE_BYTES[name]


@dataclass(frozen=True)
class ModelMemory:
    """One model's memory: weight bytes, KV-cache bytes per token (and the runner's position tables per token),
    and the scratch of its largest pass."""

    weight_bytes: int
    kv_bytes_per_token: int
    scratch_bytes: int = 0
    table_bytes_per_token: int = 0

    def __post_init__(self) -> None:
        if self.weight_bytes < 0:
            raise ValueError(f"weight bytes must be >= 0, got {self.weight_bytes}")
        if self.scratch_bytes < 0 or self.table_bytes_per_token < 0:
            raise ValueError("scratch and table bytes must be >= 0")
        if self.kv_bytes_per_token < 1:
            raise ValueError(f"KV-cache bytes per token must be >= 1, got {self.kv_bytes_per_token}")


@dataclass(frozen=True)
class MemoryPlan:
    """How many sequences of ``context`` tokens fit in ``budget_bytes``, with and without a draft model."""

    target: ModelMemory
    draft: ModelMemory | None
    context: int
    budget_bytes: int

    def __post_init__(self) -> None:
        if isinstance(self.context, bool) or not isinstance(self.context, int) or self.context < 1:
            raise ValueError(f"context must be an integer >= 1 (tokens per sequence), got {self.context!r}")
        if self.budget_bytes <= 0:
            raise ValueError(f"the memory budget must be > 0, got {self.budget_bytes} bytes")

    @property
    def _target_fixed(self) -> int:
        return self.target.weight_bytes + self.target.scratch_bytes

    @property
    def target_bytes_per_sequence(self) -> int:
        """context · target KV (and position table) bytes per token."""
        return self.context * (self.target.kv_bytes_per_token + self.target.table_bytes_per_token)

    @property
    def draft_weight_bytes(self) -> int:
        """The fixed cost of speculation: the draft's weights and scratch (0 without a draft)."""
        return 0 if self.draft is None else self.draft.weight_bytes + self.draft.scratch_bytes

    @property
    def draft_bytes_per_sequence(self) -> int:
        """The per-sequence cost of speculation: context · draft KV (and position table) bytes per token."""
        if self.draft is None:
            return 0
        return self.context * (self.draft.kv_bytes_per_token + self.draft.table_bytes_per_token)

    @property
    def sequences_without_draft(self) -> int:
        """⌊(budget − target weights and scratch) / (context · target KV/token)⌋, at least 0."""
        return _fit(self.budget_bytes - self._target_fixed, self.target_bytes_per_sequence)

    @property
    def sequences_with_draft(self) -> int:
        """⌊(budget − target and draft weights and scratch) / (context · (target + draft KV/token))⌋, at least 0."""
        free = self.budget_bytes - self._target_fixed - self.draft_weight_bytes
        return _fit(free, self.target_bytes_per_sequence + self.draft_bytes_per_sequence)


def _fit(free_bytes: int, bytes_per_sequence: int) -> int:
    return max(0, free_bytes) // bytes_per_sequence
