"""Suffix decoding: the index against brute force, the drafts' scoring, the history (across requests, saved,
evicted, shared by threads), greedy / reproducible identity, and exact sampling with a negative control.

The exactness tests sample the first two tokens SAMPLES times with ``check_exactness`` at family false-alarm
rate ALPHA / CASES per call, CASES = 4 calls that must pass (2 cases × 2 runners): a correct engine fails any
with probability ≤ ALPHA = 1%. The proposer's history branches after the prompt's suffix, so rounds verify
point-mass trees with several siblings; the negative control runs the same check on a tree rule that forgets
to update the residual after a rejected sibling and must fail it.
"""

from __future__ import annotations

import functools
import random
import threading

import pytest
import torch
from helpers.laws import biased_tree_sample
from helpers.models import SMALL_VOCAB

import specdecode as sd
import specdecode.engine.decoder
from specdecode.control import PassCosts
from specdecode.exactness.check import check_exactness
from specdecode.proposers.suffix import MAGIC, SuffixCacheError, SuffixHistory, SuffixProposer
from specdecode.proposers.suffix_index import ORDERS, SuffixIndex, suffix_hashes

GREEDY = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
T1 = sd.SamplingParams(temperature=1.0)
ALPHA, CASES, SAMPLES = 0.01, 4, 1500


def propose(proposer: SuffixProposer, context: list[int], k: int = 8) -> sd.Draft:
    return proposer.propose(context, k, GREEDY, torch.Generator())


def random_documents(seed: int, count: int, vocab: int = 12) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.randrange(1, 150))] for _ in range(count)]


# ------------------------------------------------------------------------------------------------- index


def brute_matches(documents: list[list[int]], gram: list[int], limit: int) -> list[tuple[int, int]]:
    """(document, offset after the match) of the newest ``limit`` occurrences of ``gram`` with a follower."""
    found = []
    for d in range(len(documents) - 1, -1, -1):
        doc = documents[d]
        for end in range(len(doc) - 1, len(gram) - 1, -1):
            if doc[end - len(gram) : end] == gram and end < len(doc):
                found.append((d, end))
    return found[:limit]


def test_one_by_one_and_bulk_appends_build_the_same_index_through_table_growth():
    documents = random_documents(0, 40)
    singles, bulk, mixed = SuffixIndex(), SuffixIndex(), SuffixIndex()
    for doc in documents:
        for token in doc:
            singles.append([token])
        bulk.append(doc)
        mixed.append(doc[:3])  # a short append, then a long one continuing the same document
        mixed.append(doc[3:])
        for index in (singles, bulk, mixed):
            index.close()
    assert singles.bits > 10  # the tables grew (a rebuild) along the way
    for index in (bulk, mixed):
        assert index.tokens == singles.tokens and index.bits == singles.bits
        for m in ORDERS:
            assert index.chain[m] == singles.chain[m] and index.head[m] == singles.head[m], m


def test_matches_are_the_newest_occurrences_with_a_follower_and_continuations_stop_at_documents():
    documents = random_documents(1, 30, vocab=4)
    index = SuffixIndex()
    starts = []
    for doc in documents:
        starts.append(len(index.tokens))
        index.append(doc)
        index.close()
    rng = random.Random(2)
    for _ in range(200):
        m = rng.choice(ORDERS[:5])
        gram = [rng.randrange(4) for _ in range(m)]
        found = index.matches(gram, suffix_hashes(gram)[m], limit=6, max_steps=10**6)
        expected = brute_matches(documents, gram, 6)
        assert found == [starts[d] + end for d, end in expected]
        for (d, end), position in zip(expected, found, strict=True):
            assert index.continuation(position, 10) == documents[d][end : end + 10]


def test_eviction_drops_the_oldest_documents_and_keeps_the_index_consistent():
    history = SuffixHistory(max_tokens=1000)
    documents = random_documents(3, 60)
    for doc in documents:
        history.add(doc)
        assert len(history) <= 1000
    kept = history.documents
    assert 0 < kept < len(documents)
    rebuilt = SuffixIndex()
    for doc in documents[-kept:]:
        rebuilt.append(doc)
        rebuilt.close()
    assert history.index.tokens == rebuilt.tokens
    for m in ORDERS:
        gram = documents[-1][:m]
        if len(gram) == m:
            h = suffix_hashes(gram)[m]
            assert history.index.matches(gram, h, 8, 10**6) == rebuilt.matches(gram, h, 8, 10**6)


# ------------------------------------------------------------------------------------------------ drafts


