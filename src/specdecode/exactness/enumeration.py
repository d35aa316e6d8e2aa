"""The engine's output law, computed exactly: every random decision enumerated instead of sampled.

A decoder in exact mode makes its random decisions through ``choices.Choices`` (accept guesses, draw tokens).
``engine_law`` runs the real engine — proposer, target passes, verification, cache rollback, several rounds —
once per combination of decisions: a run follows a script of branches, takes the first branch at each decision
past the script and records how many branches it had; a depth-first search then replays every other branch.
A run's weight is the product of its branches' probabilities; it stops as soon as the first ``tokens`` output
tokens (or an end-of-sequence token) are decided. The law of those tokens is the sum of the weights by outcome,
exact up to float64 rounding, so a comparison with ``prefix_law`` (the target's own law, computed pass by pass)
detects any bias above ~1e-12 in total variation — the strong tier's power at a cost of seconds, where the
number of runs is small: proposers whose guesses are point masses (prompt lookup, suffix trees, EAGLE trees,
deterministic trees) or that sample few tokens from a small vocabulary.

``through_kernels=True`` enumerates the compiled code a float32 CPU run samples with (``KernelEnumerator``): the
chain rule's decisions are ``exact_chain``'s own, and every draw ``inverse_cdf``'s (the kernels' ``inverse_cdf_rows``),
each law read off the op by bisection on its float64 uniforms (as tests/kernels/test_kernel_laws.py does) — so a fault
compiled into the kernels (``kernels.MUTANTS``) moves the enumerated law.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from .. import kernels
from ..engine.decoder import SpeculativeDecoder
from ..models.loaded import LoadedModel
from ..sampling.choices import ChainRule, UniformsChoices, inverse_cdf
from ..sampling.params import SamplingParams
from .check import target_law

MAX_RUNS = 100_000


class _Decided(Exception):
    """The tokens asked about are decided: the run stops."""


class Enumerator:
    """``Choices`` that follow ``script`` (a branch index per decision, with the branch count expected there) and
    then take each decision's first branch; ``weight`` is the product of the taken branches' probabilities and
    ``decided`` the output tokens the decisions chose. Raises ``_Decided`` once ``wanted`` tokens (or an EOS) are
    decided."""

    def __init__(self, script: list[tuple[int, int]], wanted: int, eos: Iterable[int]) -> None:
        self.script = script
        self.taken: list[tuple[int, int]] = []  # (branch, branch count) of every decision so far
        self.weight = 1.0
        self.decided: list[int] = []
        self.accepted = 0  # guesses accepted
        self._wanted = wanted
        self._eos = frozenset(eos)

    def _choose(self, weights: list[float]) -> int:
        """Index into ``weights`` (the positive branch probabilities) of the branch this run takes."""
        position = len(self.taken)
        if position < len(self.script):
            branch, count = self.script[position]
            if count != len(weights):
                raise RuntimeError(
                    f"decision {position} had {count} branches in an earlier run and {len(weights)} now: the "
                    "decoder is not deterministic given its random decisions (gamma='auto' measures time)"
                )
        else:
            branch = 0
        self.taken.append((branch, len(weights)))
        self.weight *= weights[branch]
        return branch

    def _emit(self, tokens: list[int]) -> None:
        self.decided.extend(tokens)
        if len(self.decided) >= self._wanted or self._eos.intersection(self.decided):
            raise _Decided

    def accept_run(self, ratios: torch.Tensor, tokens: list[int]) -> int:
        accept = ratios.clamp(0.0, 1.0).tolist()
        reach, outcomes = 1.0, []  # outcomes: (accepted count, probability)
        for n, a in enumerate(accept):
            outcomes.append((n, reach * (1.0 - a)))
            reach *= a
        outcomes.append((len(accept), reach))
        outcomes = [(n, w) for n, w in outcomes if w > 0]
        n = outcomes[self._choose([w for _, w in outcomes])][0]
        self.accepted += n
        if n:
            self._emit(tokens[:n])
        return n

    def accept(self, ratio: float, token: int) -> bool:
        a = min(1.0, max(0.0, ratio))
        outcomes = [(o, w) for o, w in ((True, a), (False, 1.0 - a)) if w > 0]
        accepted = outcomes[self._choose([w for _, w in outcomes])][0]
        if accepted:
            self.accepted += 1
            self._emit([token])
        return accepted

    def draw(self, probs: torch.Tensor, emitted: bool = True) -> int:
        probs = probs.double()
        support = torch.nonzero(probs > 0).flatten().tolist()
        weights = (probs[support] / probs.sum()).tolist()
        token = support[self._choose(weights)]
        if emitted:
            self._emit([token])
        return token

    def draw_distinct(self, probs: torch.Tensor, count: int) -> torch.Tensor:
        rest = probs.double().clone()
        drawn = []
        for _ in range(count):
            drawn.append(self.draw(rest, emitted=False))
            rest[drawn[-1]] = 0.0
        return torch.tensor(drawn, dtype=torch.int64)


ONE_BELOW = float(np.nextafter(1.0, 0.0))  # the largest float64 uniform


def interval_law(draw: Callable[[np.ndarray], np.ndarray]) -> list[tuple[int, float]]:
    """(token, length of {u ∈ [0, 1): draw(u) = token}) for a ``draw`` of float64 uniforms (an array) that is
    non-decreasing in u, as an inverse CDF is: from u = 0, the next boundary min{u: draw(u) > the token at the
    current one} is found to the last bit by bisection on the bits of the doubles (which order as the doubles do), so
    tokens without mass cost nothing. A piece is credited to the token drawn at its start: an op that is not monotone
    gets a wrong law, not a right one."""
    law: dict[int, float] = defaultdict(float)
    start, top = 0.0, np.float64(ONE_BELOW).view(np.int64)
    token, last = (int(t) for t in draw(np.array([start, ONE_BELOW])))
    while token < last:
        lo, hi = np.float64(start).view(np.int64), top  # draw(lo) ≤ token < draw(hi)
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            if int(draw(np.array([mid]).view(np.float64))[0]) > token:
                hi = mid
            else:
                lo = mid
        end = float(np.array([hi]).view(np.float64)[0])
        law[token] += end - start
        start, token = end, int(draw(np.array([end]))[0])
    law[token] += 1.0 - start
    return [(t, w) for t, w in law.items() if w > 0]


class KernelEnumerator(Enumerator, UniformsChoices):
    """An ``Enumerator`` whose chain-rule decisions and draws are the compiled ops' own (module docstring): the chain
    runs through ``speculative_sample``'s kernel path (``UniformsChoices.chain``), its accept probabilities the accept
    uniforms' thresholds and its token law the draw uniform's intervals; a draw is ``inverse_cdf``'s intervals. Each
    law is computed once per decision (``memo``, keyed by the decisions before it: the engine is deterministic given
    them) and shared by the runs that replay it."""

    def __init__(self, script, wanted, eos, memo: dict | None = None) -> None:
        super().__init__(script, wanted, eos)
        self._memo = {} if memo is None else memo

    def _law(self, compute: Callable[[], list[tuple[int, float]]]) -> list[tuple[int, float]]:
        key = tuple(self.taken)
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def _take(self, law: list[tuple[int, float]]) -> int:
        return law[self._choose([w for _, w in law])][0]

    def chain(self, rule: ChainRule, tokens: list[int]) -> tuple[int, int]:
        k = len(tokens)
        n = self._take(self._law(lambda: _accepted_counts(rule, k)))
        self.accepted += n
        if n:
            self._emit(tokens[:n])
        accept_u = torch.zeros(k, dtype=torch.float64)
        if n < k:
            accept_u[n] = ONE_BELOW  # rejects guess n (its ratio < 1, or this branch had no mass)

        def draw(uniforms: np.ndarray) -> np.ndarray:
            drawn = [rule(accept_u, u) for u in uniforms.tolist()]
            if any(int(m) != n for m, _ in drawn):
                raise RuntimeError("the chain rule's accepted count moved with its draw uniform")
            return np.array([int(t) for _, t in drawn])

        token = self._take(self._law(lambda: interval_law(draw)))
        self._emit([token])
        return n, token

    def draw(self, probs: torch.Tensor, emitted: bool = True) -> int:
        rows = probs.reshape(1, -1)

        def drawn(uniforms: np.ndarray) -> np.ndarray:
            return inverse_cdf(rows.expand(len(uniforms), -1), torch.from_numpy(uniforms)).numpy()

        token = self._take(self._law(lambda: interval_law(drawn)))
        if emitted:
            self._emit([token])
        return token

    def draw_distinct(self, probs: torch.Tensor, count: int) -> torch.Tensor:
        if count == 1:  # as GeneratorChoices: a chain's one child drawn from the rows as given
            return torch.tensor([self.draw(probs, emitted=False)], dtype=torch.int64)
        return super().draw_distinct(probs, count)


def _accepted_counts(rule: ChainRule, k: int) -> list[tuple[int, float]]:
    """(n, P(n guesses accepted)) of a chain ``rule``, each guess accepted once reached with probability
    ``_accept_probability``."""
    outcomes, reach = [], 1.0
    for i in range(k):
        if reach == 0:  # a guess that is never accepted: the later ones are not reached
            break
        accepted = _accept_probability(rule, k, i)
        outcomes.append((i, reach * (1.0 - accepted)))
        reach *= accepted
    outcomes.append((k, reach))
    return [(n, w) for n, w in outcomes if w > 0]


def _accept_probability(rule: ChainRule, k: int, i: int) -> float:
    """The length of {a ∈ [0, 1): ``rule`` accepts guess i at accept_u[i] = a, the earlier ones at 0 (accepted)},
    by bisection on a's bits: min(1, p/q) for a correct rule."""
    accept_u = torch.zeros(k, dtype=torch.float64)

    def rejected(uniforms: np.ndarray) -> np.ndarray:
        counts = []
        for a in uniforms.tolist():
            accept_u[i] = a
            counts.append(int(rule(accept_u, 0.5)[0]))
        if min(counts) < i:
            raise RuntimeError("the chain rule rejected an earlier guess at accept uniform 0")
        return np.array([int(n == i) for n in counts])

    return dict(interval_law(rejected)).get(0, 0.0)


