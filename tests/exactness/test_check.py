"""check-exact's statistics: exact laws, pooling, the chi-square verdict; it flags a biased verifier."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers.laws import resample_from_target
from typer.testing import CliRunner

import specdecode as sd
from specdecode import cli, factory
from specdecode.engine import decoder as engine
from specdecode.exactness.check import (
    check_exactness,
    detectable_tv,
    first_token_law,
    fit_test,
    pair_law,
    pool_cells,
    pooled_shape,
    samples_for_tv,
    tv_upper_bound,
)

PROMPT = [1, 2, 3]
SAMPLES = 800


def test_pair_law_is_the_exact_joint(small_target):
    params = sd.SamplingParams(temperature=1.0, top_k=10)
    law = pair_law(small_target, PROMPT, params, cap=small_target.vocab_size)
    first = first_token_law(small_target, PROMPT, params)
    assert float(law.probs.sum()) == pytest.approx(1.0, abs=1e-9)
    assert float(law.probs[-1]) == pytest.approx(0.0, abs=1e-12)  # every first token enumerated
    x1 = law.first[0]
    second = first_token_law(small_target, [*PROMPT, x1], params)
    row = law.probs[: small_target.vocab_size]
    assert torch.allclose(row, first[x1] * second, atol=1e-6)
    assert law.cell([x1, 5]) == 5
    capped = pair_law(small_target, PROMPT, params, cap=2)
    assert float(capped.probs[-1]) == pytest.approx(1 - float(first[list(capped.first)].sum()), abs=1e-9)
    assert capped.cell([t for t in range(16) if t not in capped.first][:1] + [0]) == len(capped.probs) - 1


def test_pool_cells_groups_small_expected_counts():
    probs = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04, 0.0], dtype=torch.float64)
    assert pool_cells(probs, 200).tolist() == [0, 1, 2, 3, 4, -1]
    assert pool_cells(probs, 100).tolist() == [0, 1, 2, 3, 3, -1]  # 4 < 5 joins the smallest cell
    assert pool_cells(probs, 60).tolist() == [0, 1, 2, 3, 3, -1]  # 3.6 + 2.4 pooled
    assert pool_cells(probs, 20).tolist() == [0, 1, 1, 1, 1, -1]


def test_pooled_cells_hide_their_mass_less_the_smallest_cell():
    """The TV a law can move inside a pooled group unseen is its mass m less its smallest cell (all of m moved onto
    that cell), not half of m: three cells of 0.01 hide 0.02; a group that joined a well-filled cell hides that
    cell's mass too."""
    probs = torch.tensor([0.97, 0.01, 0.01, 0.01], dtype=torch.float64)
    assert pool_cells(probs, 300).tolist() == [0, 1, 1, 1]
    dof, hidden = pooled_shape(probs, 300)
    worst = torch.tensor([0.97, 0.03, 0.0, 0.0], dtype=torch.float64)  # the group's mass on one cell: same counts
    assert dof == 1 and hidden == pytest.approx(0.02) == 0.5 * float((worst - probs).abs().sum())
    joined = torch.tensor([0.5, 0.3, 0.1, 0.06, 0.04, 0.0], dtype=torch.float64)  # at 100: 0.04 joins 0.06
    assert pooled_shape(joined, 100) == (3, pytest.approx(0.06))


def test_fit_test_verdicts():
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0], dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    fair = fit_test(probs, torch.tensor([500.0, 250, 250, 0]), 0.01, generator)
    assert not fair.rejected and fair.p_value == pytest.approx(1.0) and fair.tv == 0.0 and fair.tv_null > 0
    skewed = fit_test(probs, torch.tensor([600.0, 200, 200, 0]), 0.01, generator)
    assert skewed.rejected and skewed.tv == pytest.approx(0.1) and skewed.tv_upper >= 0.1
    impossible = fit_test(probs, torch.tensor([500.0, 250, 249, 1]), 0.01, generator)
    assert impossible.rejected and impossible.impossible == 1
    assert "BIASED" in impossible.verdict and "consistent" in fair.verdict


def test_tv_upper_bound_covers_the_estimate():
    assert tv_upper_bound(0.02, 10, 1000, 0.01) > 0.02 + 0.5 * (9 / 1000) ** 0.5
    assert tv_upper_bound(0.9, 10, 10, 0.01) == 1.0


@pytest.mark.parametrize("mode", ["exact", "reproducible"])
def test_real_verifier_passes(small_target, small_draft, mode):
    params = sd.SamplingParams(temperature=1.0)
    proposer = sd.DraftModelProposer(small_draft)
    report = check_exactness(small_target, proposer, [PROMPT], params, samples=SAMPLES, gamma=2, mode=mode)
    assert report.passed, report.verdict
    assert report.accepted > 0.2 * report.drafted  # both the accept and the reject paths ran


