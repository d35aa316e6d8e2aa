"""One estimator, one cost model: the engine's ``gamma="auto"`` and the server's policy decide alike.

Seeded random histories (a proposer's earlier requests in the memory, the request's own rounds) and measured pass
costs; each scenario is decided twice, by a request's ``AdaptiveGamma`` and by the server's ``SpeculationPolicy``
over a batch of that one request (its candidate built as the scheduler builds it, ``Candidate.of``). The negative
control hands the policy the estimator's mean instead of its optimistic reading (the server before the two were
one): it must disagree somewhere, so the comparison can fail."""

from __future__ import annotations

import random

from specdecode.control import AcceptanceHistory, AdaptiveGamma, PassCosts, RequestAcceptance
from specdecode.serving.batching.policy import Candidate, SpeculationPolicy

SCENARIOS = 300


def _scenario(seed: int) -> tuple[PassCosts, list[tuple[int, int]], list[tuple[int, int]]]:
    """Measured costs (T(r) linear with a random slope, r up to a random depth + 1; a drafting price) and two
    round histories (drafted, accepted): the memory's earlier requests, then this request's."""
    draws = random.Random(seed)
    costs = PassCosts()
    step, slope, deepest = 0.01, draws.uniform(0.0, 0.4), draws.randint(1, 8)
    for _ in range(3):
        for rows in range(1, deepest + 2):
            costs.observe_pass(rows, step * (1 + slope * (rows - 1)))
    costs.observe_pass(1, step)
    costs.observe_draft(1, step * draws.uniform(0.0, 0.3))
    rate = draws.random()

    def rounds(n: int) -> list[tuple[int, int]]:
        out = []
        for _ in range(n):
            drafted = draws.randint(1, 8)
            accepted = next((i for i in range(drafted) if draws.random() > rate), drafted)
            out.append((drafted, accepted))
        return out

    return costs, rounds(draws.randint(0, 300)), rounds(draws.randint(0, 40))


def _engine_choice(costs: PassCosts, earlier: list[tuple[int, int]], own: list[tuple[int, int]]) -> int:
    memory = AcceptanceHistory()
    for drafted, accepted in earlier:
        memory.observe(drafted, accepted)
    controller = AdaptiveGamma(8, costs, memory)
    for drafted, accepted in own:
        controller.observe(drafted, accepted)
    return controller.choose()


def _server_choice(
    costs: PassCosts, earlier: list[tuple[int, int]], own: list[tuple[int, int]], optimistic: bool = True
) -> int:
    books = RequestAcceptance(AcceptanceHistory())
    for drafted, accepted in earlier:
        books.memory.observe(drafted, accepted)  # type: ignore[union-attr]
    for drafted, accepted in own:
        books.observe(drafted, accepted)
    draft_seconds = costs.draft_token_seconds[""]
    if optimistic:
        candidate = Candidate.of(8, books, draft_seconds)
    else:
        candidate = Candidate(8, tuple(books.estimate(8)), draft_seconds)
    return SpeculationPolicy("auto", costs=costs).plan([candidate]).draft_lengths[0]


def test_a_request_and_the_server_choose_the_same_length_from_the_same_observations():
    choices = []
    for seed in range(SCENARIOS):
        costs, earlier, own = _scenario(seed)
        engine, server = _engine_choice(costs, earlier, own), _server_choice(costs, earlier, own)
        assert engine == server, f"seed {seed}: gamma auto chose {engine}, the server's policy {server}"
        choices.append(engine)
    assert len(set(choices)) >= 5 and 0 in choices  # the scenarios reach plain rounds and several lengths


def test_the_comparison_fails_when_the_server_reads_the_estimator_differently():
    """Negative control: the policy fed the mean acceptance (no optimism) disagrees in some scenarios."""
    disagreements = 0
    for seed in range(SCENARIOS):
        costs, earlier, own = _scenario(seed)
        disagreements += _engine_choice(costs, earlier, own) != _server_choice(costs, earlier, own, optimistic=False)
    assert disagreements > 0
