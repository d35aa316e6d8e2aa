"""HybridProposer (``eagle+suffix``): which side drafts a round, greedy and reproducible identity with plain decoding,
exact sampling (chi-square on the first two tokens, family false-alarm rate 1e-3 per case) with both sides drafting,
and the words that build it."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import LARGE_VOCAB, tiny_llama, word_tokenizer
from test_eagle import WORDS
from test_eagle import head_dir as head_dir  # the fixture: a head trained for tiny_llama(64, seed=10)

import specdecode as sd
from specdecode.exactness import check_exactness
from specdecode.proposers import EagleProposer, HybridProposer, SuffixHistory, SuffixProposer
from specdecode.proposers.base import Draft

GREEDY = sd.SamplingParams(temperature=0.0, max_new_tokens=40)
PROMPTS = [[5, 17, 33, 5, 17, 2, 60, 41], [5, 17, 33, 9], [2, 60, 41, 7, 7]]


class CountingModel:
    """A model proposer that guesses token 1 ``k`` times and records each k it was asked for."""

    def __init__(self) -> None:
        self.asked: list[int] = []

    def propose(self, context, k, params, generator):
        self.asked.append(k)
        return Draft(torch.ones(k, dtype=torch.int64))


def propose(hybrid: HybridProposer, context: list[int], k: int = 8) -> Draft:
    return hybrid.propose(context, k, GREEDY, torch.Generator())


def test_a_long_enough_match_is_copied_and_anything_else_goes_to_the_model_capped_at_its_gamma():
    history = SuffixHistory()
    history.add([7, 8, 9, 10, 11, 12, 13, 14])
    model = CountingModel()
    hybrid = HybridProposer(model, SuffixProposer(history), min_order=3, model_gamma=2)
    assert propose(hybrid, [1, 7, 8, 9]).tokens.tolist() == [10, 11, 12, 13, 14]  # matched 3: copied
    assert model.asked == []
    assert propose(hybrid, [1, 2, 8, 9]).tokens.tolist() == [1, 1]  # matched 2 (< 3): the model, γ 2 of 8
    assert propose(hybrid, [1, 2, 3, 4], k=1).tokens.tolist() == [1]  # no match; k 1 caps the model too
    assert model.asked == [2, 1]
    assert propose(hybrid, [1, 7, 8, 9, 10, 11, 12, 13]).tokens.tolist() == [1, 1]  # only 1 token to copy (< 2)
    assert (hybrid.copied_rounds, hybrid.model_rounds) == (1, 3)


def test_preview_names_the_side_and_length_propose_then_drafts_and_a_short_round_copies_what_fits():
    history = SuffixHistory()
    history.add([7, 8, 9, 10, 11, 12, 13, 14])
    model = CountingModel()
    hybrid = HybridProposer(model, SuffixProposer(history), min_order=3, model_gamma=2)
    cases = [([1, 7, 8, 9], 8, ("copy", 5)), ([1, 2, 8, 9], 8, ("model", 2)), ([1, 7, 8, 9], 1, ("copy", 1))]
    cases.append(([1, 7, 8, 9, 10, 11, 12, 13], 8, ("model", 2)))  # 1 token to copy, fewer than min_copied
    for context, k, expected in cases:
        counts = (hybrid.copied_rounds, hybrid.model_rounds, len(model.asked))
        assert hybrid.preview(context, k) == expected
        assert (hybrid.copied_rounds, hybrid.model_rounds, len(model.asked)) == counts  # a preview drafts nothing
        draft = propose(hybrid, context, k)
        assert (hybrid.last_side, len(draft)) == expected, context
    assert propose(hybrid, [1, 7, 8, 9], k=1).tokens.tolist() == [10]  # k 1 < min_copied: still a copy
    rounds = (hybrid.copied_rounds, hybrid.model_rounds)
    assert len(propose(hybrid, [1, 7, 8, 9], k=0)) == 0 and model.asked[-1] == 0  # a plain step: the model catches up
    assert (hybrid.copied_rounds, hybrid.model_rounds, hybrid.last_side) == (*rounds, "copy")  # and it is no round


def test_a_propose_after_a_preview_keeps_its_side_and_copies_its_first_tokens_without_searching_again():
    history = SuffixHistory()
    history.add([7, 8, 9, 10, 11, 12, 13, 14])
    copier = SuffixProposer(history)
    hybrid = HybridProposer(CountingModel(), copier, min_order=3, model_gamma=2)
    fresh = HybridProposer(CountingModel(), SuffixProposer(history), min_order=3, model_gamma=2)
    searches = []
    search = copier.propose
    copier.propose = lambda *args: searches.append(args[1]) or search(*args)
    context = [1, 7, 8, 9]
    for k in range(1, 6):
        assert hybrid.preview(context, 8) == ("copy", 5)
        searched = len(searches)
        assert propose(hybrid, context, k).tokens.tolist() == [10, 11, 12, 13, 14][:k]
        assert propose(fresh, list(context), k).tokens.tolist() == [10, 11, 12, 13, 14][:k]  # what a search finds
        assert len(searches) == searched and hybrid.last_side == "copy"
    # the side previewed stays: a 1-token copy is the model's round at k 8, and so at k 1, where a fresh call copies
    context = [1, 7, 8, 9, 10, 11, 12, 13]
    assert hybrid.preview(context, 8) == ("model", 2)
    assert propose(hybrid, context, 1).tokens.tolist() == [1] and hybrid.last_side == "model"
    assert propose(fresh, list(context), 1).tokens.tolist() == [14] and fresh.last_side == "copy"
    # another round searches again: the context grew, or k is past the preview's, or the preview was used
    context = [1, 7, 8]
    hybrid.preview(context, 8)
    context.append(9)
    searched = len(searches)
    assert propose(hybrid, context, 3).tokens.tolist() == [10, 11, 12] and len(searches) == searched + 1
    hybrid.preview(context, 2)
    assert propose(hybrid, context, 4).tokens.tolist() == [10, 11, 12, 13] and len(searches) == searched + 3
    assert propose(hybrid, context, 4).tokens.tolist() == [10, 11, 12, 13] and len(searches) == searched + 4


def test_settings_are_validated():
    for bad in ({"min_order": 0}, {"min_copied": 0}, {"model_gamma": 0}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            HybridProposer(CountingModel(), **bad)


def test_gamma_auto_drafts_at_max_gamma_without_a_controller(large_target):
    model = CountingModel()
    hybrid = HybridProposer(model, model_gamma=8)
    decoder = sd.SpeculativeDecoder(large_target, hybrid, gamma="auto", max_gamma=5)
    decoder.generate([3, 4], sd.SamplingParams(max_new_tokens=20))
    assert model.asked and max(model.asked) == 5  # no controller: k = max_gamma (cut only by the token budget)


def repeating_history(target: sd.LoadedModel, prompts: list[list[int]], seed: int) -> SuffixHistory:
    """Earlier answers: each prompt sampled at T = 1, so continuations branch where the history repeats."""
    history = SuffixHistory()
    for i, prompt in enumerate(prompts):
        params = sd.SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed + i)
        history.add(prompt + sd.autoregressive_generate(target, prompt, params).token_ids)
    return history


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_greedy_output_is_plain_decoding_with_both_sides_drafting(large_target, head_dir, gamma):
    history = repeating_history(large_target, PROMPTS * 2, seed=0)
    hybrid = HybridProposer(EagleProposer(large_target, head=head_dir), SuffixProposer(history))
    decoder = sd.SpeculativeDecoder(large_target, hybrid, gamma=gamma)
    accepted = 0
    for prompt in PROMPTS + [[9, 1]]:
        out = decoder.generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(large_target, prompt, GREEDY).token_ids, prompt
        accepted += out.stats.accepted
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0 and accepted > 0


def test_reproducible_sampling_is_plain_sampling(large_target, head_dir):
    history = repeating_history(large_target, PROMPTS * 3, seed=100)
    hybrid = HybridProposer(EagleProposer(large_target, head=head_dir), SuffixProposer(history))
    decoder = sd.SpeculativeDecoder(large_target, hybrid, gamma=4, mode="reproducible")
    for prompt in PROMPTS:
        params = sd.SamplingParams(temperature=1.0, top_k=20, max_new_tokens=32, seed=5)
        assert (
            decoder.generate(prompt, params).token_ids
            == sd.autoregressive_generate(large_target, prompt, params).token_ids
        )
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0


def test_exact_sampling_follows_the_targets_law_with_both_sides_drafting(large_target, head_dir):
    """The prompt occurs in the history followed by 4 different tokens: the first round copies (point masses),
    later rounds copy or ask the head (its sampled law) depending on the token drawn."""
    prompt = [3, 17, 5, 9]
    rng = random.Random(3)
    history = SuffixHistory()
    for _ in range(4):
        history.add([*prompt, *(rng.randrange(LARGE_VOCAB) for _ in range(3))])
    hybrid = HybridProposer(EagleProposer(large_target, head=head_dir), SuffixProposer(history, remember=False))
    report = check_exactness(
        large_target, hybrid, [prompt], sd.SamplingParams(temperature=1.0), samples=600, gamma=2, alpha=1e-3
    )
    assert report.passed, report.verdict
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0 and report.accepted > 0


def test_the_cli_words_build_a_hybrid_and_refuse_what_is_not_one(large_target, head_dir):
    from specdecode.commands import build_proposer
    from specdecode.serving.app import ServerConfig

    hybrid = build_proposer("eagle+suffix", large_target, None, head=str(head_dir))
    assert isinstance(hybrid, HybridProposer) and isinstance(hybrid.model, EagleProposer)
    assert hybrid.needs_target_hidden
    with pytest.raises(ValueError, match="a hybrid is MODEL\\+suffix"):
        build_proposer("eagle+lookup", large_target, None)
    with pytest.raises(ValueError, match="--tree-width applies to the lookup proposer"):
        build_proposer("eagle+suffix", large_target, None, tree_width=2)
    assert ServerConfig(target=large_target, proposer="eagle+suffix", suffix_cache="h.bin").copies
    with pytest.raises(ValueError, match="--heads applies to --proposer medusa"):
        ServerConfig(target=large_target, proposer="eagle+suffix", heads="heads")


def test_bench_runs_the_hybrid_with_plain_output(large_target, head_dir):
    from specdecode.bench.methods import build_methods
    from specdecode.bench.runner import BenchConfig, run_bench
    from specdecode.bench.workloads import WorkItem

    methods = build_methods(large_target, ["eagle+suffix"], [4], transformers=False, head=str(head_dir), tree_nodes=[0])
    assert [m.name for m in methods] == ["ours:plain", "ours:eagle-chain+suffix:g4"]
    items = [WorkItem(1, "writing", (PROMPTS[0], PROMPTS[0])), WorkItem(2, "writing", (PROMPTS[2],))]
    result = run_bench(large_target, items, methods, BenchConfig(max_new_tokens=16))
    assert all(r.identical for r in result.records)


def test_generate_cli_keeps_the_copiers_history_in_the_suffix_cache(large_target, head_dir, tmp_path):
    history_file = tmp_path / "history.bin"
    hybrid = HybridProposer(EagleProposer(large_target, head=head_dir), SuffixProposer())
    decoder = sd.SpeculativeDecoder(large_target, hybrid, gamma=4)
    decoder.generate(PROMPTS[0], GREEDY)
    hybrid.save(history_file)
    assert len(SuffixProposer.load(history_file).history) > len(PROMPTS[0])


@pytest.mark.parametrize("mode", ["reproducible", "exact"])
def test_the_server_serves_the_hybrid_as_plain_decoding_and_keeps_each_sides_books(head_dir, mode):
    """Greedy requests through the scheduler: the first answer goes to the copier's history (global scope), so
    the repeat is mostly copied; the texts are plain decoding's, and the policy learns each side apart."""
    import httpx

    from specdecode.serving import ServerConfig, create_app
    from specdecode.serving.local import LocalServer

    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), tokenizer=word_tokenizer(WORDS), backend="native")
    hybrid = HybridProposer(EagleProposer(target, head=head_dir), SuffixProposer())
    config = ServerConfig(target=target, mode=mode, policy="always", proposers={"eagle+suffix": hybrid.fork})
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[0]]
    with LocalServer(create_app(config)) as running:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "speculative": {"proposer": "eagle+suffix"}}
            answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["text"] == sd.autoregressive_generate(target, prompt, GREEDY).text
        books = running.app.state.server.scheduler._acceptance
    assert {"eagle+suffix:copy", "eagle+suffix:model"} <= set(books)
    copy, model = books["eagle+suffix:copy"], books["eagle+suffix:model"]
    assert len(copy.reached) > 1 and len(model.reached) == 1  # copies ran several deep; the head guesses once
