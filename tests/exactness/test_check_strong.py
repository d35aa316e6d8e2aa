"""The strong exactness tier: each engine-level law sampled at the size that detects any bias of TV ≥ 0.02 with
probability ≥ 0.9 at the family's false-alarm rate (``exactness.samples_for_tv``), and minimally biased controls
that the same tests must catch. Minutes, not seconds: opt-in, outside CI.

    SPECDECODE_STRONG=1 .venv/bin/pytest -q -s -n 0 tests/exactness/test_check_strong.py    # before a release:
    EXACTNESS.md

Family: LAWS + CONTROLS runs of two tests each (first token, joint of two), false-alarm rate ALPHA = 1% for the
correct laws in all. Each run's report states the TV it detects (``FitTest.detectable_tv``), asserted ≤ 0.02.
"""

from __future__ import annotations

import os
import random

import pytest
from helpers.enumeration import residual_mixed_with_p
from helpers.fixtures import head_dir as head_dir
from helpers.models import SMALL_VOCAB, perturbed, tiny_llama, word_target
from helpers.trees import TreeProposer, informed_table

import specdecode as sd
import specdecode.sampling.verify
from specdecode.exactness.check import check_exactness, first_token_law, pair_law, pooled_shape, samples_for_tv
from specdecode.proposers.eagle import EagleProposer
from specdecode.proposers.suffix import SuffixHistory, SuffixProposer

pytestmark = pytest.mark.skipif(
    not os.environ.get("SPECDECODE_STRONG"), reason="the strong exactness tier: set SPECDECODE_STRONG=1 (minutes)"
)

TV, ALPHA = 0.02, 0.01
LAWS = ("chain/draft", "chain/lookup", "tree/sampled-star", "tree/point-mass-deep-wide", "eagle/chain", "suffix/tree")
CONTROLS = ("chain/draft", "chain/lookup", "tree/point-mass-deep-wide")  # exact_chain's q and point-mass paths, trees
THRESHOLD = ALPHA / (2 * (len(LAWS) + len(CONTROLS)))
T1 = sd.SamplingParams(temperature=1.0)
LOOKUP_PROMPT = [7, 4, 1, 7, 4, 1, 7, 4]
TREE_PROMPT = [1, 2, 3]
SUFFIX_PROMPT = [3, 9, 4]
MIXED = 0.15  # the controls' bias: every residual mixed 15% with the target's own law


@pytest.fixture(scope="module")
def small() -> sd.LoadedModel:
    return sd.load_model(tiny_llama(SMALL_VOCAB, seed=0))


@pytest.fixture(scope="module")
def large() -> sd.LoadedModel:
    return word_target()


def strong_samples(target: sd.LoadedModel, prompt: list[int]) -> int:
    """N at which both tests (first token, pairs) detect TV ≥ 0.02 with probability 0.9, what the pooled cells
    can hide included (pooling redone at N until it settles)."""
    laws = first_token_law(target, prompt, T1), pair_law(target, prompt, T1, 64).probs
    samples = 20_000
    for _ in range(4):
        pooled = [pooled_shape(law, samples) for law in laws]
        samples = max(samples_for_tv(TV - hidden, dof, THRESHOLD) for dof, hidden in pooled)
    return int(samples * 1.02)  # a margin for the last re-pooling


def case(name: str, small: sd.LoadedModel, large: sd.LoadedModel, head) -> tuple:
    """(target, proposer, prompt, gamma) of one law."""
    if name == "chain/draft":
        draft = sd.load_model(perturbed(small.model, seed=1, noise=0.15))
        return small, sd.DraftModelProposer(draft), LOOKUP_PROMPT, 2
    if name == "chain/lookup":
        return small, sd.PromptLookupProposer(), LOOKUP_PROMPT, 2
    if name.startswith("tree/"):
        widths = (4,) if name.endswith("star") else (3, 2)
        table = informed_table(small, widths)
        return small, TreeProposer(widths, table, sampled=name == "tree/sampled-star"), TREE_PROMPT, len(widths)
    if name == "eagle/chain":
        return large, EagleProposer(large, head=head, tree_nodes=None), [3, 17, 5, 9], 2
    rng = random.Random(7)  # suffix: point-mass siblings from a history that follows the prompt many ways
    history = SuffixHistory()
    for _ in range(12):
        history.add([*SUFFIX_PROMPT, rng.randrange(SMALL_VOCAB), rng.randrange(SMALL_VOCAB)])
    proposer = SuffixProposer(history, tree_nodes=8, min_probability=0.01, match_factor=4)
    return small, proposer, SUFFIX_PROMPT, 2


def run(name: str, small, large, head):
    target, proposer, prompt, gamma = case(name, small, large, head)
    samples = strong_samples(target, prompt)
    report = check_exactness(target, proposer, [prompt], T1, samples=samples, gamma=gamma, alpha=THRESHOLD * 2)
    print(f"\n{name}: N = {samples:,}; " + "; ".join(t.verdict for t in report.tests))
    return report


@pytest.mark.parametrize("name", LAWS)
def test_every_law_at_the_size_that_catches_tv_002(name, small, large, head_dir):
    report = run(name, small, large, head_dir)
    assert report.passed, report.verdict
    assert all(t.detectable_tv <= TV + 1e-9 for t in report.tests), [t.detectable_tv for t in report.tests]
    assert report.accepted > 0 and report.drafted > report.accepted  # both paths ran


@pytest.mark.parametrize("name", CONTROLS)
def test_a_minimally_biased_residual_is_caught(name, small, large, head_dir, monkeypatch):
    """The control: after a rejection the next token comes from 0.85 · residual + 0.15 · p — a small bias
    (its measured TV excess is printed) that the strong tier must catch. Patched where each path computes it: the
    torch rules' ``_residual`` (trees), and the compiled chain rule a float32 CPU chain runs (``exact_chain``, which
    never calls ``_residual``: before issue 53 this control did not reach the chain path at all), through the real
    op with its draw uniform split (tests/kernels/test_kernel_laws.py) — for a draft model's sampled q (the op's
    max(0, p − q) path) and prompt lookup's point masses (p without the guess). The biased code must have run: a
    chain's op and a tree's ``_residual`` are counted."""
    exact = specdecode.sampling.verify._residual
    reached = {"chain": 0, "tree": 0}

    def mixed(target, draft, token):
        reached["tree"] += 1
        residual = exact(target, draft, token)
        return (1 - MIXED) * residual / residual.sum() + MIXED * target / target.sum()

    monkeypatch.setattr(specdecode.sampling.verify, "_residual", mixed)
    chain_kernels = specdecode.sampling.verify._chain_kernels

    def mixed_chain_kernels(*rows):
        ops = chain_kernels(*rows)
        if ops is None:
            return None
        reached["chain"] += 1
        return residual_mixed_with_p(ops, MIXED)

    monkeypatch.setattr(specdecode.sampling.verify, "_chain_kernels", mixed_chain_kernels)
    report = run(name, small, large, head_dir)
    excess = max(t.tv - t.tv_null for t in report.tests)
    print(f"{name} control: measured TV excess {excess:.3f}")
    assert reached[name.partition("/")[0]] > 0, reached  # the bias was on the path the law ran
    assert not report.passed, report.verdict
    assert excess < 0.1  # a small bias, not a gross one
