"""HybridProposer (``eagle+suffix``): which side drafts a round, greedy and reproducible identity with plain decoding,
exact sampling (chi-square on the first two tokens, family false-alarm rate 1e-3 per case) with both sides drafting,
and the words that build it."""

from __future__ import annotations

import random

import pytest
import torch
from helpers.enumeration import LAW_BOUND, LAW_PROMPT, enumerated_tv
from helpers.fixtures import head_dir as head_dir
from helpers.fixtures import skip_target as skip_target
from helpers.models import LARGE_VOCAB, word_target

import specdecode as sd
from specdecode.control import HybridGamma, PassCosts
from specdecode.exactness.check import check_exactness
from specdecode.factory import lookup_hybrid
from specdecode.proposers import EagleProposer, HybridProposer, PromptLookupProposer, SuffixHistory, SuffixProposer
from specdecode.sampling.draft import Draft

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


class ScriptedSides:
    """A two-sided proposer for ``HybridGamma``: ``preview`` offers the sides of ``script`` in turn."""

    copier_sizes_its_drafts = False

    def __init__(self, script: list[tuple[str, int]]) -> None:
        self.script, self.turn, self.last_side = script, 0, None

    def preview(self, context, k):
        side, offered = self.script[self.turn % len(self.script)]
        self.turn += 1
        return side, min(k, offered)


def two_sided_rounds(
    copy_rate: float, model_rate: float, rounds: int = 400, sized: bool = False
) -> dict[str, list[int]]:
    """γ auto over a proposer offering a 6-token copy and a 1-guess model round in turn (copies accepted at
    ``copy_rate`` a position, the model's guess at ``model_rate``; deterministic patterns), costs fixed: v(k) =
    1 + 0.05 (k - 1), a copied token 0.01 of a step, a model guess 0.3; ``sized``: the copier sizes its own
    drafts. The γ chosen for each side's rounds."""
    proposer = ScriptedSides([("copy", 6), ("model", 1)])
    proposer.copier_sizes_its_drafts = sized
    costs = PassCosts.line(1.0, 0.05, {"copy": 0.01, "model": 0.3})
    controller = HybridGamma.for_request(proposer, [], 8, costs, {})
    chosen: dict[str, list[int]] = {"copy": [], "model": []}
    for i in range(rounds):
        gamma = controller.choose()
        side = proposer.script[(proposer.turn - 1) % 2][0]
        chosen[side].append(gamma)
        rate = copy_rate if side == "copy" else model_rate
        accepted = 0
        while accepted < gamma and (i * 7 + accepted * 3) % 10 < 10 * rate:
            accepted += 1
        proposer.last_side = side if gamma else proposer.last_side
        controller.observe(gamma, accepted)
    return chosen


def test_gamma_auto_gives_each_side_its_own_length_from_its_own_acceptance_and_price():
    chosen = two_sided_rounds(copy_rate=0.9, model_rate=0.1)
    assert max(chosen["copy"]) == 6 and sum(g >= 4 for g in chosen["copy"][20:]) >= 150  # long copies go on ...
    assert sum(g > 0 for g in chosen["model"][40:]) <= 16  # ... while a head that does not pay rests (rare probes)
    # the control: the same controller drafts the head's guess where it pays (1.6 / 1.35 steps)
    assert sum(g > 0 for g in two_sided_rounds(copy_rate=0.9, model_rate=0.6)["model"][40:]) >= 150


def test_a_copier_that_sizes_its_own_drafts_is_taken_as_offered():
    """Suffix decoding sizes a copy by its match and the measured v(k); prompt lookup copies k tokens, so only its
    copies are cut where they are rarely accepted."""
    assert set(two_sided_rounds(copy_rate=0.2, model_rate=0.6, sized=True)["copy"]) == {6}
    cut = two_sided_rounds(copy_rate=0.2, model_rate=0.6)["copy"]
    assert sum(g < 6 for g in cut[20:]) >= 150