def test_the_longest_match_wins_and_the_draft_is_the_trie_of_its_continuations():
    history = SuffixHistory()
    history.add([9, 1, 2, 3, 4, 5])  # "1 2 3" then 4 5
    history.add([8, 2, 3, 6, 7])  # only "2 3": loses to the longer match
    history.add([1, 2, 3, 4, 10])
    history.add([1, 2, 3, 11])
    history.add([1, 2, 3, 4, 5])
    proposer = SuffixProposer(history, min_probability=0.2, match_factor=10, recency=1.0, tree_nodes=8)
    draft = propose(proposer, [0, 1, 2, 3], k=3)
    # occurrences after "1 2 3": 4 5 | 4 10 | 11 | 4 5 → P(4) = 3/4, P(4 5) = 2/4, P(11) = P(4 10) = 1/4
    # (a tie goes to the newer occurrence's continuation)
    assert draft.tokens.tolist() == [4, 5, 11, 10]
    assert draft.parents.tolist() == [-1, 0, -1, 0]
    chain = propose(SuffixProposer(history, tree_nodes=0, match_factor=10, recency=1.0), [0, 1, 2, 3], k=3)
    assert chain.parents is None and chain.tokens.tolist() == [4, 5]
    # weighted by recency 1/2: the newest (4 5) weighs 1, then 11, 4 10, 4 5 weigh 1/2, 1/4, 1/8 (sum 15/8)
    recent = propose(SuffixProposer(history, min_probability=0.2, match_factor=10, tree_nodes=8), [0, 1, 2, 3], k=3)
    assert recent.tokens.tolist() == [4, 5, 11]  # P(4 10) = 2/15 < 0.2


def test_the_requests_own_match_wins_a_tie_with_the_history():
    history = SuffixHistory()
    history.add([1, 2, 3, 9, 9])
    proposer = SuffixProposer(history, match_factor=10)
    assert propose(proposer, [5, 2, 3, 7, 1, 2, 3], k=2).tokens.tolist() == [9, 9]  # "1 2 3": only the history
    assert propose(proposer, [1, 2, 3, 7, 1, 2, 3], k=2).tokens.tolist() == [7, 1]  # the request's own "1 2 3"


def test_draft_depth_follows_the_match_length_and_k():
    history = SuffixHistory()
    history.add(list(range(40)))
    proposer = SuffixProposer(history, match_factor=1.0)
    assert propose(proposer, [99, 5], k=30).tokens.tolist() == [6]  # a one-token match earns one guess
    assert propose(proposer, [99, 2, 3, 4, 5], k=30).tokens.tolist() == [6, 7, 8, 9]
    assert len(propose(proposer, [99, *range(20)], k=5)) == 5
    assert len(propose(proposer, [99, 50], k=5)) == 0  # no match
    assert len(propose(proposer, [1, 2], k=0)) == 0


def test_a_node_below_the_probability_threshold_or_past_the_size_cap_is_left_out():
    history = SuffixHistory()
    for follower in [5] * 7 + [6, 7, 8]:
        history.add([1, 2, follower])

    def drafted(tree_nodes=8, **settings):
        proposer = SuffixProposer(history, max_matches=32, recency=1.0, tree_nodes=tree_nodes, **settings)
        return propose(proposer, [1, 2]).tokens.tolist()

    assert drafted(min_probability=0.15) == [5]
    assert sorted(drafted(min_probability=0.1)) == [5, 6, 7, 8]
    assert drafted(min_probability=0.1, tree_nodes=2)[0] == 5


def test_the_measured_verify_cost_caps_the_tree():
    history = SuffixHistory()
    for follower in (5, 6, 7, 8):
        history.add([1, 2, follower])
    proposer = SuffixProposer(history, min_probability=0.1, recency=1.0, tree_nodes=8)
    costs = PassCosts()
    proposer.bind_target("vocabulary", costs)
    assert len(propose(proposer, [1, 2])) == 4  # nothing measured yet: only the threshold and the cap
    costs.observe(1, 0.010, 0, 0.0)
    costs.observe(5, 0.030, 4, 0.0)  # v(2) = 1.5: a guess of P = 1/4 lowers (1 + P) / v
    assert len(propose(proposer, [1, 2])) == 0
    costs.seconds = {1: 0.010, 5: 0.0104}  # nearly free rows: all four pay
    assert len(propose(proposer, [1, 2])) == 4


# ----------------------------------------------------------------------------------------------- history


def test_a_request_is_remembered_when_it_ends_and_a_repeat_is_drafted_whole(large_target):
    prompt = [5, 17, 33, 5, 17, 2, 60, 41]
    proposer = SuffixProposer()
    decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=8)
    first = decoder.generate(prompt, GREEDY)
    assert len(proposer.history) == len(prompt) + len(first.token_ids)
    again = decoder.generate(prompt, GREEDY)
    assert again.token_ids == first.token_ids
    assert again.stats.tokens_per_round > 4 and again.stats.acceptance_rate > 0.95
    forgetful = SuffixProposer(remember=False)
    sd.SpeculativeDecoder(large_target, forgetful, gamma=8).generate(prompt, GREEDY)
    assert len(forgetful.history) == 0


