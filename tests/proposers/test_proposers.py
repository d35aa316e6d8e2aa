"""Proposers: prompt lookup against a brute-force scan; the draft model's cache resync after any round."""

from __future__ import annotations

import random

import pytest
import torch

import specdecode as sd
from specdecode.proposers.base import common_prefix_length

GREEDY = sd.SamplingParams(temperature=0.0)


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def lookup(proposer: sd.PromptLookupProposer, context: list[int], k: int) -> list[int]:
    draft = proposer.propose(context, k, GREEDY, gen())
    assert draft.probs is None  # a point mass
    assert draft.tokens.dtype == torch.int64
    return draft.tokens.tolist()


def brute_force_lookup(context: list[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
    """Longest suffix n-gram first; among its earlier occurrences the latest; propose what followed."""
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(context):
            continue
        suffix = context[-n:]
        for start in range(len(context) - n - 1, -1, -1):  # occurrences that have a follower
            if context[start : start + n] == suffix:
                return context[start + n : start + n + k]
    return []


def test_prompt_lookup_prefers_the_longest_match_then_the_latest():
    proposer = sd.PromptLookupProposer(max_ngram=3, min_ngram=1)
    # suffix [1, 2, 3] occurs at 0 (followed by 7, 8); [2, 3] alone occurs later at 6 (followed by 9)
    context = [1, 2, 3, 7, 8, 5, 2, 3, 9, 4, 1, 2, 3]
    assert lookup(proposer, context, 2) == [7, 8]
    assert lookup(sd.PromptLookupProposer(), context, 2) == [7, 8]
    # two occurrences of the 3-gram: the latest wins
    context = [1, 2, 3, 7, 8, 1, 2, 3, 9, 4, 1, 2, 3]
    assert lookup(sd.PromptLookupProposer(), context, 3) == [9, 4, 1]
    # only a 1-gram matches: the latest occurrence of 3
    context = [3, 5, 6, 3, 4, 0, 3]
    assert lookup(sd.PromptLookupProposer(), context, 2) == [4, 0]


def test_prompt_lookup_proposes_up_to_k_and_may_run_into_the_suffix():
    context = [5, 6, 5, 6, 5]
    assert lookup(sd.PromptLookupProposer(), context, 10) == [6, 5]  # [6, 5] follows the latest [5, 6, 5]
    assert lookup(sd.PromptLookupProposer(), context, 1) == [6]
    assert lookup(sd.PromptLookupProposer(), context, 0) == []


def test_prompt_lookup_proposes_nothing_without_a_match():
    assert lookup(sd.PromptLookupProposer(), [1, 2, 3, 4], 4) == []
    assert lookup(sd.PromptLookupProposer(), [7], 4) == []
    assert lookup(sd.PromptLookupProposer(max_ngram=3, min_ngram=2), [1, 2, 3, 4, 2], 4) == []
    assert lookup(sd.PromptLookupProposer(max_ngram=3, min_ngram=2), [1, 2, 3, 4, 1, 2], 4) == [3, 4, 1, 2]


def test_prompt_lookup_rejects_bad_ngram_bounds():
    with pytest.raises(ValueError, match="min_ngram"):
        sd.PromptLookupProposer(max_ngram=1, min_ngram=2)
    with pytest.raises(ValueError, match="min_ngram"):
        sd.PromptLookupProposer(max_ngram=3, min_ngram=0)


@pytest.mark.parametrize(("max_ngram", "min_ngram"), [(3, 1), (4, 2), (1, 1)])
def test_incremental_index_matches_brute_force_on_growing_and_replaced_contexts(max_ngram, min_ngram):
    rng = random.Random(max_ngram * 10 + min_ngram)
    proposer = sd.PromptLookupProposer(max_ngram=max_ngram, min_ngram=min_ngram)
    context: list[int] = []
    for step in range(600):
        action = rng.random()
        if not context or action < 0.03:  # a new, unrelated request
            context = [rng.randrange(6) for _ in range(rng.randrange(1, 20))]
        elif action < 0.08:  # rolled back to a shorter context, then continued differently
            context = context[: rng.randrange(1, len(context) + 1)] + [rng.randrange(6)]
        elif action < 0.10:  # same length, one token changed in the middle
            i = rng.randrange(len(context))
            context = context[:i] + [(context[i] + 1) % 6] + context[i + 1 :]
        else:  # grows by a round's worth of tokens
            context = context + [rng.randrange(6) for _ in range(rng.randrange(1, 5))]
        k = rng.randrange(1, 6)
        expected = brute_force_lookup(context, k, max_ngram, min_ngram)
        assert lookup(proposer, list(context), k) == expected, (step, context, k)


def brute_force_branches(context: list[int], k: int, branches: int, max_ngram: int = 3, min_ngram: int = 1):
    """Continuations after the suffix n-gram's occurrences (longest n first, latest first), each kept if it is
    not a prefix of the ones kept so far, up to ``branches``; returned as the set of their prefixes."""
    kept: set[tuple[int, ...]] = set()
    taken = 0
    for n in range(max_ngram, min_ngram - 1, -1):
        if n >= len(context):
            continue
        for start in range(len(context) - n - 1, -1, -1):
            if taken == branches:
                break
            if context[start : start + n] == context[-n:]:
                follow = tuple(context[start + n : start + n + k])
                prefixes = {follow[:i] for i in range(1, len(follow) + 1)}
                taken += not prefixes <= kept
                kept |= prefixes
    return kept


def node_paths(draft: sd.Draft) -> list[tuple[int, ...]]:
    """The token path from the root to each node."""
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(draft.tokens.tolist(), draft.parents.tolist(), strict=True):
        paths.append((paths[parent] if parent >= 0 else ()) + (token,))
    return paths


def test_prompt_lookup_tree_offers_distinct_continuations_as_branches():
    # [1, 2] was followed by 9 8 (latest), 7 5 and 9 4: a trie 9─┬─8 and 7─5, limited to `branches`
    context = [1, 2, 9, 4, 0, 1, 2, 7, 5, 0, 1, 2, 9, 8, 0, 1, 2]
    tree = sd.PromptLookupProposer(max_ngram=2, min_ngram=2, branches=3).propose(context, 2, GREEDY, gen())
    assert tree.probs is None and tree.is_tree
    assert tree.tokens.tolist() == [9, 8, 7, 5, 4] and tree.parents.tolist() == [-1, 0, -1, 2, 0]
    two = sd.PromptLookupProposer(max_ngram=2, min_ngram=2, branches=2).propose(context, 2, GREEDY, gen())
    assert node_paths(two) == [(9,), (9, 8), (7,), (7, 5)]
    chain = sd.PromptLookupProposer(max_ngram=2, min_ngram=2).propose(context, 2, GREEDY, gen())
    assert chain.parents is None and chain.tokens.tolist() == [9, 8]  # the default stays a chain
    with pytest.raises(ValueError, match="branches"):
        sd.PromptLookupProposer(branches=0)


@pytest.mark.parametrize("branches", [2, 4])
def test_prompt_lookup_tree_matches_brute_force_on_growing_contexts(branches):
    rng = random.Random(branches)
    proposer = sd.PromptLookupProposer(branches=branches)
    context: list[int] = []
    for step in range(300):
        if not context or rng.random() < 0.05:
            context = [rng.randrange(5) for _ in range(rng.randrange(1, 20))]
        else:
            context = context + [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        k = rng.randrange(1, 5)
        draft = proposer.propose(list(context), k, GREEDY, gen())
        paths = node_paths(draft) if len(draft) else []
        assert len(paths) == len(set(paths)), (step, context)  # siblings are distinct
        assert set(paths) == brute_force_branches(context, k, branches), (step, context, k)
        assert all(len(path) <= k for path in paths)


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2, 3], [1, 2, 3, 4]) == 3
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5], [1]) == 0
    for n in range(12):
        a = list(range(12))
        b = a[:n] + [99] + a[n + 1 :]
        assert common_prefix_length(a, b) == n