def test_a_side_round_after_another_sides_round_is_no_drafting_price():
    proposer = ScriptedSides([("copy", 4), ("model", 1), ("model", 1), ("copy", 4), ("copy", 4)])
    controller = HybridGamma.for_request(proposer, [], 8, PassCosts.line(1.0, 0.05, {}), {})
    seen = []
    for _ in range(5):
        gamma = controller.choose()
        proposer.last_side = proposer.script[(proposer.turn - 1) % 5][0]
        controller.observe(gamma, 0)
        seen.append((controller.drafter, controller.catching_up))
    # the model catches up on the copied tokens before its first guess; the copier after the model's rounds
    assert seen == [("copy", True), ("model", True), ("model", False), ("copy", True), ("copy", False)]
    controller.choose()
    controller.observe(0, 0)  # a plain round: no side drafted, and the next drafting round catches up
    assert (controller.drafter, controller.catching_up) == ("", True)


def test_gamma_auto_in_the_engine_rests_a_useless_model_and_still_copies(large_target):
    model = CountingModel()  # guesses token 1: almost never the target's
    hybrid = HybridProposer(model, model_gamma=8)
    decoder = sd.SpeculativeDecoder(large_target, hybrid, gamma="auto", max_gamma=5)
    decoder.costs = PassCosts.line(1.0, 0.05, {"copy": 0.0, "model": 0.1})
    prompt, params = [3, 4, 5, 3, 4, 5, 3, 4], sd.SamplingParams(max_new_tokens=120)
    out = decoder.generate(prompt, params)
    assert out.token_ids == sd.autoregressive_generate(large_target, prompt, params).token_ids
    assert max(model.asked) <= 5  # the side's own cap, max_gamma, and nothing past it
    drafted = [k for k in model.asked if k > 0]
    assert 0 < len(drafted) <= 20 and model.asked.count(0) > 40  # a few tries, then plain steps (it still catches up)
    assert hybrid.copied_rounds > 0


def repeating_history(target: sd.LoadedModel, prompts: list[list[int]], seed: int) -> SuffixHistory:
    """Earlier answers: each prompt sampled at T = 1, so continuations branch where the history repeats."""
    history = SuffixHistory()
    for i, prompt in enumerate(prompts):
        params = sd.SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed + i)
        history.add(prompt + sd.autoregressive_generate(target, prompt, params).token_ids)
    return history


def assert_plain_greedy(target: sd.LoadedModel, hybrid: HybridProposer, prompts, gamma) -> None:
    """Greedy output through ``hybrid`` is plain decoding's for every prompt, and both sides drafted accepted tokens."""
    decoder = sd.SpeculativeDecoder(target, hybrid, gamma=gamma)
    accepted = 0
    for prompt in prompts:
        out = decoder.generate(prompt, GREEDY)
        assert out.token_ids == sd.autoregressive_generate(target, prompt, GREEDY).token_ids, prompt
        accepted += out.stats.accepted
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0 and accepted > 0


def assert_plain_sampling(target: sd.LoadedModel, hybrid: HybridProposer, prompts, gamma) -> None:
    """Reproducible-mode sampling through ``hybrid`` is plain sampling's, token for token, with both sides drafting."""
    decoder = sd.SpeculativeDecoder(target, hybrid, gamma=gamma, mode="reproducible")
    for prompt in prompts:
        params = sd.SamplingParams(temperature=1.0, top_k=20, max_new_tokens=32, seed=5)
        assert (
            decoder.generate(prompt, params).token_ids == sd.autoregressive_generate(target, prompt, params).token_ids
        )
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_greedy_output_is_plain_decoding_with_both_sides_drafting(large_target, head_dir, gamma):
    history = repeating_history(large_target, PROMPTS * 2, seed=0)
    hybrid = HybridProposer(EagleProposer(large_target, head=head_dir), SuffixProposer(history))
    assert_plain_greedy(large_target, hybrid, PROMPTS + [[9, 1]], gamma)


def test_reproducible_sampling_is_plain_sampling(large_target, head_dir):
    history = repeating_history(large_target, PROMPTS * 3, seed=100)
    hybrid = HybridProposer(EagleProposer(large_target, head=head_dir), SuffixProposer(history))
    assert_plain_sampling(large_target, hybrid, PROMPTS, 4)


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


