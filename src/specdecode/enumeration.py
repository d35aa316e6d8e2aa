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
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .engine import SpeculativeDecoder
from .exactness import target_law
from .models.loader import LoadedModel
from .params import SamplingParams

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
) -> EngineLaw:
    """The decoder's exact law of its first ``tokens`` output tokens after ``prompt_ids`` (an outcome is shorter
    when an EOS ends it). ``params.max_new_tokens`` bounds the rounds' drafts as in real use (k ≤ max_new_tokens −
    generated − 1). The proposer must not learn from the runs (a remembering suffix proposer would: remember=False)."""
    if decoder.mode != "exact":
        raise ValueError("engine_law enumerates exact mode's decisions; reproducible mode has none (keyed noise)")
    if decoder.gamma == "auto":
        raise ValueError("engine_law needs a fixed gamma: gamma='auto' chooses from measured time, not from chance")
    if params.stop:
        raise ValueError("engine_law: no stop strings (an outcome is a token prefix)")
    eos = decoder.target.eos_token_ids
    law: dict[tuple[int, ...], float] = defaultdict(float)
    scripts: list[list[tuple[int, int]]] = [[]]
    runs, accepted_mass = 0, 0.0
    while scripts:
        runs += 1
        if runs > max_runs:
            raise RuntimeError(f"more than {max_runs} engine runs: too many random decisions to enumerate")
        script = scripts.pop()
        choices = Enumerator(script, tokens, eos)
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