# ---------------------------------------------------------------------------------------------- draft model


def proposal(proposer, context: list[int], k: int, params: sd.SamplingParams, seed: int = 0):
    draft = proposer.propose(list(context), k, params, gen(seed))
    return draft.tokens.tolist(), draft.probs


def assert_same_proposal(stateful, context: list[int], k: int, params: sd.SamplingParams, model, seed: int):
    tokens, probs = proposal(stateful, context, k, params, seed)
    fresh_tokens, fresh_probs = proposal(sd.DraftModelProposer(model), context, k, params, seed)
    assert tokens == fresh_tokens, context
    if params.greedy:
        assert probs is None and fresh_probs is None
    else:
        torch.testing.assert_close(probs, fresh_probs, atol=1e-5, rtol=1e-4)
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_draft_model_resyncs_after_partial_full_and_no_acceptance(large_draft, temperature):
    params = sd.SamplingParams(temperature=temperature)
    proposer = sd.DraftModelProposer(large_draft)
    rng = random.Random(1)
    context = [rng.randrange(large_draft.vocab_size) for _ in range(6)]
    for round_ in range(40):
        k = rng.randrange(1, 6)
        guesses = assert_same_proposal(proposer, context, k, params, large_draft, seed=round_)
        assert len(guesses) == k
        n_accepted = rng.choice([0, k, rng.randrange(k + 1)])
        extra = rng.randrange(large_draft.vocab_size)  # the recovered or bonus token
        context = context + guesses[:n_accepted] + [extra]
        if round_ % 13 == 12:  # a new request on the same proposer
            context = context[:3]


def test_draft_model_probs_are_the_warped_draft_distribution(large_draft):
    params = sd.SamplingParams(temperature=0.7, top_k=5)
    context = [3, 1, 4, 1, 5]
    tokens, probs = proposal(sd.DraftModelProposer(large_draft), context, 3, params)
    runner = large_draft.new_runner()
    logits = runner.forward(torch.tensor(context + tokens[:2]))[len(context) - 1 :]
    torch.testing.assert_close(probs, sd.sampling.probs_from_logits(logits, params), atol=1e-5, rtol=1e-4)
    assert ((probs > 0).sum(-1) == 5).all()
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens))


def test_draft_model_proposes_nothing_for_k_zero(large_draft):
    assert proposal(sd.DraftModelProposer(large_draft), [1, 2], 0, GREEDY)[0] == []


def test_layer_skip_is_the_targets_first_layers(large_target):
    proposer = sd.LayerSkipProposer(large_target, 1)
    assert proposer.model.model.config.num_hidden_layers == 1
    assert large_target.model.config.num_hidden_layers == 2  # the target is untouched
    assert proposer.model.model.lm_head is large_target.model.lm_head  # weights are shared
    context = [5, 9, 2, 7]
    tokens, _ = proposal(proposer, context, 4, GREEDY)
    assert len(tokens) == 4
    with torch.no_grad():
        full = large_target.model(torch.tensor([context])).logits[0, -1]
    assert proposal(sd.DraftModelProposer(large_target), context, 1, GREEDY)[0] == [int(full.argmax())]
    with pytest.raises(ValueError, match="1 <= N < 2"):
        sd.LayerSkipProposer(large_target, 2)
