"""The acceptance estimator: per draft position, discounted Beta-Binomial counts on a prior.

a_j = P(guess j accepted | guesses 1..j-1 accepted). A round that drafted d guesses and kept n of them reaches
positions 1..n + [n < d]: positions 1..n count as accepted, position n + 1 (if drafted) as rejected. Counts are
discounted at every round that reaches them, A_j ← f·A_j + [j ≤ n], R_j ← f·R_j + 1 (``forgetting`` f).

The estimate is the posterior mean a_j = (A_j + w·m_j) / (R_j + w) with prior mean m_j and weight w:

- an ``AcceptanceHistory`` alone (a decoder's or the server's memory of a proposer, f = ``MEMORY_FORGETTING``,
  ~200 rounds): Beta(1, 1) chained down the depths, w = 2, m_1 = 1/2 and m_j = a_{j-1} (a depth not reached yet
  is expected to accept like the one above it, not at 1/2, which would keep a proposer that is always right from
  ever going deeper wherever a verify row costs more than half the gain);
- a ``RequestAcceptance`` (one request's own counts, f = ``REQUEST_FORGETTING``): m_j = its memory's estimate at
  j with w = ``PRIOR_WEIGHT`` rounds, or the chained Beta(1, 1) while the memory holds no round.

Choosing on the mean leaves a proposer that pays idle after a chance dip (a plain round observes nothing), so
decisions read ``optimistic``: a_1 raised by ``optimism`` posterior standard deviations,
sqrt(a_1 (1 - a_1) / (R_1 + w + 1)), w the weight behind the prior (at least the memory's R_1).
The engine's ``gamma="auto"`` and the server's policy both read this estimator, with the same constants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PRIOR_ACCEPTED = 1.0  # Beta(1, 1): the prior of a history with nothing behind it
PRIOR_REJECTED = 1.0
PRIOR_WEIGHT = 8.0  # a request's prior from its memory counts as this many rounds of its own
MEMORY_FORGETTING = 0.995  # a memory (across requests) forgets a round's weight over ~200 rounds
REQUEST_FORGETTING = 0.95  # a request's own counts over ~20 rounds


@dataclass
class AcceptanceHistory:
    """Discounted per-position counts (``accepted[j]``, ``reached[j]`` for position j + 1), grown on demand."""

    forgetting: float = MEMORY_FORGETTING
    accepted: list[float] = field(default_factory=list)
    reached: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not 0.0 < self.forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {self.forgetting}")

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold in one round: positions 1..accepted accepted, position accepted + 1 rejected if drafted."""
        reached = accepted + (accepted < drafted)
        while len(self.reached) < reached:
            self.accepted.append(0.0)
            self.reached.append(0.0)
        for i in range(reached):
            self.accepted[i] = self.forgetting * self.accepted[i] + (i < accepted)
            self.reached[i] = self.forgetting * self.reached[i] + 1.0

    def fade(self) -> None:
        """Discount every count once more (evidence ages while no round observes it)."""
        self.accepted = [self.forgetting * a for a in self.accepted]
        self.reached = [self.forgetting * r for r in self.reached]

    @property
    def rounds(self) -> float:
        """The discounted rounds behind position 1 (0 before any drafting round)."""
        return self.reached[0] if self.reached else 0.0

    def estimate(self, depth: int) -> list[float]:
        """a_1..a_depth on the chained Beta(1, 1) prior."""
        return posterior_means(self, depth)


def posterior_means(
    counts: AcceptanceHistory, depth: int, prior: list[float] | None = None, weight: float = PRIOR_WEIGHT
) -> list[float]:
    """(A_j + w m_j) / (R_j + w) for j = 1..depth: m_j = ``prior[j-1]`` at weight ``weight``, or without a prior
    Beta(1, 1) chained down the depths (w = 2, m_1 = 1/2, m_j = the estimate at j - 1)."""
    if prior is None:
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
    mean = PRIOR_ACCEPTED / (PRIOR_ACCEPTED + PRIOR_REJECTED)
    estimates = []
    for j in range(depth):
        a = counts.accepted[j] if j < len(counts.accepted) else 0.0
        r = counts.reached[j] if j < len(counts.reached) else 0.0
        if prior is not None:
            mean = prior[j]
        mean = (a + weight * mean) / (r + weight)
        estimates.append(mean)
    return estimates


@dataclass
class RequestAcceptance:
    """One request's acceptance: its own discounted counts on its ``memory`` (shared across requests; every round
    observed here is folded into it too)."""

    memory: AcceptanceHistory | None = None
    own: AcceptanceHistory = field(default_factory=lambda: AcceptanceHistory(REQUEST_FORGETTING))
    optimism: float = 1.0  # standard deviations a_1 is raised by in ``optimistic``

    def observe(self, drafted: int, accepted: int) -> None:
        self.own.observe(drafted, accepted)
        if self.memory is not None:
            self.memory.observe(drafted, accepted)

    def estimate(self, depth: int) -> list[float]:
        """Posterior means a_1..a_depth (module doc)."""
        if self.memory is None or not self.memory.rounds:
            return posterior_means(self.own, depth)
        return posterior_means(self.own, depth, self.memory.estimate(depth), PRIOR_WEIGHT)

    def optimistic(self, depth: int) -> list[float]:
        """``estimate`` with a_1 raised by ``optimism`` posterior standard deviations (module doc)."""
        estimates = self.estimate(depth)
        if not estimates:
            return estimates
        weight = PRIOR_ACCEPTED + PRIOR_REJECTED
        if self.memory is not None and self.memory.rounds:
            weight = max(PRIOR_WEIGHT, self.memory.rounds)
        a = estimates[0]
        estimates[0] = min(1.0, a + self.optimism * math.sqrt(a * (1 - a) / (self.own.rounds + weight + 1)))
        return estimates

    def fade_toward_memory(self) -> None:
        """While the request decodes plainly its own evidence ages, so the estimate drifts back to the memory's (a
        dip does not switch a proposer that pays off for the rest of the request); nothing without a memory."""
        if self.memory is not None and self.memory.rounds:
            self.own.fade()
