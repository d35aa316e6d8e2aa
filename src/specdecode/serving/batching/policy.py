"""Speculate or not, step by step, from measured costs: the closed loop that turns speculation off under load.

Every step runs one batched target pass over all active requests: a plain request contributes its newest
token (1 row), a speculating one its newest token and k draft tokens (1 + k rows). With B requests and
k_i draft tokens each, a step yields Σ_i E_i(k_i) tokens in expectation, where
E_i(k) = 1 + Σ_{j≤k} Π_{l≤j} a_il (the planner's ``expected_tokens_per_position``), a_il is request i's
acceptance at draft position l, and costs T(B + Σ k_i) + Σ_i k_i · c_i seconds: T(rows) the measured time of
a batched pass with that many rows and c_i the drafting time per token of request i's proposer, both from
``control.PassCosts`` (learned online: on a CPU the pass grows slowly with rows while the weights dominate, then
linearly), and a_il from ``control.RequestAcceptance`` (the request's own rounds on the server's memory of its
proposer) — the estimator and costs the engine's ``gamma="auto"`` reads, so for one request both choose alike.

``auto`` picks the draft lengths maximising predicted tokens per second. Adding the j-th draft token of
request i adds Π_{l≤j} a_il expected tokens (non-increasing in j), so the best plan for a given total
m = Σ k_i takes the m largest such gains; the policy scores every m (0 = a plain step) with the measured
T(B + m) and keeps the best, m at most twice the deepest draft rows measured over B (``PassCosts.frontier``).
Under light load extra rows are nearly free and speculation wins; once the pass is compute-bound, T grows with
every row and plain steps win. When plain steps have won for a while it
probes the best speculative plan once (the interval doubles while probes lose), so the costs of larger
passes and the acceptance estimates stay current; a batch size met for the first time runs one plain step
first, so the cost it is compared against is measured, not extrapolated. ``always`` drafts every request's
full gamma; ``never`` drafts nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from operator import mul

from ...control import PassCosts, ProbeSchedule, RequestAcceptance

POLICIES = ("auto", "always", "never")


@dataclass(frozen=True)
class Candidate:
    """One active request as the policy sees it: the most it may draft now (its gamma, within its token
    budget; 0 = plain), its acceptance per position (``acceptance[j]`` = P(position j+1 accepted | earlier
    accepted)) and its proposer's drafting seconds per token."""

    cap: int
    acceptance: tuple[float, ...]
    draft_seconds: float = 0.0

    @classmethod
    def of(cls, cap: int, acceptance: RequestAcceptance, draft_seconds: float = 0.0) -> Candidate:
        """A request as ``gamma="auto"`` sees it: the estimator's optimistic acceptance for positions 1..cap."""
        return cls(cap, tuple(acceptance.optimistic(cap)), draft_seconds)


@dataclass(frozen=True)
class Plan:
    """One step's decision: draft tokens per request, rows in the pass, and the predicted tokens/s ratio of
    this plan over a plain step (1.0 for a plain step); ``priced``: ``auto`` weighed costs and acceptance (not a
    fixed policy, nor a plain step that measures a new batch size), so a request given 0 got a plain verdict."""

    draft_lengths: tuple[int, ...]
    rows: int
    predicted_speedup: float
    probe: bool = False
    priced: bool = False

    @property
    def speculating(self) -> bool:
        return self.rows > len(self.draft_lengths)


@dataclass
class SpeculationPolicy:
    """``auto`` | ``always`` | ``never``: how many tokens each request drafts this step (see the module doc)."""

    mode: str = "auto"
    costs: PassCosts = field(default_factory=PassCosts)
    probe_every: int = 16
    max_probe_interval: int = 1024
    _probes: ProbeSchedule = field(init=False)

    def __post_init__(self) -> None:
        if self.mode not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.mode!r}")
        self._probes = ProbeSchedule(self.probe_every, self.max_probe_interval)

    def plan(self, candidates: list[Candidate]) -> Plan:
        batch = len(candidates)
        if self.mode == "never" or not any(c.cap for c in candidates):
            return Plan(tuple(0 for _ in candidates), batch, 1.0)
        gains = sorted(
            ((g, j, i, c.draft_seconds) for i, c in enumerate(candidates) for j, g in enumerate(_gains(c))),
            key=lambda t: (-t[0], t[1]),
        )
        plain_rate = batch / self.costs.pass_seconds(batch)
        if self.mode == "always":
            m = len(gains)
        else:
            rates = self._rates(batch, gains[: self.costs.frontier(len(gains), batch)])
            m = max(range(len(rates)), key=rates.__getitem__)
        probe, priced = False, self.mode == "auto" and batch in self.costs.seconds
        if self.mode == "auto" and batch not in self.costs.seconds:
            m = 0  # first measure the plain pass that speculation is compared against
        elif self.mode == "auto":
            if m > 0:
                self._probes.speculated()
            elif self._probes.plain():
                m = max(range(1, len(rates)), key=rates.__getitem__)
                probe = True
        lengths = [0] * batch
        tokens, draft_seconds = float(batch), 0.0
        for gain, _, i, seconds in gains[:m]:
            lengths[i] += 1
            tokens += gain
            draft_seconds += seconds
        rate = tokens / (self.costs.pass_seconds(batch + m) + draft_seconds)
        return Plan(tuple(lengths), batch + m, rate / plain_rate, probe, priced)

    def _rates(self, batch: int, gains: list[tuple[float, int, int, float]]) -> list[float]:
        """Predicted tokens per second with the m largest gains drafted, for m = 0 .. len(gains)."""
        rates = []
        tokens, draft_seconds = float(batch), 0.0
        for m in range(len(gains) + 1):
            if m:
                tokens += gains[m - 1][0]
                draft_seconds += gains[m - 1][3]
            rates.append(tokens / (self.costs.pass_seconds(batch + m) + draft_seconds))
        return rates


def _gains(candidate: Candidate) -> list[float]:
    """Expected extra tokens of draft positions 1..cap: Π_{l≤j} a_l = E(j) − E(j−1), the planner's
    ``expected_tokens_per_position`` E(k) = 1 + Σ_{j≤k} Π_{l≤j} a_l taken term by term."""
    return list(accumulate(candidate.acceptance[: candidate.cap], mul))
