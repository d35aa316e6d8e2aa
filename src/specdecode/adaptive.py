"""``gamma="auto"``: choose each round's draft length from online estimates of acceptance and cost.

Each round the controller picks γ ∈ {0, …, max_gamma} maximising predicted tokens per unit time,
E(γ) / (v(γ+1) + γ·c), with E(γ) = 1 + Σ_{i≤γ} Π_{j≤i} a_j from per-position acceptance estimates a_j,
v(k) the cost of a k-token target forward relative to one token, and c a draft token's cost relative to one
target token (until a plain round has measured the 1-token step, γ = 0: a proposer that always drafts
would otherwise look free). a_1 enters the choice raised by one posterior standard deviation: a plain round
observes no acceptance, so choosing on the mean would leave a paying proposer idle after a chance dip.
γ = 0 is plain decoding (speedup 1 by definition); while it wins, γ = 1 is probed after
``probe_every`` plain rounds, an interval that doubles after each probe that does not change the verdict.
Timings age: a cost last measured n rounds ago keeps (1 - smoothing)^n of its weight, but at least half, when it
is measured again, and a drafting stretch re-times the 1-token step with one plain round every ``refresh_every``
rounds, so v(k) compares times taken close together.
γ reaches at most twice the deepest round the decoder has timed (an unmeasured v(k) reads as the line through
the measured ones, or 1: a guess, not a price to jump to the cap on).
A decoder's ``AcceptanceMemory`` carries acceptance across its requests: a new request starts from the
decoder's recent acceptance instead of 1/2, and while a request decodes plainly its own evidence ages back
toward that memory, so a dip in acceptance does not switch a proposer that pays off for the rest of the request.
A proposer that drafts token trees verifies a tree's nodes, not γ tokens: for each γ that produced trees,
the cost model (shared by a decoder's requests) prices the round at the trees it measured,
v(rows) + draft seconds / step seconds.
A proposer that drafts two ways (``HybridProposer``: a copied run, or a model's guesses) gets ``HybridGamma``: one
controller per side, each with its own acceptance and its own drafting price (the cost model keeps drafting prices
per ``drafter``), the target's times shared; the side that would draft a round (the proposer's ``preview``) chooses
its length, so a head's ~45% never prices a ~90% copy, nor a cheap copy a head's guess.
Exactness does not depend on any of this: γ only changes between rounds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from .planner import expected_tokens_per_position

PRIOR_ACCEPTED = 1.0
PRIOR_REJECTED = 1.0
MEMORY_WEIGHT = 8.0  # a request's prior from the decoder's memory counts as this many rounds of its own
RECENT_ROUNDS = 16  # times taken within this many rounds are compared to filter out a lone spike


def fold_round(accepted: list[float], reached: list[float], drafted: int, n_accepted: int, forgetting: float) -> None:
    """Discounted counts, in place: positions 1..n_accepted accepted, position n_accepted + 1 rejected if drafted."""
    for i in range(n_accepted + (n_accepted < drafted)):
        accepted[i] = forgetting * accepted[i] + (i < n_accepted)
        reached[i] = forgetting * reached[i] + 1.0


def posterior_means(
    accepted: list[float], reached: list[float], prior: list[float] | None = None, weight: float = MEMORY_WEIGHT
) -> list[float]:
    """Acceptance per position from discounted counts: (accepted_j + w m_j) / (reached_j + w), prior mean m_j from
    ``prior`` (weight ``weight``) or, without one, Beta(1, 1) at position 1 and the estimate above at position j
    (a depth not reached yet is expected to accept like the one above it, not at 1/2, which would keep a proposer
    that is always right from ever going deeper wherever a verify row costs more than half the gain)."""
    if prior is None:
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
    mean = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)
    estimates = []
    for j, (a, r) in enumerate(zip(accepted, reached, strict=True)):
        if prior is not None:
            mean = prior[j]
        mean = (a + weight * mean) / (r + weight)
        estimates.append(mean)
    return estimates


@dataclass
class CostModel:
    """Online step costs, as moving averages over rounds (``fixed`` costs never update): seconds of a
    1-token target forward, of a k-token forward for each k seen, extra seconds per extra verified token
    (the line used for k not seen yet), and seconds per drafted token for each ``drafter`` (a name: "" for a
    decoder's one proposer, a hybrid's "copy" and "model" sides; the target's times are the same for all).

    Per-k timings matter: on a CPU the k-token forward is often a step function of k (a GEMM kernel switch),
    which no line through two points describes. An estimate ages: it keeps (1 - smoothing)^n of its weight (but
    at least half) when it is next measured n rounds later, so a v(k) = t(k) / t(1) does not divide a fresh
    time by one taken a hundred rounds earlier (forward times drift with the context and with what ran in
    between: through one plain stretch the 1-token step fell from 3.24 to 2.74 ms while the 2-token time stayed
    at the 3.32 ms taken before it, and v(2) read 1.21 instead of ~1.0; docs/BENCHMARKS.md).
    """

    step_seconds: float | None = None
    extra_token_seconds: float | None = None
    draft_token_seconds: dict[str, float] = field(default_factory=dict)  # drafter -> seconds a drafted token
    smoothing: float = 0.2
    fixed: bool = False
    verify_seconds: dict[int, float] = field(default_factory=dict)
    tree_rounds: dict[tuple[str, int], tuple[float, float]] = field(default_factory=dict)  # (drafter, γ) -> rows, s
    rounds: int = 0  # rounds observed: the clock estimates age by
    measured_at: dict[object, int] = field(default_factory=dict)  # estimate -> the round it was last measured in
    recent: dict[object, list[tuple[int, float]]] = field(default_factory=dict)  # estimate -> its last (round, time)s

    def observe(
        self, verified: int, verify_seconds: float, drafted: int, draft_seconds: float | None, drafter: str = ""
    ) -> None:
        """Fold one round's timings in (``verified`` = tokens in the target forward = drafted + 1; ``draft_seconds``
        None: not a drafting price, e.g. the proposer caught up on rounds it did not draft; ``drafter``: whose)."""
        if self.fixed:
            return
        self.rounds += 1
        old = self.verify_seconds.get(verified)
        self.verify_seconds[verified] = self._ema(("verify", verified), old, verify_seconds)
        if verified == 1:
            self.step_seconds = self._ema("step", self.step_seconds, verify_seconds)
        elif self.step_seconds is not None:
            extra = max(0.0, verify_seconds - self.step_seconds) / (verified - 1)
            self.extra_token_seconds = self._ema("extra", self.extra_token_seconds, extra)
        if drafted and draft_seconds is not None:
            old = self.draft_token_seconds.get(drafter)
            self.draft_token_seconds[drafter] = self._ema(("draft", drafter), old, draft_seconds / drafted)

    def observe_tree(self, gamma: int, rows: int, draft_seconds: float, drafter: str = "") -> None:
        """A round at ``gamma`` drafted a token tree: ``rows`` verified (its nodes + 1), drafting took
        ``draft_seconds``. From then on that γ is priced as the trees ``drafter`` produces (moving averages)."""
        if self.fixed:
            return
        old = self.tree_rounds.get((drafter, gamma))
        keep = self._keep(("tree", drafter, gamma))
        self.tree_rounds[drafter, gamma] = (
            (float(rows), draft_seconds)
            if old is None
            else (keep * old[0] + (1 - keep) * rows, keep * old[1] + (1 - keep) * draft_seconds)
        )

    def frontier(self, max_gamma: int) -> int:
        """The largest γ worth pricing now: twice the deepest round measured (1 before any), so γ grows 1, 2, 4, 8
        instead of trusting an unmeasured v(k) (1, or a line through one point) for a jump to the cap."""
        if self.fixed:
            return max_gamma
        deepest = max([k - 1 for k in self.verify_seconds] + [gamma for _, gamma in self.tree_rounds], default=0)
        return min(max_gamma, max(1, 2 * deepest))

    def round_cost(self, gamma: int, drafter: str = "") -> float:
        """A round at γ in 1-token steps: v(γ+1) + γc for a chain; v(rows) + drafting for γ's measured trees."""
        tree = self.tree_rounds.get((drafter, gamma))
        if tree is None:
            return self.verify_cost(gamma + 1) + gamma * self.draft_cost(drafter)
        rows, draft_seconds = tree
        return self.verify_cost(max(1, round(rows))) + (draft_seconds / self.step_seconds if self.step_seconds else 0.0)

    def rounds_since_step(self) -> int:
        """Rounds observed since the 1-token step was last timed (0 for fixed costs: they never go stale)."""
        return 0 if self.fixed else self.rounds - self.measured_at.get("step", 0)

    def _keep(self, estimate: object) -> float:
        """The weight an estimate's old value keeps at this round's measurement: (1 - smoothing)^n, n the rounds
        since the last one, but at least min(1 - smoothing, 1/2): one time after a gap moves an estimate halfway
        at most (a forward here now and then takes 1.3-1.6x its usual time); records this round as its latest."""
        age = self.rounds - self.measured_at.get(estimate, self.rounds - 1)
        self.measured_at[estimate] = self.rounds
        keep = 1 - self.smoothing
        return max(min(keep, 0.5), keep ** max(1, age))

    def _ema(self, estimate: object, old: float | None, new: float) -> float:
        keep = self._keep(estimate)
        new = self._filtered(estimate, new)
        return new if old is None else keep * old + (1 - keep) * new

    def _filtered(self, estimate: object, new: float) -> float:
        """A time with a lone spike filtered out: the median of this estimate's last 3 times taken within
        ``RECENT_ROUNDS`` rounds (the lower of 2; the time itself when alone). A forward or a draft here now and
        then takes 2-3x its usual time (the OS, another thread); moved a fifth to a half of the way by it, a per-k
        time that is not measured again for a while (γ auto then drafts at another k) kept v(2) at 2.3 instead of
        1.2 and sent γ auto to γ2-3 at 40% acceptance (docs/BENCHMARKS.md)."""
        times = [(at, t) for at, t in self.recent.get(estimate, []) if self.rounds - at < RECENT_ROUNDS]
        times = [*times[-2:], (self.rounds, new)]
        self.recent[estimate] = times
        values = sorted(t for _, t in times)
        return values[1] if len(values) == 3 else values[0]

    def verify_cost(self, tokens: int) -> float:
        """v(k): a k-token target forward relative to a 1-token one (measured at k, else the line; 1 at first)."""
        if not self.step_seconds:
            return 1.0
        if tokens in self.verify_seconds:
            return self.verify_seconds[tokens] / self.step_seconds
        if self.extra_token_seconds is None:
            return 1.0
        return 1.0 + (tokens - 1) * self.extra_token_seconds / self.step_seconds

    def draft_cost(self, drafter: str = "") -> float:
        """c: one token ``drafter`` drafts relative to a 1-token target forward (0 until measured)."""
        seconds = self.draft_token_seconds.get(drafter)
        if not self.step_seconds or seconds is None:
            return 0.0
        return seconds / self.step_seconds


