"""``gamma="auto"``: each round's draft length, a thin decision over the acceptance estimator and the pass costs.

Each round the controller picks γ ∈ {0, …, max_gamma} maximising predicted tokens per unit time,
E(γ) / (v(γ+1) + γ·c), with E(γ) = 1 + Σ_{i≤γ} Π_{j≤i} a_j from the request's ``RequestAcceptance`` (read
``optimistic``: a_1 raised by one posterior standard deviation), v(k) = T(k) / T(1) and c a drafted token's
seconds over T(1) from the decoder's ``PassCosts``. Until a plain round has measured T(1), γ = 0 (a proposer
that always drafts would otherwise look free). γ = 0 is plain decoding (speedup 1); while it wins, γ = 1 is
probed after ``probe_every`` plain rounds, an interval that doubles after each probe that does not change the
verdict (``ProbeSchedule``), and the request's own evidence ages toward the decoder's memory. A drafting stretch
re-times T(1) with one plain round every ``refresh_every`` rounds, so v(k) compares times taken close together.
γ reaches at most twice the deepest round timed (``PassCosts.frontier``).
A proposer that drafts token trees verifies a tree's nodes, not γ tokens: a γ that produced trees is priced at
the trees measured, v(rows) + draft seconds / T(1).
A proposer that drafts two ways (``HybridProposer``: a copied run, or a model's guesses) gets ``HybridGamma``: one
controller per side, each with its own acceptance and drafting price (``drafter`` "copy" / "model"), the target's
times shared; the side that would draft (the proposer's ``preview``) chooses the round's length.
The server's policy (``serving.batching.policy``) decides over the same estimator and costs: for a batch of one request
it chooses the same length (tests/control/test_control.py). Exactness does not depend on any of this: γ only changes
between rounds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from .acceptance import AcceptanceHistory, RequestAcceptance
from .costs import PassCosts
from .probing import ProbeSchedule


def best_length(acceptance: list[float], costs: PassCosts, cap: int, drafter: str = "") -> int:
    """argmax over γ ≤ min(``cap``, the costs' frontier) of E(γ) / round cost, γ = 0 (speedup 1) included."""
    best, best_speedup, tokens, reach = 0, 1.0, 1.0, 1.0
    for gamma, a in enumerate(acceptance[: costs.frontier(cap)], start=1):
        reach *= a
        tokens += reach
        speedup = tokens / costs.round_cost(gamma, drafter)
        if speedup > best_speedup:
            best, best_speedup = gamma, speedup
    return best


@dataclass
class AdaptiveGamma:
    """Per-request draft-length controller (its acceptance is the request's; ``costs`` and the memory are shared)."""

    max_gamma: int = 8
    costs: PassCosts = field(default_factory=PassCosts)
    memory: AcceptanceHistory | None = None
    probe_every: int = 8
    refresh_every: int = 32  # a drafting stretch re-times the 1-token step with a plain round this often
    optimism: float = 1.0  # a_1 is raised by this many posterior standard deviations when choosing
    drafter: str = ""  # whose drafting price the cost model reads (a hybrid's side)
    acceptance: RequestAcceptance = field(init=False)
    _probes: ProbeSchedule = field(init=False)
    _chosen: int = 0
    _catching_up: bool = True

    def __post_init__(self) -> None:
        if self.max_gamma < 1:
            raise ValueError(f"max_gamma must be >= 1, got {self.max_gamma}")
        self.acceptance = RequestAcceptance(self.memory, optimism=self.optimism)
        self._probes = ProbeSchedule(self.probe_every)

    def predicted_speedup(self, gamma: int) -> float:
        """E(γ) / (v(γ+1) + γc) on the mean acceptance; 1.0 for γ = 0."""
        if gamma == 0:
            return 1.0
        tokens, reach = 1.0, 1.0
        for a in self.acceptance.estimate(gamma):
            reach *= a
            tokens += reach
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

    def _choose(self, cap: int) -> int:
        if cap < 1:
            return 0
        if self.costs.step_seconds is None:  # calibrate: a plain round measures the 1-token step all costs use
            return 0
        if self.costs.rounds_since_step() >= self.refresh_every:  # re-time it: v(k) divides by it (not a verdict)
            return 0
        best = best_length(self.acceptance.optimistic(cap), self.costs, cap, self.drafter)
        if best > 0:
            self._probes.speculated()
            return best
        self.acceptance.fade_toward_memory()
        return 1 if self._probes.plain() else 0

    def observe_tree(self, rows: int, draft_seconds: float) -> None:
        """The round at the last chosen γ drafted a tree of ``rows - 1`` nodes in ``draft_seconds`` (not a
        price while ``catching_up``)."""
        if not self._catching_up:
            self.costs.observe_tree(self._chosen, rows, draft_seconds, self.drafter)

    def observe(self, drafted: int, accepted: int) -> None:
        """Fold in one round: positions 1..accepted accepted, position accepted+1 rejected if < drafted."""
        self.acceptance.observe(drafted, accepted)


class SidePreview(Protocol):
    """A proposer that drafts two ways (``HybridProposer``)."""

    last_side: str | None
    copier_sizes_its_drafts: bool

    def preview(self, context: list[int], k: int) -> tuple[str, int]: ...


@dataclass
class HybridGamma:
    """``gamma="auto"`` for a proposer that drafts two ways (``HybridProposer``: a copied run or a model's guesses).

    Each round the proposer's ``preview`` names the side that would draft and how many tokens it offers (a copied
    run's length; the model's ``model_gamma``), and that side's controller chooses the round's γ within that offer
    from the side's own acceptance and drafting price (the cost model's ``drafter`` "copy" or "model"); γ = 0 is a
    plain round. So a copy of ~90% acceptance is not cut to one token by a head's ~45%, a head that does not pay
    here rests while copies go on, and prompt lookup's copy is not run to ``max_gamma`` where its acceptance and
    v(k) say a shorter one pays more (eagle+lookup on Spec-Bench: 1.13x plain against 1.03x at γ8;
    docs/BENCHMARKS.md). A copier that sizes its own drafts (suffix decoding) is taken as offered.
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
        costs: PassCosts,
        memories: dict[str, AcceptanceHistory],
    ) -> HybridGamma:
        """A request's controller: one ``AdaptiveGamma`` a side, the decoder's ``costs`` and per-side ``memories``
        (created here on first use) shared."""
        sides = {}
        for side in ("copy", "model"):
            memory = memories.setdefault(side, AcceptanceHistory())
            sides[side] = AdaptiveGamma(max_gamma, costs, memory, drafter=side)
        return cls(proposer, context, sides, max_gamma)

    def choose(self) -> int:
        """This round's γ: the previewed side's choice, at most what that side offers; a copy as offered where the
        copier sizes its own drafts (suffix decoding's depth and node costs)."""
        side, offered = self.proposer.preview(self.context, self.max_gamma)
        if side == "copy" and self.proposer.copier_sizes_its_drafts:
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