def test_a_request_left_without_end_request_is_remembered_when_the_next_one_starts():
    proposer = SuffixProposer()
    propose(proposer, [1, 2, 3, 4])
    propose(proposer, [1, 2, 3, 4, 5, 6])  # the same request, grown
    assert len(proposer.history) == 0
    propose(proposer, [7, 8])  # another request
    assert proposer.history.index.tokens.tolist() == [1, 2, 3, 4, 5, 6, -1]
    assert propose(proposer, [7, 8, 3, 4], k=2).tokens.tolist() == [5, 6]


def test_forks_share_one_history_and_keep_their_own_requests():
    proposer = SuffixProposer()
    fork = proposer.fork()
    propose(proposer, [1, 2, 3])
    propose(fork, [4, 5, 6])
    proposer.end_request([1, 2, 3, 9])
    assert propose(fork, [4, 5, 6, 1, 2, 3], k=1).tokens.tolist() == [9]
    assert fork.history is proposer.history


def test_threads_adding_and_drafting_at_once_keep_the_history_consistent():
    history = SuffixHistory(max_tokens=5000)
    documents = random_documents(4, 400)
    errors = []

    def writer(docs):
        for doc in docs:
            history.add(doc)

    def reader():
        proposer = SuffixProposer(history, remember=False)
        try:
            for doc in documents[:200]:
                draft = propose(proposer, doc[:5])
                assert len(draft) <= 8
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(documents[i::2],)) for i in range(2)]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(history) <= 5000 and history.index.tokens.count(-1) == history.documents


# ------------------------------------------------------------------------------------------- persistence


def test_a_saved_history_loads_with_the_same_drafts(tmp_path):
    proposer = SuffixProposer(min_probability=0.05, tree_nodes=8)
    for doc in random_documents(5, 50, vocab=6):
        proposer.end_request(doc)
    proposer.history.vocabulary = "abc"
    proposer.save(tmp_path / "h.bin")
    loaded = SuffixProposer.load(tmp_path / "h.bin", min_probability=0.05, tree_nodes=8)
    assert loaded.history.vocabulary == "abc" and loaded.history.documents == proposer.history.documents
    for context in random_documents(6, 30, vocab=6):
        a, b = propose(proposer, context), propose(loaded, context)
        assert a.tokens.tolist() == b.tokens.tolist()
        proposer.end_request([])
        loaded.end_request([])


@pytest.mark.parametrize("damage", ["foreign", "truncated", "flipped", "header", "version", "empty"])
def test_a_damaged_or_foreign_cache_is_a_clear_error(tmp_path, damage):
    history = SuffixHistory()
    history.add([1, 2, 3, 4])
    path = tmp_path / "h.bin"
    history.save(path)
    data = bytearray(path.read_bytes())
    if damage == "foreign":
        data = bytearray(b'{"not": "ours"}')
    elif damage == "truncated":
        data = data[:-3]
    elif damage == "flipped":
        data[-6] ^= 1
    elif damage == "header":
        data[len(MAGIC) + 6] = ord("#")
    elif damage == "version":
        data = data.replace(b'"version": 1', b'"version": 9')
    else:
        data = bytearray()
    path.write_bytes(bytes(data))
    with pytest.raises(SuffixCacheError, match="suffix cache"):
        SuffixHistory.load(path)


def test_a_header_field_of_the_wrong_type_is_a_clear_error(tmp_path):
    history = SuffixHistory()
    history.add([1, 2])
    path = tmp_path / "h.bin"
    history.save(path)
    path.write_bytes(path.read_bytes().replace(b'"max_tokens": 1000000', b'"max_tokens": "10000"'))
    with pytest.raises(SuffixCacheError, match="wrong type"):
        SuffixHistory.load(path)


def test_a_history_with_ids_outside_the_targets_vocabulary_is_refused(large_target):
    history = SuffixHistory()
    history.add([1, 2, large_target.vocab_size])
    with pytest.raises(SuffixCacheError, match="outside the target's vocabulary"):
        sd.SpeculativeDecoder(large_target, SuffixProposer(history))


def test_a_history_of_another_vocabulary_is_refused(large_target):
    proposer = SuffixProposer(SuffixHistory(vocabulary="0" * 64))
    with pytest.raises(SuffixCacheError, match="another tokenizer"):
        sd.SpeculativeDecoder(large_target, proposer)
    fresh = SuffixProposer()
    sd.SpeculativeDecoder(large_target, fresh)
    assert fresh.history.vocabulary == large_target.vocabulary_fingerprint