@dataclass
class AcceptanceMemory:
    """A decoder's acceptance per draft position over its recent requests (counts discounted by ``forgetting``
    a round, ~200 rounds): the prior a new request's controller starts from."""

    max_gamma: int = 8
    forgetting: float = 0.995
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.accepted = [0.0] * self.max_gamma
        self.reached = [0.0] * self.max_gamma

    def observe(self, drafted: int, accepted: int) -> None:
        fold_round(self.accepted, self.reached, drafted, accepted, self.forgetting)

    def acceptance(self, depth: int) -> list[float] | None:
        """Posterior means for positions 1..depth, or None before any round was drafted."""
        if not self.reached or not self.reached[0]:
            return None
        estimates = posterior_means(self.accepted, self.reached)
        return (estimates + estimates[-1:] * depth)[:depth]


@dataclass
class AdaptiveGamma:
    """Per-request draft-length controller (acceptance is per request; ``costs`` and ``memory`` may be shared)."""

    max_gamma: int = 8
    costs: CostModel = field(default_factory=CostModel)
    memory: AcceptanceMemory | None = None
    probe_every: int = 8
    refresh_every: int = 32  # a drafting stretch re-times the 1-token step with a plain round this often
    optimism: float = 1.0  # a_1 is raised by this many posterior standard deviations when choosing
    forgetting: float = 0.95
    drafter: str = ""  # whose drafting price the cost model reads (a hybrid's side)
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)
    _plain_rounds: int = 0
    _probe_interval: int = 0
    _chosen: int = 0
    _catching_up: bool = True

    def __post_init__(self) -> None:
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        self.accepted = [0.0] * self.max_gamma
        self.reached = [0.0] * self.max_gamma
        self._probe_interval = self.probe_every

    def acceptance(self) -> list[float]:
        """Posterior-mean acceptance a_j per draft position: this request's discounted counts on a prior that is
        the decoder's memory (weight ``MEMORY_WEIGHT``) when it has one, else Beta(1, 1) chained down the depths
        (``posterior_means``)."""
        prior = None if self.memory is None else self.memory.acceptance(self.max_gamma)
        return posterior_means(self.accepted, self.reached, prior)

    def predicted_speedup(self, gamma: int) -> float:
        """E(γ) / (v(γ+1) + γc) from the current estimates; 1.0 for γ = 0."""
        if gamma == 0:
            return 1.0
        tokens = expected_tokens_per_position(self.acceptance()[:gamma])
        return tokens / self.costs.round_cost(gamma, self.drafter)

    def choose(self, cap: int | None = None) -> int:
        """This round's γ ≤ ``cap`` (default ``max_gamma``; a copy can offer fewer tokens): the best predicted, or a
        γ = 1 probe when plain decoding has won for a while."""
        self._catching_up = self._chosen == 0
        self._chosen = self._choose(self.max_gamma if cap is None else min(cap, self.max_gamma))
        return self._chosen

    @property
    def catching_up(self) -> bool:
        """Whether this round follows a plain one (or opens the request): a proposer that drafts from the
        context's state (a draft model's cache, an EAGLE head's) first catches up on the tokens it did not
        draft, so this round's drafting time is not the price of drafting (priced as one, a catch-up makes
        drafting look dear, decoding goes plain, and the next catch-up is longer: docs/BENCHMARKS.md)."""
        return self._catching_up

    def optimistic_acceptance(self) -> list[float]:
        """``acceptance()`` with a_1 raised by ``optimism`` posterior standard deviations, sqrt(a(1 - a) / (n + 1)),
        n = the discounted rounds behind the estimate: the request's that reached position 1 plus its prior's (the
        decoder's memory's, at least ``MEMORY_WEIGHT``; 2 for Beta(1, 1)). A plain round observes nothing, so
        drafting or not is a bandit with one silent arm: choosing on the mean leaves a proposer that pays idle
        after a chance dip until a probe. Replayed on the shipped EAGLE head's accept/reject sequences (70 prompts,
        costs fixed; docs/BENCHMARKS.md): 1.138 -> 1.157x plain at a γ1 round cost of 1.15 steps, 1.096 -> 1.109x
        at 1.21, 1.035 -> 1.042x at 1.30."""
        estimates = self.acceptance()
        prior = PRIOR_ACCEPTED + PRIOR_REJECTED
        if self.memory is not None and self.memory.reached[0]:
            prior = max(MEMORY_WEIGHT, self.memory.reached[0])
        a = estimates[0]
        estimates[0] = min(1.0, a + self.optimism * math.sqrt(a * (1 - a) / (self.reached[0] + prior + 1)))
        return estimates

    def _best(self, cap: int) -> int:
        """argmax over γ ≤ min(``cap``, the cost model's frontier) of E(γ) / round cost, γ = 0 (speedup 1)
        included, on the optimistic acceptance."""
        best, best_speedup, tokens, reach = 0, 1.0, 1.0, 1.0
        frontier = self.costs.frontier(cap)
        for gamma, a in enumerate(self.optimistic_acceptance()[:frontier], start=1):
            reach *= a
            tokens += reach
            speedup = tokens / self.costs.round_cost(gamma, self.drafter)
            if speedup > best_speedup:
                best, best_speedup = gamma, speedup
        return best

    def _choose(self, cap: int) -> int:
        if cap < 1:
            return 0
        if self.costs.step_seconds is None:  # calibrate: a plain round measures the 1-token step all costs use
            return 0
        if self.costs.rounds_since_step() >= self.refresh_every:  # re-time it: v(k) divides by it (not a verdict)
            return 0
        best = self._best(cap)
        if best > 0:
            self._plain_rounds = 0
            self._probe_interval = self.probe_every
            return best
        if self.memory is not None and self.memory.reached[0]:  # evidence ages toward the decoder's memory
            self.accepted = [self.forgetting * a for a in self.accepted]
            self.reached = [self.forgetting * r for r in self.reached]
        self._plain_rounds += 1
        if self._plain_rounds >= self._probe_interval:
            self._plain_rounds = 0
            self._probe_interval *= 2
            return 1
        return 0

    def observe_tree(self, rows: int, draft_seconds: float) -> None:
        """The round at the last chosen γ drafted a tree of ``rows - 1`` nodes in ``draft_seconds`` (not a
        price while ``catching_up``)."""
        if not self._catching_up:
            self.costs.observe_tree(self._chosen, rows, draft_seconds, self.drafter)

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold in one round: positions 1..accepted accepted, position accepted+1 rejected if < drafted."""
        fold_round(self.accepted, self.reached, drafted, accepted, self.forgetting)
        if self.memory is not None:
            self.memory.observe(drafted, accepted)


class SidePreview(Protocol):
    """A proposer that drafts two ways (``HybridProposer``)."""

    last_side: str | None

    def preview(self, context: list[int], k: int) -> tuple[str, int]: ...


@dataclass
class HybridGamma:
    """``gamma="auto"`` for a proposer that drafts two ways (``HybridProposer``: a copied run or a model's guesses).

    Each round the proposer's ``preview`` names the side that would draft and how many tokens it offers (a copied
    run's length; the model's ``model_gamma``), and that side's controller chooses the round's γ within that offer
    from the side's own acceptance and drafting price (the cost model's ``drafter`` "copy" or "model"); γ = 0 is a
    plain round. So a copy of ~90% acceptance is not cut to one token by a head's ~45%, a head that does not pay
    here rests while copies go on, and prompt lookup's copy (k tokens after an n-gram, however far it earns) is not
    run to ``max_gamma`` where its acceptance and v(k) say a shorter one pays more (eagle+lookup on Spec-Bench:
    1.13x plain against 1.03x at γ8; docs/BENCHMARKS.md). A copier that sizes its own drafts (suffix decoding) is
    taken as offered.
    A round's drafting time is a price only when the same side drafted the round before (else it holds the side's
    catch-up: an EAGLE head first computes the features of the tokens it did not draft).
    """

    proposer: SidePreview
    context: list[int]  # the request's context, the list the decoder grows
    sides: dict[str, AdaptiveGamma]
    max_gamma: int = 8
    _chosen: int = 0
    _previous: str | None = None  # the side that drafted the last observed round (None: a plain round)
    _catching_up: bool = True

    @classmethod
    def for_request(
        cls,
        proposer: SidePreview,
        context: list[int],
        max_gamma: int,
        costs: CostModel,
        memories: dict[str, AcceptanceMemory],
    ) -> HybridGamma:
        """A request's controller: one ``AdaptiveGamma`` a side, the decoder's ``costs`` and per-side ``memories``
        (created here on first use) shared."""
        sides = {}
        for side in ("copy", "model"):
            memory = memories.setdefault(side, AcceptanceMemory(max_gamma))
            sides[side] = AdaptiveGamma(max_gamma, costs, memory, drafter=side)
        return cls(proposer, context, sides, max_gamma)

    def choose(self) -> int:
        """This round's γ: the previewed side's choice, at most what that side offers; a copy as offered where the
        copier sizes its own drafts (``copier_sizes_its_drafts``: suffix decoding's depth and node costs)."""
        side, offered = self.proposer.preview(self.context, self.max_gamma)
        if side == "copy" and getattr(self.proposer, "copier_sizes_its_drafts", False):
            self._chosen = offered
        else:
            self._chosen = self.sides[side].choose(offered)
        return self._chosen

    @property
    def catching_up(self) -> bool:
        """Whether the round last observed was drafted by another side than the round before it (or was plain)."""
        return self._catching_up

    @property
    def drafter(self) -> str:
        """The side that drafted the round last observed ("" for a plain round)."""
        return self._previous or ""

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold a round into the books of the side that drafted it (the proposer's ``last_side``)."""
        side = self.proposer.last_side if drafted else None
        self._catching_up = side is None or side != self._previous
        self._previous = side
        if side is not None:
            self.sides[side].observe(drafted, accepted)

    def observe_tree(self, rows: int, draft_seconds: float) -> None:
        """A tree drafted by the side last observed (a hybrid's model may draft trees)."""
        if self._previous is not None and not self._catching_up:
            self.sides[self._previous].costs.observe_tree(self._chosen, rows, draft_seconds, self._previous)