def _outcome(tokens: list[int], wanted: int, eos: frozenset[int]) -> tuple[int, ...]:
    """The first ``wanted`` tokens, or fewer up to and including an EOS."""
    cut = next((i + 1 for i, t in enumerate(tokens[:wanted]) if t in eos), wanted)
    return tuple(tokens[:cut])


@dataclass(frozen=True)
class EngineLaw:
    """The engine's law of its first tokens (outcome → probability), the runs it took, and the probability that a
    guess was accepted before the outcome was decided (what the law owes to verification, not to plain draws)."""

    law: dict[tuple[int, ...], float]
    runs: int
    accepted_mass: float


def engine_law(
    decoder: SpeculativeDecoder,
    prompt_ids: list[int],
    params: SamplingParams,
    tokens: int = 2,
    max_runs: int = MAX_RUNS,
    through_kernels: bool = False,
) -> EngineLaw:
    """The decoder's exact law of its first ``tokens`` output tokens after ``prompt_ids`` (an outcome is shorter
    when an EOS ends it). ``params.max_new_tokens`` bounds the rounds' drafts as in real use (k ≤ max_new_tokens −
    generated − 1). The proposer must not learn from the runs (a remembering suffix proposer would: remember=False).
    ``through_kernels``: the compiled ops' decisions (``KernelEnumerator``); the kernels must be available."""
    if decoder.mode != "exact":
        raise ValueError("engine_law enumerates exact mode's decisions; reproducible mode has none (keyed noise)")
    if decoder.gamma == "auto":
        raise ValueError("engine_law needs a fixed gamma: gamma='auto' chooses from measured time, not from chance")
    if params.stop:
        raise ValueError("engine_law: no stop strings (an outcome is a token prefix)")
    if through_kernels and kernels.ops() is None:
        raise RuntimeError("engine_law(through_kernels=True): the CPU kernels are not available here")
    memo: dict = {}  # KernelEnumerator's laws, shared by the runs
    eos = decoder.target.eos_token_ids
    law: dict[tuple[int, ...], float] = defaultdict(float)
    scripts: list[list[tuple[int, int]]] = [[]]
    runs, accepted_mass = 0, 0.0
    while scripts:
        runs += 1
        if runs > max_runs:
            raise RuntimeError(f"more than {max_runs} engine runs: too many random decisions to enumerate")
        script = scripts.pop()
        choices = KernelEnumerator(script, tokens, eos, memo) if through_kernels else Enumerator(script, tokens, eos)
        request = decoder._start(prompt_ids, params, None, None)
        request.generator = choices
        try:
            while not request.done:
                decoder._round(request)
        except _Decided:
            pass
        law[_outcome(choices.decided, tokens, eos)] += choices.weight
        accepted_mass += choices.weight if choices.accepted else 0.0
        for position in range(len(script), len(choices.taken)):  # decisions first met in this run
            count = choices.taken[position][1]
            scripts.extend([*choices.taken[:position], (branch, count)] for branch in range(1, count))
    return EngineLaw(dict(law), runs, accepted_mass)


def prefix_law(
    target: LoadedModel, prompt_ids: list[int], params: SamplingParams, tokens: int = 2
) -> dict[tuple[int, ...], float]:
    """The target's own law of its first ``tokens`` tokens after ``prompt_ids`` (plain decoding's), one pass per
    prefix with positive probability; an outcome ends early at an EOS."""
    runner = target.new_runner()
    eos = target.eos_token_ids
    law: dict[tuple[int, ...], float] = {}

    def extend(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == tokens or (prefix and prefix[-1] in eos):
            law[prefix] = mass
            return
        runner.reset()
        probs = target_law(runner.forward(torch.tensor([*prompt_ids, *prefix], dtype=torch.int64))[-1], params)
        for token in torch.nonzero(probs > 0).flatten().tolist():
            extend((*prefix, token), mass * float(probs[token]))

    extend((), 1.0)
    return law


def total_variation(law: dict[tuple[int, ...], float], reference: dict[tuple[int, ...], float]) -> float:
    """½ Σ |law − reference| over both laws' outcomes."""
    return 0.5 * sum(abs(law.get(o, 0.0) - reference.get(o, 0.0)) for o in set(law) | set(reference))
