"""``gamma="auto"``: choose each round's draft length from online estimates of acceptance and cost.

Each round the controller picks γ ∈ {0, …, max_gamma} maximising predicted tokens per unit time,
E(γ) / (v(γ+1) + γ·c), with E(γ) = 1 + Σ_{i≤γ} Π_{j≤i} a_j from per-position acceptance estimates a_j,
v(k) the cost of a k-token target forward relative to one token, and c a draft token's cost relative to one
target token (until a plain round has measured the 1-token step, γ = 0: a proposer that always drafts
would otherwise look free). γ = 0 is plain decoding (speedup 1 by definition); while it wins, γ = 1 is probed after
``probe_every`` plain rounds, an interval that doubles after each probe that does not change the verdict.
A proposer that drafts token trees verifies a tree's nodes, not γ tokens: for each γ that produced trees,
the cost model (shared by a decoder's requests) prices the round at the trees it measured,
v(rows) + draft seconds / step seconds.
Exactness does not depend on any of this: γ only changes between rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .planner import expected_tokens_per_position

PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0


@dataclass
class CostModel:
    """Online step costs, as exponential moving averages (``fixed`` costs never update): seconds of a
    1-token target forward, of a k-token forward for each k seen, extra seconds per extra verified token
    (the line used for k not seen yet), and seconds per drafted token.

    Per-k timings matter: on a CPU the k-token forward is often a step function of k (a GEMM kernel switch),
    which no line through two points describes.
    """

    step_seconds: float | None = None
    extra_token_seconds: float | None = None
    draft_token_seconds: float | None = None
    smoothing: float = 0.2
    fixed: bool = False
    verify_seconds: dict[int, float] = field(default_factory=dict)
    tree_rounds: dict[int, tuple[float, float]] = field(default_factory=dict)  # γ -> (rows, draft seconds)

    def observe(self, verified: int, verify_seconds: float, drafted: int, draft_seconds: float) -> None:
        """Fold one round's timings in (``verified`` = tokens in the target forward = drafted + 1)."""
        if self.fixed:
            return
        self.verify_seconds[verified] = self._ema(self.verify_seconds.get(verified), verify_seconds)
        if verified == 1:
            self.step_seconds = self._ema(self.step_seconds, verify_seconds)
        elif self.step_seconds is not None:
            extra = max(0.0, verify_seconds - self.step_seconds) / (verified - 1)
            self.extra_token_seconds = self._ema(self.extra_token_seconds, extra)
        if drafted:
            self.draft_token_seconds = self._ema(self.draft_token_seconds, draft_seconds / drafted)

    def observe_tree(self, gamma: int, rows: int, draft_seconds: float) -> None:
        """A round at ``gamma`` drafted a token tree: ``rows`` verified (its nodes + 1), drafting took
        ``draft_seconds``. From then on that γ is priced as the trees it produces (moving averages)."""
        if self.fixed:
            return
        old = self.tree_rounds.get(gamma)
        self.tree_rounds[gamma] = (
            (float(rows), draft_seconds)
            if old is None
            else (self._ema(old[0], float(rows)), self._ema(old[1], draft_seconds))
        )

    def round_cost(self, gamma: int) -> float:
        """A round at γ in 1-token steps: v(γ+1) + γc for a chain; v(rows) + drafting for γ's measured trees."""
        tree = self.tree_rounds.get(gamma)
        if tree is None:
            return self.verify_cost(gamma + 1) + gamma * self.draft_cost()
        rows, draft_seconds = tree
        return self.verify_cost(max(1, round(rows))) + (draft_seconds / self.step_seconds if self.step_seconds else 0.0)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.smoothing) * old + self.smoothing * new

    def verify_cost(self, tokens: int) -> float:
        """v(k): a k-token target forward relative to a 1-token one (measured at k, else the line; 1 at first)."""
        if not self.step_seconds:
            return 1.0
        if tokens in self.verify_seconds:
            return self.verify_seconds[tokens] / self.step_seconds
        if self.extra_token_seconds is None:
            return 1.0
        return 1.0 + (tokens - 1) * self.extra_token_seconds / self.step_seconds

    def draft_cost(self) -> float:
        """c: one drafted token relative to a 1-token target forward (0 until measured)."""
        if not self.step_seconds or self.draft_token_seconds is None:
            return 0.0
        return self.draft_token_seconds / self.step_seconds


@dataclass
class AdaptiveGamma:
    """Per-request draft-length controller (acceptance is per request; ``costs`` may be shared)."""

    max_gamma: int = 8
    costs: CostModel = field(default_factory=CostModel)
    probe_every: int = 8
    forgetting: float = 0.95
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    _plain_rounds: int = 0
    _probe_interval: int = 0
    _chosen: int = 0

    def __post_init__(self) -> None:
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        self.accepted = [0.0] * self.max_gamma
        self.reached = [0.0] * self.max_gamma
        self._probe_interval = self.probe_every

    def acceptance(self) -> list[float]:
        """Posterior-mean acceptance a_j per draft position (discounted counts). Position 1's prior is Beta(1, 1);
        position j's has the same weight, centred on a_{j-1}: a depth not reached yet is expected to accept like
        the one above it, not at 1/2 (which would keep a proposer that is always right from ever going deeper
        wherever a verify row costs more than half the gain)."""
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        mean = PRIOR_ACCEPTED / weight
        estimates = []
        for a, r in zip(self.accepted, self.reached, strict=True):
            mean = (a + weight * mean) / (r + weight)
            estimates.append(mean)
        return estimates

    def predicted_speedup(self, gamma: int) -> float:
        """E(γ) / (v(γ+1) + γc) from the current estimates; 1.0 for γ = 0."""
        if gamma == 0:
            return 1.0
        tokens = expected_tokens_per_position(self.acceptance()[:gamma])
        return tokens / self.costs.round_cost(gamma)

    def choose(self) -> int:
        """This round's γ: the best predicted, or a γ = 1 probe when plain decoding has won for a while."""
        self._chosen = self._choose()
        return self._chosen

    def _choose(self) -> int:
        if self.costs.step_seconds is None:  # calibrate: a plain round measures the 1-token step all costs use
            return 0
        best = max(range(self.max_gamma + 1), key=self.predicted_speedup)
        if best > 0:
            self._plain_rounds = 0
            self._probe_interval = self.probe_every
            return best
        self._plain_rounds += 1
        if self._plain_rounds >= self._probe_interval:
            self._plain_rounds = 0
            self._probe_interval *= 2
            return 1
        return 0

    def observe_tree(self, rows: int, draft_seconds: float) -> None:
        """The round at the last chosen γ drafted a tree of ``rows - 1`` nodes in ``draft_seconds``."""
        self.costs.observe_tree(self._chosen, rows, draft_seconds)

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold in one round: positions 1..accepted accepted, position accepted+1 rejected if < drafted."""
        reached = accepted + (accepted < drafted)
        for i in range(reached):
            self.accepted[i] = self.forgetting * self.accepted[i] + (i < accepted)
            self.reached[i] = self.forgetting * self.reached[i] + 1.0