# ------------------------------------------------------------------------------------------- correctness


def repeating_history(target: sd.LoadedModel, prompts: list[list[int]], seed: int) -> SuffixHistory:
    """Earlier answers: each prompt sampled at T = 1, so continuations branch where the history repeats."""
    history = SuffixHistory()
    for i, prompt in enumerate(prompts):
        params = sd.SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed + i)
        history.add(prompt + sd.autoregressive_generate(target, prompt, params).token_ids)
    return history


PROMPTS = [[5, 17, 33, 5, 17, 2, 60, 41], [5, 17, 33, 9], [2, 60, 41, 7, 7]]


@pytest.mark.parametrize("tree_nodes", [0, 8])
def test_greedy_output_is_plain_decoding_across_requests(large_target, tree_nodes):
    history = repeating_history(large_target, PROMPTS * 3, seed=0)
    proposer = SuffixProposer(history, tree_nodes=tree_nodes, min_probability=0.05)
    stats = sd.DecodeStats()
    for gamma in (2, 8, "auto"):
        decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=gamma)
        for prompt in PROMPTS + [[9]]:
            plain = sd.autoregressive_generate(large_target, prompt, GREEDY).token_ids
            out = decoder.generate(prompt, GREEDY)
            assert out.token_ids == plain, (gamma, prompt)
            stats = stats.merge(out.stats)
    assert stats.accepted > 0 and stats.rejections > 0
    assert (stats.tree_rounds > 0) == (tree_nodes > 0)


@pytest.mark.parametrize("seed", [0, 2**40 + 7])
def test_reproducible_output_is_plain_sampling(large_target, seed):
    history = repeating_history(large_target, PROMPTS * 4, seed=100)
    proposer = SuffixProposer(history, min_probability=0.05, tree_nodes=8)
    decoder = sd.SpeculativeDecoder(large_target, proposer, gamma=4, mode="reproducible")
    stats = sd.DecodeStats()
    for prompt in PROMPTS:
        params = sd.SamplingParams(temperature=1.0, top_k=20, max_new_tokens=32, seed=seed)
        out = decoder.generate(prompt, params)
        assert out.token_ids == sd.autoregressive_generate(large_target, prompt, params).token_ids
        stats = stats.merge(out.stats)
    assert stats.tree_rounds > 0 and stats.accepted > 0


EXACT_PROMPT = [3, 9, 4]


def exact_report(target: sd.LoadedModel, tree_nodes: int):
    """check_exactness with a history in which the prompt's suffix is followed by many different tokens
    (point-mass siblings), growing with every sampled request (which the proposer remembers)."""
    rng = random.Random(7)
    history = SuffixHistory()
    for _ in range(12):
        history.add([*EXACT_PROMPT, rng.randrange(SMALL_VOCAB), rng.randrange(SMALL_VOCAB)])
    proposer = SuffixProposer(history, tree_nodes=tree_nodes, min_probability=0.01, match_factor=4)
    return check_exactness(target, proposer, [EXACT_PROMPT], T1, samples=SAMPLES, gamma=2, alpha=ALPHA / CASES)


@pytest.mark.parametrize("tree_nodes", [0, 8])
def test_sampling_follows_the_target_exactly(small_target, tree_nodes):
    report = exact_report(small_target, tree_nodes)
    assert report.passed, report.verdict
    assert report.accepted > SAMPLES / 4 and report.drafted - report.accepted > SAMPLES / 4


def test_negative_control_a_biased_tree_rule_is_caught(small_target, monkeypatch):
    biased = functools.partial(biased_tree_sample, update_residual=False)
    monkeypatch.setattr(specdecode.engine.decoder, "tree_speculative_sample", biased)
    report = exact_report(small_target, 8)
    assert not report.passed, report.verdict


def test_check_exact_cli_takes_the_suffix_proposer():
    from specdecode.factory import build_proposer

    assert isinstance(build_proposer("suffix", None, None), SuffixProposer)
    with pytest.raises(ValueError, match="--suffix-cache applies to the suffix proposer"):
        build_proposer("lookup", None, None, suffix_cache="x")


@pytest.mark.parametrize("length", [1, 5, 31, 32, 33, 60])
def test_short_and_long_documents_round_trip_through_a_file(tmp_path, length):
    history = SuffixHistory()
    history.add(list(range(length)))
    history.save(tmp_path / "h.bin")
    loaded = SuffixHistory.load(tmp_path / "h.bin")
    assert loaded.index.tokens == history.index.tokens
    for m in ORDERS:
        assert loaded.index.chain[m] == history.index.chain[m] and loaded.index.head[m] == history.index.head[m]