LOOKUP_PROMPTS = [[5, 17, 33, 5, 17, 2, 60, 41, 5, 17], [2, 60, 41, 7, 2, 60, 9], [9, 1]]


@pytest.mark.parametrize("gamma", [4, "auto"])
def test_eagle_lookup_greedy_output_is_plain_decoding_with_both_sides_drafting(large_target, head_dir, gamma):
    hybrid = lookup_hybrid(EagleProposer(large_target, head=head_dir))
    assert_plain_greedy(large_target, hybrid, LOOKUP_PROMPTS, gamma)


def test_eagle_lookup_reproducible_sampling_is_plain_sampling(large_target, head_dir):
    hybrid = lookup_hybrid(EagleProposer(large_target, head=head_dir))
    assert_plain_sampling(large_target, hybrid, LOOKUP_PROMPTS, "auto")


def test_eagle_lookup_exact_sampling_follows_the_targets_law_with_both_sides_drafting(large_target, head_dir):
    """The prompt ends with a 2-gram seen twice before: the first round copies what followed its latest occurrence;
    later rounds copy or ask the head depending on the tokens drawn."""
    prompt = [3, 17, 5, 40, 3, 17, 9, 3, 17]
    hybrid = lookup_hybrid(EagleProposer(large_target, head=head_dir))
    report = check_exactness(
        large_target, hybrid, [prompt], sd.SamplingParams(temperature=1.0), samples=600, gamma=2, alpha=1e-3
    )
    assert report.passed, report.verdict
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0 and report.accepted > 0


def test_the_cli_words_build_a_hybrid_and_refuse_what_is_not_one(large_target, head_dir):
    from specdecode.factory import build_proposer
    from specdecode.serving.config import ServerConfig

    hybrid = build_proposer("eagle+suffix", large_target, None, head=str(head_dir))
    assert isinstance(hybrid, HybridProposer) and isinstance(hybrid.model, EagleProposer)
    assert hybrid.needs_target_hidden
    with pytest.raises(ValueError, match="a hybrid is MODEL\\+suffix or MODEL\\+lookup"):
        build_proposer("eagle+copy", large_target, None)
    looker = build_proposer("eagle+lookup", large_target, None, head=str(head_dir))
    assert isinstance(looker.copier, PromptLookupProposer) and (looker.min_order, looker.min_copied) == (2, 1)
    with pytest.raises(ValueError, match="--suffix-cache applies to the suffix proposer"):
        build_proposer("eagle+lookup", large_target, None, head=str(head_dir), suffix_cache="h.bin")
    assert not ServerConfig(target=large_target, proposer="eagle+lookup").copies
    with pytest.raises(ValueError, match="--tree-width applies to the lookup proposer"):
        build_proposer("eagle+suffix", large_target, None, tree_width=2)
    assert ServerConfig(target=large_target, proposer="eagle+suffix", suffix_cache="h.bin").copies
    with pytest.raises(ValueError, match="--heads applies to --proposer medusa"):
        ServerConfig(target=large_target, proposer="eagle+suffix", heads="heads")


def test_bench_runs_the_hybrid_with_plain_output(large_target, head_dir):
    from specdecode.bench.methods import build_methods
    from specdecode.bench.runner import BenchConfig, run_bench
    from specdecode.bench.workloads import WorkItem

    methods = build_methods(
        large_target, ["eagle+suffix", "eagle+lookup"], [4], transformers=False, head=str(head_dir), tree_nodes=[0]
    )
    assert [m.name for m in methods] == ["ours:plain", "ours:eagle-chain+suffix:g4", "ours:eagle-chain+lookup:g4"]
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