def test_biased_verifier_is_flagged(small_target, small_draft, monkeypatch):
    monkeypatch.setattr(engine, "speculative_sample", resample_from_target)
    params = sd.SamplingParams(temperature=1.0)
    proposer = sd.DraftModelProposer(small_draft)
    report = check_exactness(small_target, proposer, [PROMPT], params, samples=SAMPLES, gamma=2)
    assert not report.passed
    assert all(test.rejected for test in report.tests)
    assert report.verdict.startswith("FAIL")


def test_check_exact_command_json(small_target, small_draft, monkeypatch, tmp_path):
    models = {"tiny": small_target, "tiny-draft": small_draft}
    monkeypatch.setattr(factory, "load", lambda name, *settings: models[name])
    prompts = tmp_path / "q.jsonl"
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": [PROMPT]}) + "\n")
    args = ["check-exact", "--target", "tiny", "--draft", "tiny-draft", "--prompts", str(prompts)]
    result = CliRunner().invoke(cli.app, [*args, "--samples", "200", "--gamma", "2", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and len(report["tests"]) == 2 and report["mode"] == "exact"
    bad = CliRunner().invoke(cli.app, [*args, "--samples", "0"])
    assert bad.exit_code != 0


def test_check_exact_command_with_lookup_trees(small_target, monkeypatch, tmp_path):
    monkeypatch.setattr(factory, "load", lambda name, *settings: small_target)
    prompts = tmp_path / "q.jsonl"
    branching = [1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2]  # [1, 2] was followed by 3, 4 and 5: a three-branch tree
    prompts.write_text(json.dumps({"question_id": 1, "category": "x", "turns": [branching]}) + "\n")
    args = ["check-exact", "--target", "tiny", "--proposer", "lookup", "--prompts", str(prompts), "--gamma", "2"]
    result = CliRunner().invoke(cli.app, [*args, "--tree-width", "3", "--samples", "200", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["passed"] and report["tree_width"] == 3 and report["drafted"] >= 3 * 200
    bad = CliRunner().invoke(cli.app, [*args, "--proposer", "draft", "--draft", "tiny", "--tree-width", "2"])
    assert bad.exit_code != 0 and "tree-width" in bad.output


def _rejection_rate(law, biased, samples: int, threshold: float, replicates: int = 400, seed: int = 0) -> float:
    """How often the level-``threshold`` chi-square test on ``samples`` draws from ``biased`` rejects ``law``."""
    from scipy.stats import chi2

    rng = np.random.default_rng(seed)
    counts = rng.multinomial(samples, biased, size=replicates)
    statistic = ((counts - samples * law) ** 2 / (samples * law)).sum(axis=1)
    return float((chi2.sf(statistic, len(law) - 1) < threshold).mean())


def test_the_stated_power_is_the_power_against_the_worst_biased_law():
    """detectable_tv's promise, checked by simulation: at N = samples_for_tv(0.05) the worst law at TV 0.05
    (q − p = ±2·TV·p on two halves of p's mass) is caught ~90% of the time, other directions at that TV more
    often, and a correct law at the false-alarm rate."""
    law = np.array([0.25, 0.15, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1])  # halves: {0, 1, 2} and {3 .. 7}
    threshold, tv = 1e-3, 0.05
    samples = samples_for_tv(tv, len(law) - 1, threshold)
    assert detectable_tv(samples, len(law) - 1, threshold) == pytest.approx(tv, rel=1e-3)
    sign = np.where(np.arange(8) < 3, 1.0, -1.0)
    worst = law + 2 * tv * law * sign
    assert 0.5 * np.abs(worst - law).sum() == pytest.approx(tv)
    assert _rejection_rate(law, worst, samples, threshold) == pytest.approx(0.9, abs=0.06)  # 400 runs: SE 0.015
    other = law.copy()
    other[0] += tv
    other[7] -= tv  # the same TV, all on two cells: a larger chi-square distance
    assert _rejection_rate(law, other, samples, threshold) > 0.95
    assert _rejection_rate(law, law, samples, threshold) < 0.02
    assert samples_for_tv(0.02, 7, threshold) > 6 * samples  # a fifth of the TV needs ~6.25 times the draws


def test_reports_state_their_power(small_target):
    params = sd.SamplingParams(temperature=1.0)
    report = check_exactness(small_target, sd.PromptLookupProposer(), [PROMPT], params, samples=200, gamma=2)
    for test in report.tests:
        assert 0 < test.detectable_tv <= 1 and "at 90% power" in test.verdict
        assert test.detectable_tv >= detectable_tv(test.samples, test.dof, test.threshold)  # + pooled mass
    assert all("detectable_tv" in t for t in report.to_dict()["tests"])
