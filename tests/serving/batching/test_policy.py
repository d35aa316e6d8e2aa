"""The speculate-or-not policy: the cost table, the plans of each policy, probing, and the closed loop on a
simulated machine whose batched pass is flat while the weights dominate and linear once compute-bound."""

from __future__ import annotations

import pytest

from specdecode.control import PRIOR_WEIGHT, AcceptanceHistory, PassCosts, RequestAcceptance
from specdecode.planner import expected_tokens_per_position
from specdecode.serving.batching.policy import Candidate, SpeculationPolicy


def test_pass_costs_interpolate_and_extrapolate_what_they_measured():
    costs = PassCosts()
    assert costs.pass_seconds(7) == 1.0  # nothing measured: optimistic, so speculation gets tried
    costs.observe_pass(4, 0.010)
    assert costs.pass_seconds(1) == 0.010 and costs.pass_seconds(40) == 0.010  # one point: flat
    costs.observe_pass(12, 0.030)
    assert costs.pass_seconds(8) == pytest.approx(0.020)  # between measured counts: linear
    assert costs.pass_seconds(20) == pytest.approx(0.050)  # past them: the line through the extremes
    assert costs.pass_seconds(2) == pytest.approx(0.005)
    costs.observe_pass(4, 0.020)  # 2 rounds after the last time at 4 rows: a lone time, the median of two is 10 ms
    assert costs.seconds[4] == pytest.approx(0.010)
    costs.observe_pass(4, 0.020)  # the median of three (10, 20, 20): the moving average moves, keeping 0.8
    assert costs.seconds[4] == pytest.approx(0.8 * 0.010 + 0.2 * 0.020)  # moving average


def _candidates(n: int, rate: float, cap: int = 4) -> list[Candidate]:
    return [Candidate(cap, (rate,) * cap) for _ in range(n)]


def _costs(seconds) -> PassCosts:
    costs = PassCosts()
    for rows in range(1, 200):
        costs.observe_pass(rows, seconds(rows))
    return costs


def test_never_and_always():
    candidates = [*_candidates(2, 0.8), Candidate(0, ())]
    assert SpeculationPolicy("never").plan(candidates).draft_lengths == (0, 0, 0)
    plan = SpeculationPolicy("always").plan(candidates)
    assert plan.draft_lengths == (4, 4, 0) and plan.rows == 11 and plan.speculating
    with pytest.raises(ValueError, match="policy"):
        SpeculationPolicy("sometimes")


def test_auto_speculates_when_extra_rows_are_free_and_not_when_every_row_costs():
    flat = SpeculationPolicy("auto", costs=_costs(lambda rows: 0.01))
    plan = flat.plan(_candidates(4, 0.7))
    assert plan.draft_lengths == (4, 4, 4, 4)
    expected = 4 * expected_tokens_per_position([0.7] * 4) / 4  # tokens per pass vs plain's, same pass cost
    assert plan.predicted_speedup == pytest.approx(expected)
    linear = SpeculationPolicy("auto", costs=_costs(lambda rows: 0.001 * rows))
    plan = linear.plan(_candidates(4, 0.95))
    assert plan.draft_lengths == (0, 0, 0, 0) and not plan.speculating and plan.predicted_speedup == 1.0


def test_auto_gives_draft_tokens_to_the_requests_likely_to_accept_them():
    policy = SpeculationPolicy("auto", costs=_costs(lambda rows: 0.01 + 0.002 * rows))
    plan = policy.plan([Candidate(4, (0.95,) * 4), Candidate(4, (0.1,) * 4), Candidate(0, ())])
    assert plan.draft_lengths[0] >= 3 and plan.draft_lengths[1] == 0 and plan.draft_lengths[2] == 0


def test_auto_probes_speculation_ever_more_rarely_while_plain_steps_win():
    policy = SpeculationPolicy("auto", costs=_costs(lambda rows: 0.001 * rows), probe_every=4)
    probes = [i for i in range(64) if policy.plan(_candidates(4, 0.6)).probe]
    assert probes == [3, 11, 27, 59]  # after 4, 8, 16, 32 plain steps


def test_a_request_starts_from_the_server_wide_estimate():
    memory = AcceptanceHistory()
    for _ in range(200):
        memory.observe(drafted=2, accepted=1)  # position 1 always accepted, position 2 always rejected
    prior = memory.estimate(6)
    assert prior[0] > 0.95 and prior[1] < 0.05 and prior[5] == prior[1]  # unreached: like the depth above
    fresh = RequestAcceptance(memory)
    assert fresh.estimate(2) == pytest.approx(prior[:2])
    seen = RequestAcceptance(AcceptanceHistory(accepted=list(memory.accepted), reached=list(memory.reached)))
    seen.own = AcceptanceHistory(1.0, [0.0, 0.0], [100.0, 0.0])  # this request: position 1 rejected 100 times
    estimate = seen.estimate(2)
    assert estimate[0] == pytest.approx(PRIOR_WEIGHT * prior[0] / (100 + PRIOR_WEIGHT)) and estimate[0] < 0.08
    assert estimate[1] == pytest.approx(prior[1])


class Machine:
    """A simulated batched pass: flat up to ``knee`` rows (weights dominate), then linear (compute-bound)."""

    def __init__(self, base: float = 0.01, knee: int = 8) -> None:
        self.base, self.knee = base, knee

    def seconds(self, rows: int) -> float:
        return self.base * max(1.0, rows / self.knee)


@pytest.mark.parametrize(("batch", "low", "high"), [(1, 0.9, 1.0), (2, 0.9, 1.0), (32, 0.0, 0.1)])
def test_closed_loop_turns_speculation_off_under_load(batch, low, high):
    """Measured costs alone (no threshold) switch speculation on for small batches and off for large ones."""
    machine, policy = Machine(), SpeculationPolicy("auto")
    speculating = 0
    for _ in range(300):
        plan = policy.plan(_candidates(batch, 0.7, cap=4))
        policy.costs.observe_pass(plan.rows, machine.seconds(plan.rows))
        speculating += plan.speculating
    assert low <= speculating / 300 <= high
