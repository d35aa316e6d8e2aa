"""Acceptance rules: hand-made cases, then chi-square tests of the laws they must produce.

Statistical tests: each chi-square test (scipy.stats.chisquare, cells with expected count < 5 pooled into
one) uses a fixed seed and ≥ 10,000 trials and fails when p < ALPHA = 1e-3. There are 20 such tests that
must pass (10 for chains on the torch path, 4 for chains in the kernels' one call, 6 for trees), so by
Bonferroni the chance that a correct verifier fails any of them for a freshly chosen seed is ≤ 2%. The negative
controls run the same tests on deliberately wrong verifiers and require p < ALPHA, which shows the trials are
enough to detect a realistic bug.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import numpy as np
import pytest
import torch
from helpers.kernels import unavailable, use_build
from helpers.laws import biased_tree_sample, chisquare_pvalue, resample_from_target
from helpers.trees import draw_tree, random_tables

import specdecode.sampling.choices
import specdecode.sampling.verify
from specdecode import kernels
from specdecode.sampling.verify import (
    greedy_verify,
    speculative_sample,
    tree_coupled_verify,
    tree_greedy_verify,
    tree_speculative_sample,
)

ALPHA = 1e-3
TRIALS = 20_000


def rows(*probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float64)


def tokens(*ids: int) -> torch.Tensor:
    return torch.tensor(ids, dtype=torch.int64)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------------------------- hand cases


def test_accept_all_then_bonus_from_the_last_target_row():
    target = rows([0.5, 0.5, 0.0, 0.0], [0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 0.0, 1.0])
    draft = rows([0.5, 0.5, 0.0, 0.0], [0.0, 0.2, 0.8, 0.0])  # p(x) >= q(x) for x = 1, 1
    for seed in range(50):
        assert speculative_sample(target, draft, tokens(1, 1), gen(seed)) == (2, 3)


def test_reject_at_position_i_then_draw_from_the_residual():
    target = rows([0.0, 1.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0], [0.25, 0.25, 0.25, 0.25])
    draft = rows([0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0])
    # position 0: p(1) = q(1) = 1 → accepted; position 1: x = 0 has p = 0 → rejected;
    # residual max(0, p - q) = [0, 0, 0.5, 0] → token 2
    for seed in range(50):
        assert speculative_sample(target, draft, tokens(1, 0), gen(seed)) == (1, 2)


def test_a_token_the_target_gives_zero_is_never_accepted():
    target = rows([0.0, 0.6, 0.4], [1.0, 0.0, 0.0])
    draft = rows([1e-300, 0.5, 0.5])  # ratio p/q = 0 even though q(x) is tiny
    for seed in range(200):
        n_accepted, token = speculative_sample(target, draft, tokens(0), gen(seed))
        assert (n_accepted, token) == (0, 1)  # residual max(0, p - q) = [0, 0.1, 0]


def test_draft_probability_zero_rejects_even_if_the_target_likes_the_token():
    target = rows([0.2, 0.8, 0.0], [0.0, 0.0, 1.0])
    draft = rows([0.0, 0.5, 0.5])  # the draft token 0 has q = 0: an inconsistent draft is rejected
    for seed in range(50):
        n_accepted, token = speculative_sample(target, draft, tokens(0), gen(seed))
        # residual max(0, p - q) = [0.2, 0.3, 0] → never token 2
        assert n_accepted == 0 and token in (0, 1)


def test_one_hot_target_accepts_only_its_argmax():
    target = rows([0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0])
    draft = rows([0.25, 0.25, 0.25, 0.25])
    for seed in range(20):
        assert speculative_sample(target, draft, tokens(2), gen(seed)) == (1, 1)
        assert speculative_sample(target, draft, tokens(3), gen(seed)) == (0, 2)
        assert speculative_sample(target, None, tokens(0), gen(seed)) == (0, 2)


def test_point_mass_draft_accepts_with_probability_p_and_never_recovers_the_rejected_token():
    target = rows([0.5, 0.3, 0.2], [0.0, 0.0, 1.0])
    outcomes = [speculative_sample(target, None, tokens(0), gen(seed)) for seed in range(2000)]
    accepted = sum(n for n, _ in outcomes)
    assert abs(accepted / 2000 - 0.5) < 0.05
    assert all(token == 2 for n, token in outcomes if n == 1)
    assert {token for n, token in outcomes if n == 0} == {1, 2}
    sure = rows([1.0, 0.0, 0.0], [0.0, 1.0, 0.0])
    assert all(speculative_sample(sure, None, tokens(0), gen(seed)) == (1, 1) for seed in range(50))


def test_residual_falls_back_to_the_target_when_p_equals_q():
    target = rows([0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0])
    draft = rows([0.5, 0.5, 0.0, 0.0])
    # q(x=2) = 0 → rejected; max(0, p - q) = 0 everywhere → draw from p instead of failing
    drawn = {speculative_sample(target, draft, tokens(2), gen(seed))[1] for seed in range(100)}
    assert drawn == {0, 1}


def test_no_draft_tokens_means_one_draw_from_the_first_row():
    target = rows([0.0, 0.0, 1.0])
    assert speculative_sample(target, None, tokens(), gen()) == (0, 2)
    assert speculative_sample(target, torch.zeros(0, 3), tokens(), gen()) == (0, 2)


def test_float32_inputs_and_shape_check():
    target = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]], dtype=torch.float32)
    draft = torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float32)
    assert speculative_sample(target, draft, tokens(1), gen()) == (1, 2)
    with pytest.raises(ValueError, match="k\\+1"):
        speculative_sample(target[:1], draft, tokens(1), gen())


def test_same_generator_state_same_result():
    target = rows([0.3, 0.3, 0.4], [0.2, 0.2, 0.6], [0.1, 0.8, 0.1])
    draft = rows([0.6, 0.2, 0.2], [0.1, 0.1, 0.8])
    first = [speculative_sample(target, draft, tokens(0, 2), gen(seed)) for seed in range(100)]
    second = [speculative_sample(target, draft, tokens(0, 2), gen(seed)) for seed in range(100)]
    assert first == second
    assert len(set(first)) > 3


def test_greedy_verify():
    logits = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0], [0.0, 0.0, 9.0]])
    assert greedy_verify(logits, tokens(1, 0)) == (2, 2)  # all accepted, bonus = argmax of the last row
    assert greedy_verify(logits, tokens(1, 2)) == (1, 0)  # mismatch at 1 → the target's argmax there
    assert greedy_verify(logits, tokens(2, 0)) == (0, 1)
    assert greedy_verify(logits[:1], tokens()) == (0, 1)
    assert greedy_verify(torch.softmax(logits, -1), tokens(1, 0)) == (2, 2)  # probabilities work as well


# ------------------------------------------------------------------------------------ statistical tests


def run_trials(
    verifier, target: torch.Tensor, draft: torch.Tensor | None, fixed: torch.Tensor | None, seed: int
) -> list[tuple[int, int, int]]:
    """(first emitted token, n_accepted, next token) per trial; draft tokens drawn from ``draft`` each trial."""
    generator = gen(seed)
    k = target.shape[0] - 1
    if draft is None:
        all_drafts = fixed.expand(TRIALS, k)
    else:
        all_drafts = torch.multinomial(draft, TRIALS, replacement=True, generator=generator).T
    out = []
    for draft_tokens in all_drafts:
        n_accepted, token = verifier(target, draft, draft_tokens.contiguous(), generator)
        first = int(draft_tokens[0]) if n_accepted > 0 else token
        out.append((first, n_accepted, token))
    return out


def dirichlet_rows(k: int, vocab: int, seed: int, concentration: float = 0.5) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.tensor(rng.dirichlet([concentration] * vocab, size=k), dtype=torch.float64)


def _cases():
    vocab = 8
    target3 = dirichlet_rows(3, vocab, seed=1)
    target2 = dirichlet_rows(2, vocab, seed=2)
    holes = dirichlet_rows(1, vocab, seed=3)
    holes[0, :3] = 0.0  # q = 0 on tokens the target likes
    holes /= holes.sum(-1, keepdim=True)
    return {
        "k1-random-q": (target2, dirichlet_rows(1, vocab, seed=4), None),
        "k2-random-q": (target3, dirichlet_rows(2, vocab, seed=5), None),
        "k1-q-with-zeros": (target2, holes, None),
        "k2-q-near-p": (target3, (0.8 * target3[:2] + 0.2 / vocab), None),
        "k1-point-mass": (target2, None, tokens(int(target2[0].argmax()))),
        "k2-point-mass-unlikely": (target3, None, tokens(int(target3[0].argmin()), 0)),
    }


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_first_emitted_token_follows_the_target(name):
    target, draft, fixed = CASES[name]
    trials = run_trials(speculative_sample, target, draft, fixed, seed=100)
    counts = np.bincount([first for first, _, _ in trials], minlength=target.shape[1])
    assert chisquare_pvalue(counts, target[0].numpy()) > ALPHA


def joint_law(target: torch.Tensor, draft: torch.Tensor | None, fixed: torch.Tensor | None) -> np.ndarray:
    """P(n_accepted = n, next = y) for fixed target rows: prod_{i<n} β_i · r_n(y) (r_k = p_k: the bonus)."""
    k, vocab = target.shape[0] - 1, target.shape[1]
    if draft is None:
        draft = torch.nn.functional.one_hot(fixed, vocab).double()
    law = np.zeros((k + 1, vocab))
    reach = 1.0
    for n in range(k + 1):
        if n == k:
            law[n] = reach * target[n].numpy()
            break
        overlap = torch.minimum(target[n], draft[n])
        residual = (target[n] - draft[n]).clamp_min(0).numpy()
        law[n] = reach * residual
        reach *= float(overlap.sum())
    return law


@pytest.mark.parametrize("compiled", [False, True], ids=["torch", "compiled"])
@pytest.mark.parametrize("name", ["k1-random-q", "k2-random-q", "k1-q-with-zeros", "k2-point-mass-unlikely"])
def test_joint_law_of_accepted_count_and_next_token(name, compiled):
    """Float64 rows take the torch path; float32 rows (a runner's) the kernels' one call (``exact_chain``)."""
    target, draft, fixed = CASES[name]
    if compiled:
        if kernels.ops() is None:
            unavailable("the CPU kernels did not build here")
        target, draft = target.float(), None if draft is None else draft.float()
        target = target / target.sum(-1, keepdim=True)
        draft = None if draft is None else draft / draft.sum(-1, keepdim=True)
    trials = run_trials(speculative_sample, target, draft, fixed, seed=200)
    counts = np.zeros((target.shape[0], target.shape[1]))
    for _, n_accepted, token in trials:
        counts[n_accepted, token] += 1
    assert chisquare_pvalue(counts, joint_law(target, draft, fixed)) > ALPHA


@contextlib.contextmanager
def torch_only():
    """Both exact-sampling fast paths turned off: ``speculative_sample`` and ``inverse_cdf`` in torch ops."""
    with (
        mock.patch.object(specdecode.sampling.verify, "_chain_kernels", lambda *rows: None),
        mock.patch.object(specdecode.sampling.choices, "_sampling_kernels", lambda probs: None),
    ):
        yield


@pytest.mark.parametrize("variant", ["native", "mutant_index", "mutant_point_mass", "mutant_block"])
def test_the_compiled_chain_makes_the_torch_paths_decisions(variant, monkeypatch):
    """With the same generator seed, ``exact_chain`` (one kernel call) returns what the torch ops return: the
    same uniforms are drawn in the same order, so only float64 rounding of the cumulative sums could differ.
    600 random cases: k 0..3, vocabularies across block edges up to 49,152, q random, a point mass, or equal to
    p (the residual falls back to p), targets with zero-mass halves. Control: the mutant builds whose fault these
    cases reach (kernels.MUTANTS: the index, the point mass, the block walk) make another decision in some case;
    the residual's 1% of p moves too few of 600 draws, the accept and eps faults need tests/kernels/' inputs."""
    use_build(variant, monkeypatch)
    different = 0
    cases = torch.Generator().manual_seed(11)
    for case in range(600):
        vocab = 49_152 if case % 50 == 0 else int(torch.randint(1, 300, (), generator=cases))
        k = int(torch.randint(0, 4, (), generator=cases))
        target = torch.softmax(3 * torch.randn(k + 1, vocab, generator=cases), -1)
        if case % 5 == 0:
            target[:, : vocab // 2] = 0.0
        draft = None if case % 4 == 0 else torch.softmax(3 * torch.randn(k, vocab, generator=cases), -1)
        if draft is not None and k and case % 7 == 0:
            draft[0] = target[0]
        guesses = torch.randint(0, vocab, (k,), generator=cases)
        try:
            compiled = speculative_sample(target, draft, guesses, gen(case))
        except ValueError:  # a mutant's draw may find no mass
            compiled = None
        with torch_only():
            reference = speculative_sample(target, draft, guesses, gen(case))
        if variant == "native":
            assert compiled == reference, case
        different += compiled != reference
    assert variant == "native" or different > 0, variant


def test_the_compiled_chain_refuses_a_row_without_mass():
    target = torch.tensor([[1.0, 0.0, 0.0], [float("nan"), 0.0, 0.0]])
    with pytest.raises(ValueError, match="no positive, finite mass"):
        speculative_sample(target, None, tokens(0), gen(0))  # always accepted (p = 1), then the NaN row
    with pytest.raises(ValueError, match="no positive, finite mass"):
        speculative_sample(torch.zeros(1, 3), None, tokens(), gen(0))


def test_negative_control_the_first_token_test_detects_a_wrong_residual():
    target, draft, fixed = CASES["k1-random-q"]
    trials = run_trials(resample_from_target, target, draft, fixed, seed=100)
    counts = np.bincount([first for first, _, _ in trials], minlength=target.shape[1])
    assert chisquare_pvalue(counts, target[0].numpy()) < ALPHA


# ------------------------------------------------------------------------------------------- token trees
# A tree: parents[i] < i, −1 for a child of the root; target row 0 is the root, row i + 1 is node i.
#
#        root ─┬─ 0:"1" ─── 2:"3"
#              └─ 1:"2" ─┬─ 3:"0"
#                        └─ 4:"3"
TREE_TOKENS = tokens(1, 2, 3, 0, 3)
TREE_PARENTS = tokens(-1, -1, 0, 1, 1)


def argmax_rows(*ids: int) -> torch.Tensor:
    return torch.nn.functional.one_hot(torch.tensor(ids), 4).double()


def test_tree_greedy_follows_the_argmax_path_then_emits_the_argmax():
    # rows: root → 2, node 0 → 3, node 1 → 3, node 2 → 1, node 3 → 1, node 4 → 2
    logits = argmax_rows(2, 3, 3, 1, 1, 2)
    assert tree_greedy_verify(logits, TREE_TOKENS, TREE_PARENTS) == ([1, 4], 2)  # leaf: the bonus from its row
    assert tree_greedy_verify(argmax_rows(1, 3, 0, 0, 0, 0), TREE_TOKENS, TREE_PARENTS) == ([0, 2], 0)
    assert tree_greedy_verify(argmax_rows(2, 0, 1, 0, 0, 0), TREE_TOKENS, TREE_PARENTS) == ([1], 1)  # no child "1"
    assert tree_greedy_verify(argmax_rows(0, 0, 0, 0, 0, 0), TREE_TOKENS, TREE_PARENTS) == ([], 0)
    assert tree_greedy_verify(argmax_rows(3), tokens(), tokens()) == ([], 3)


def test_tree_coupled_takes_the_first_matching_sibling_and_checks_parents():
    # two siblings share token 5: the first one (and its subtree) is followed
    assert tree_coupled_verify(tokens(5, 7, 9, 4), tokens(5, 5, 7), tokens(-1, -1, 1)) == ([0], 7)
    with pytest.raises(ValueError, match="parents"):
        tree_coupled_verify(tokens(5, 7, 9), tokens(5, 5), tokens(-1, 1))


def test_tree_sampling_with_point_masses_covering_the_support_always_accepts_a_child():
    # p = [0, 0.5, 0.5, 0]: child "1" passes with p = 0.5; after its rejection r = δ_2, so child "2" passes
    target = rows([0.0, 0.5, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0])
    outcomes = [tree_speculative_sample(target, None, tokens(1, 2), tokens(-1, -1), gen(s)) for s in range(200)]
    assert all(outcome in (([0], 3), ([1], 0)) for outcome in outcomes)
    assert 60 < sum(accepted == [0] for accepted, _ in outcomes) < 140


def test_tree_sampling_never_accepts_a_token_the_target_rules_out_and_recovers_from_the_rest():
    target = rows([0.0, 0.5, 0.5, 0.0], [0.25] * 4, [0.25] * 4)
    draft = rows([0.5, 0.0, 0.0, 0.5], [0.5, 0.0, 0.0, 0.5])
    for seed in range(100):
        accepted, token = tree_speculative_sample(target, draft, tokens(0, 3), tokens(-1, -1), gen(seed))
        assert accepted == [] and token in (1, 2)


def test_tree_sampling_checks_shapes():
    with pytest.raises(ValueError, match="n\\+1"):
        tree_speculative_sample(rows([1.0, 0.0]), None, tokens(0), tokens(-1), gen())


TREE_VOCAB = 6
TREE_TRIALS = 10_000
TREE_SHAPES = {"chain": (1, 1), "star": (3,), "deep-wide": (3, 2)}


def tree_trials(rule, widths: tuple[int, ...], sampled: bool, seed: int) -> np.ndarray:
    """Counts of the first two emitted tokens over TREE_TRIALS rounds, each on a freshly drawn tree.

    The target is a two-step law p1(x1) p2(x2 | x1) (rows deeper than 2 are arbitrary); a round that emits one
    token is completed by a draw from p2(· | x1), as the next round would be.
    """
    p1 = dirichlet_rows(1, TREE_VOCAB, seed=7)[0]
    p2 = dirichlet_rows(TREE_VOCAB, TREE_VOCAB, seed=8)
    p3 = dirichlet_rows(TREE_VOCAB, TREE_VOCAB, seed=9)
    table = random_tables(len(widths), TREE_VOCAB, seed=10)
    generator = gen(seed)
    counts = np.zeros((TREE_VOCAB, TREE_VOCAB))
    for _ in range(TREE_TRIALS):
        draft = draw_tree(widths, table, 0, generator, sampled)
        first_level = draft.parents < 0
        target = torch.cat([p1[None], torch.where(first_level[:, None], p2[draft.tokens], p3[draft.tokens])])
        accepted, token = rule(target, draft.probs, draft.tokens, draft.parents, generator)
        emitted = draft.tokens[accepted].tolist() + [token]
        if len(emitted) == 1:
            emitted.append(int(torch.multinomial(p2[emitted[0]], 1, generator=generator)))
        counts[emitted[0], emitted[1]] += 1
    return counts, (p1[:, None] * p2).numpy()


@pytest.mark.parametrize("sampled", [True, False], ids=["sampled-q", "point-masses"])
@pytest.mark.parametrize("shape", list(TREE_SHAPES))
def test_tree_sampling_emits_the_targets_two_token_law(shape, sampled):
    counts, law = tree_trials(tree_speculative_sample, TREE_SHAPES[shape], sampled, seed=300)
    assert chisquare_pvalue(counts, law) > ALPHA


@pytest.mark.parametrize(
    "bug, sampled",
    [("update_residual", False), ("update_residual", True), ("remove_tried", True)],
    ids=["residual-kept-point-masses", "residual-kept-sampled-q", "tried-siblings-kept-in-q"],
)
def test_negative_control_tree_rules_missing_a_step_are_caught(bug, sampled):
    def wrong(*args):
        return biased_tree_sample(*args, **{bug: False})

    counts, law = tree_trials(wrong, TREE_SHAPES["star"], sampled, seed=300)
    assert chisquare_pvalue(counts, law) < ALPHA
