"""plan --measure: per-position prediction arithmetic, and an end-to-end measurement on a tiny model."""

from __future__ import annotations

import pytest
from helpers.models import LARGE_VOCAB, tiny_llama

import specdecode as sd
from specdecode.bench.measure import measure, per_position_speedup
from specdecode.bench.workloads import WorkItem
from specdecode.planner import VerifyCost, speedup


def test_per_position_prediction_equals_iid_formula_for_constant_acceptance():
    curve = VerifyCost.from_json({"1": 1.0, "9": 1.4})
    for gamma in range(1, 9):
        assert per_position_speedup([0.7] * gamma, 0.7, gamma, 0.05, curve) == pytest.approx(
            speedup(0.7, gamma, 0.05, curve)
        )


def test_unmeasured_positions_fall_back_to_pooled_alpha():
    curve = VerifyCost.from_json({"1": 1.0, "5": 1.0})
    # a_1 = 0.9 measured, a_2..a_4 = α = 0.5: E = 1 + .9 + .45 + .225 + .1125
    assert per_position_speedup([0.9], 0.5, 4, 0.0, curve) == pytest.approx(2.6875)


def test_measure_runs_end_to_end_on_a_tiny_model():
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=11))
    pattern = [5, 6, 7, 8, 9, 10, 11, 12]
    items = [WorkItem(i, "summarization", [pattern * 3 + [i]]) for i in range(2)]
    found = measure(target, "lookup", None, items, gammas=(1, 2), max_new_tokens=12, curve_repeats=1)
    assert [p.gamma for p in found.predictions] == list(range(1, 17))
    assert {p.gamma for p in found.predictions if p.measured is not None} == {1, 2}
    assert 0.0 <= found.alpha <= 1.0 and found.cost >= 0.0
    assert set(found.verify_cost) == set(range(1, 18))