def _served_books(target, name: str, hybrid, prompts: list[str], mode: str = "reproducible") -> dict:
    """Serve greedy completions with ``hybrid`` under ``name`` (policy always): each text is plain decoding's;
    returns the scheduler's acceptance books."""
    import httpx

    from specdecode.serving import ServerConfig, create_app
    from specdecode.serving.local import LocalServer

    config = ServerConfig(target=target, mode=mode, policy="always", proposers={name: hybrid.fork})
    with LocalServer(create_app(config)) as running:
        for prompt in prompts:
            body = {"prompt": prompt, "max_tokens": 40, "temperature": 0, "speculative": {"proposer": name}}
            answer = httpx.post(f"{running.url}/v1/completions", json=body, timeout=60).json()
            assert answer["choices"][0]["text"] == sd.autoregressive_generate(target, prompt, GREEDY).text
        return running.app.state.server.scheduler._acceptance


def test_the_server_serves_eagle_lookup_as_plain_decoding(head_dir):
    target = word_target(backend="native")
    books = _served_books(target, "eagle+lookup", lookup_hybrid(EagleProposer(target, head=head_dir)), LOOKUP_PROMPTS)
    assert {"eagle+lookup:copy", "eagle+lookup:model"} <= set(books)


@pytest.mark.parametrize("mode", ["reproducible", "exact"])
def test_the_server_serves_the_hybrid_as_plain_decoding_and_keeps_each_sides_books(head_dir, mode):
    """Greedy requests through the scheduler: the first answer goes to the copier's history (global scope), so
    the repeat is mostly copied; the texts are plain decoding's, and the policy learns each side apart."""
    target = word_target(backend="native")
    hybrid = HybridProposer(EagleProposer(target, head=head_dir), SuffixProposer())
    books = _served_books(target, "eagle+suffix", hybrid, [PROMPTS[0], PROMPTS[2], PROMPTS[0]], mode)
    assert {"eagle+suffix:copy", "eagle+suffix:model"} <= set(books)
    copy, model = books["eagle+suffix:copy"], books["eagle+suffix:model"]
    assert len(copy.reached) > 1 and len(model.reached) == 1  # copies ran several deep; the head guesses once


# ------------------------------------------------------------------------------------------------ exact laws


def copier_of(name: str, target: sd.LoadedModel):
    """Prompt lookup (``lookup_hybrid``'s) or suffix decoding over two of the target's own one-token continuations
    of the prompt (short, so that some contexts have no match and the model drafts; not remembering the runs)."""
    if name == "lookup":
        return PromptLookupProposer()
    history = SuffixHistory()
    for seed in range(2):
        params = sd.SamplingParams(temperature=1.0, top_k=2, max_new_tokens=1, seed=seed)
        history.add([*LAW_PROMPT, *sd.autoregressive_generate(target, LAW_PROMPT, params).token_ids])
    return SuffixProposer(history, remember=False)


@pytest.mark.parametrize("control", [False, True], ids=["exact", "residual-mixed-1%-build-control"])
@pytest.mark.parametrize("copier", ["lookup", "suffix"])
def test_hybrid_laws_are_the_targets_exactly(skip_target, copier, control, monkeypatch):
    """Proves a hybrid — copied point masses or a layer-skip model's sampled guesses, the side chosen per round
    from the context — keeps the engine's law of the first two tokens the target's to 1e-6 (γ 3, T 1, top-k 2),
    enumerated through the compiled ops, with both sides drafting across the runs. Control: the kernels built with
    1% of p mixed into the residual must miss by ≥ 100× the bound."""
    model = sd.LayerSkipProposer(skip_target, skip=[1])
    hybrid = HybridProposer(model, copier_of(copier, skip_target), min_order=2, min_copied=1)
    decoder = sd.SpeculativeDecoder(skip_target, hybrid, gamma=3)
    tv, result = enumerated_tv(decoder, "mutant_residual" if control else "native", monkeypatch)
    assert hybrid.copied_rounds > 0 and hybrid.model_rounds > 0, (hybrid.copied_rounds, hybrid.model_rounds)
    if control:
        assert tv > 100 * LAW_BOUND, tv
    else:
        assert tv < LAW_BOUND, (copier, tv, result.runs)
        assert result.accepted_mass > 0.5, result
