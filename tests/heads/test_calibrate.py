"""The head's temperature calibration: the overlap maths, the factor table, the choice."""

from __future__ import annotations

import pytest
import torch

from specdecode.heads.calibrate import TemperatureCalibration
from specdecode.training.calibrate import calibrate, calibration_summary, overlap


def test_overlap_is_one_minus_total_variation_and_the_acceptance_rate():
    generator = torch.Generator().manual_seed(0)
    p = torch.softmax(torch.randn(5, 30, generator=generator), -1)
    q = torch.softmax(2 * torch.randn(5, 30, generator=generator), -1)
    assert torch.allclose(overlap(p, q), 1 - 0.5 * (p - q).abs().sum(-1))
    assert torch.allclose(overlap(p, p), torch.ones(5))
    # the accept rule min(1, p/q) under x ~ q, summed exactly
    assert torch.allclose(overlap(p, q), (q * torch.clamp(p / q, max=1)).sum(-1))


def test_the_best_factor_undoes_a_known_sharpening():
    """A head whose logits are 1.25 times the target's drafts the target's law at temperature T * 1.25."""
    generator = torch.Generator().manual_seed(1)
    target = 3 * torch.randn(200, 50, generator=generator)
    head = 1.25 * target
    factors = (0.8, 1.0, 1.25, 1.5)
    law = {t: torch.softmax(target / t, -1) for t in (0.7, 1.0)}
    overlaps = {
        t: {f: [float(overlap(p, torch.softmax(head / (t * f), -1)).mean())] for f in factors} for t, p in law.items()
    }
    chosen = calibrate(overlaps)
    assert chosen.temperatures == (0.7, 1.0) and chosen.factors == (1.25, 1.25)
    assert overlaps[1.0][1.25][0] == pytest.approx(1.0)


def test_ties_go_to_the_factor_nearest_one():
    chosen = calibrate({0.8: {0.8: [0.5], 1.0: [0.5], 1.3: [0.4]}})
    assert chosen.factors == (1.0,)


def test_factor_interpolates_and_clamps():
    calibration = TemperatureCalibration((0.6, 1.0), (0.8, 1.0))
    assert calibration.factor(0.6) == 0.8 and calibration.factor(0.2) == 0.8
    assert calibration.factor(0.8) == pytest.approx(0.9)
    assert calibration.factor(1.0) == 1.0 and calibration.factor(2.0) == 1.0
    assert TemperatureCalibration().factor(0.8) == 1.0
    assert TemperatureCalibration.from_config({}).factor(0.8) == 1.0  # heads saved before calibration


@pytest.mark.parametrize(
    ("temperatures", "factors", "match"),
    [((0.8,), (), "one factor per"), ((1.0, 0.8), (1.0, 1.0), "ascend"), ((0.8,), (0.0,), "positive")],
)
def test_bad_tables_are_refused(temperatures, factors, match):
    with pytest.raises(ValueError, match=match):
        TemperatureCalibration(temperatures, factors)


def test_summary_names_each_temperature():
    record = {
        "temperatures": [0.8],
        "factors": [0.9],
        "overlap_by_factor": {"0.8": {"0.9": [0.52, 0.48], "1.0": [0.51, 0.47]}},
    }
    assert "T 0.8 x0.9 (0.510 -> 0.520)" in calibration_summary(record)
