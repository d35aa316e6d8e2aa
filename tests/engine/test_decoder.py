"""The speculative loop: exact output distribution, greedy identity, round and budget limits, stops, stats.

Distribution tests compare the empirical joint law of the first two generated tokens (vocabulary 16, so
256 cells), and its first-token marginal (16 cells: more power against a skewed first token), with the
target's exact law, enumerated from its logits through the same warps. Each is a chi-square test (cells
with expected count < 5 pooled) at ALPHA = 1e-3 with fixed seeds; there are 6 cases × 2 tests, each run on both
runners (the ``backend`` fixture), so the family false-alarm rate (the chance a correct decoder fails one for freshly
chosen seeds) is ≤ 24 × 1e-3 = 2.4% by Bonferroni. The negative control shows the same test catches a decoder
whose verifier resamples from p instead of the residual.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch
from helpers.laws import chisquare_pvalue, resample_from_target
from helpers.models import LARGE_VOCAB, perturbed, quantizable_llama, with_eos
from helpers.tokenizers import fixed_width_words, word_tokenizer

import specdecode as sd
import specdecode.engine.decoder
from specdecode.sampling.probs import probs_from_logits

ALPHA = 1e-3
SAMPLES = 800  # ~6 s per case; a resample-from-p verifier then scores p < 1e-25
LOOKUP_PROMPT = [7, 4, 1, 7, 4, 1, 7, 4]  # prompt lookup drafts [1, 7]: p(1) ≈ 0.5 at T = 1


class Recorder:
    """Wraps a proposer; records (context length, k, drafted) for every call."""

    def __init__(self, inner):
        self.inner = inner
        self.calls: list[tuple[int, int, int]] = []

    @property
    def model(self):
        return getattr(self.inner, "model", None)

    def propose(self, context, k, params, generator):
        draft = self.inner.propose(context, k, params, generator)
        self.calls.append((len(context), k, len(draft)))
        return draft


def exact_two_token_law(target: sd.LoadedModel, prompt: list[int], params: sd.SamplingParams) -> np.ndarray:
    """P(x1, x2) = p(x1 | prompt) · p(x2 | prompt, x1) under the request's warps, by enumeration."""
    runner = target.new_runner()
    first = probs_from_logits(runner.forward(torch.tensor(prompt))[-1], params).double()
    law = np.zeros((target.vocab_size, target.vocab_size))
    for x1 in range(target.vocab_size):
        runner.rollback_to(len(prompt))
        second = probs_from_logits(runner.forward(torch.tensor([x1]))[-1], params).double()
        law[x1] = (first[x1] * second).numpy()
    return law


def sample_pairs(decoder: sd.SpeculativeDecoder, prompt: list[int], params: sd.SamplingParams, seed0: int):
    """Counts of the first two tokens over SAMPLES requests (seeds seed0, seed0+1, ...) and summed stats."""
    vocab = decoder.target.vocab_size
    counts = np.zeros((vocab, vocab))
    stats = sd.DecodeStats()
    for i in range(SAMPLES):
        # max_new_tokens = 3 lets the first round draft 2 tokens (k ≤ max_new_tokens − 1)
        out = decoder.generate(prompt, dataclasses.replace(params, seed=seed0 + i))
        counts[out.token_ids[0], out.token_ids[1]] += 1
        stats = stats.merge(out.stats)
    return counts, stats


WARPS = {
    "T1": sd.SamplingParams(temperature=1.0, max_new_tokens=3),
    "T0.8-topk4": sd.SamplingParams(temperature=0.8, top_k=4, max_new_tokens=3),
    "T0.7-topp0.8": sd.SamplingParams(temperature=0.7, top_p=0.8, max_new_tokens=3),
}


@pytest.mark.parametrize("proposer_kind", ["draft", "lookup"])
@pytest.mark.parametrize("warp", list(WARPS))
def test_first_two_tokens_follow_the_target_exactly(small_target, small_draft, proposer_kind, warp):
    params = WARPS[warp]
    proposer = sd.DraftModelProposer(small_draft) if proposer_kind == "draft" else sd.PromptLookupProposer()
    decoder = sd.SpeculativeDecoder(small_target, proposer, gamma=4)
    counts, stats = sample_pairs(decoder, LOOKUP_PROMPT, params, seed0=1000)
    # both the accept and the reject path ran many times
    assert stats.drafted > SAMPLES and stats.accepted > SAMPLES / 10 and stats.rejections > SAMPLES / 10
    assert len(stats.per_position) == 2
    law = exact_two_token_law(small_target, LOOKUP_PROMPT, params)
    if params.top_k or params.top_p < 1:
        assert (law.sum(1) == 0).sum() >= 4  # the warp removes first tokens: it is being tested
    assert chisquare_pvalue(counts, law) > ALPHA
    assert chisquare_pvalue(counts.sum(1), law.sum(1)) > ALPHA


def test_negative_control_a_wrong_verifier_is_caught(small_target, small_draft, monkeypatch):
    monkeypatch.setattr(specdecode.engine.decoder, "speculative_sample", resample_from_target)
    params = WARPS["T1"]
    decoder = sd.SpeculativeDecoder(small_target, sd.DraftModelProposer(small_draft), gamma=4)
    counts, _ = sample_pairs(decoder, LOOKUP_PROMPT, params, seed0=1000)
    assert chisquare_pvalue(counts, exact_two_token_law(small_target, LOOKUP_PROMPT, params)) < ALPHA


# ---------------------------------------------------------------------------------------- greedy identity

IDENTITY_PROMPT = [5, 17, 33, 5, 17, 2, 60, 41]
GREEDY_40 = sd.SamplingParams(temperature=0.0, max_new_tokens=40)


@pytest.fixture(scope="module")
def plain_greedy(large_target):
    return sd.autoregressive_generate(large_target, IDENTITY_PROMPT, GREEDY_40).token_ids


PROPOSERS = {
    "draft": lambda target, draft: sd.DraftModelProposer(draft),
    "lookup": lambda target, draft: sd.PromptLookupProposer(),
    "layer-skip": lambda target, draft: sd.LayerSkipProposer(target, 1),
}


@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
@pytest.mark.parametrize("kind", list(PROPOSERS))
def test_greedy_output_is_identical_to_plain_decoding(large_target, large_draft, plain_greedy, kind, gamma):
    decoder = sd.SpeculativeDecoder(large_target, PROPOSERS[kind](large_target, large_draft), gamma=gamma)
    out = decoder.generate(IDENTITY_PROMPT, GREEDY_40)
    assert out.token_ids == plain_greedy
    assert out.finish_reason == "length"
    assert out.stats.drafted > 0 and out.stats.accepted > 0
    assert out.stats.rounds < 40
    again = decoder.generate(IDENTITY_PROMPT, GREEDY_40)  # the decoder and its proposer are reusable
    assert again.token_ids == plain_greedy


@pytest.mark.parametrize(("dtype", "quantization"), [("bfloat16", None), ("float32", "int8"), ("float32", "int4")])
def test_greedy_identity_on_every_weight_format(dtype, quantization):
    """Row invariance carries greedy identity to bfloat16 and quantized weights, where rounding is coarse."""
    model = quantizable_llama(LARGE_VOCAB, seed=11)
    target = sd.load_model(model, dtype=dtype, quantization=quantization)
    draft = sd.load_model(perturbed(model, seed=12, noise=0.3), dtype=dtype, quantization=quantization)
    prompts = (IDENTITY_PROMPT, [9, 9, 9, 9, 9, 9], [3])
    for prompt in prompts:
        plain = sd.autoregressive_generate(target, prompt, GREEDY_40).token_ids
        for proposer in (sd.DraftModelProposer(draft), sd.PromptLookupProposer(), sd.LayerSkipProposer(target, 1)):
            for gamma in (3, 8, "auto"):
                out = sd.SpeculativeDecoder(target, proposer, gamma=gamma).generate(prompt, GREEDY_40)
                assert out.token_ids == plain, (type(proposer).__name__, gamma, prompt)


def test_greedy_identity_across_requests_and_a_one_token_prompt(large_target, large_draft):
    for kind in PROPOSERS:
        decoder = sd.SpeculativeDecoder(large_target, PROPOSERS[kind](large_target, large_draft), gamma=3)
        for prompt in ([9], IDENTITY_PROMPT[:5], [9, 9, 9, 9], IDENTITY_PROMPT, [9]):
            plain = sd.autoregressive_generate(large_target, prompt, GREEDY_40)
            assert decoder.generate(prompt, GREEDY_40).token_ids == plain.token_ids, (kind, prompt)


def test_greedy_identity_exercises_partial_acceptance(large_target, large_draft):
    decoder = sd.SpeculativeDecoder(large_target, sd.DraftModelProposer(large_draft), gamma=4)
    stats = decoder.generate(IDENTITY_PROMPT, GREEDY_40).stats
    assert 0 < stats.accepted < stats.drafted and stats.rejections > 0
    assert any(0 < a < r for a, r in zip(stats.per_position, stats.per_position_reached, strict=True))


def test_plain_decoding_is_the_targets_argmax_chain(large_target):
    out = sd.autoregressive_generate(large_target, IDENTITY_PROMPT, sd.SamplingParams(max_new_tokens=6))
    context = list(IDENTITY_PROMPT)
    with torch.no_grad():
        for _ in range(6):
            context.append(int(large_target.model(torch.tensor([context])).logits[0, -1].argmax()))
    assert out.token_ids == context[len(IDENTITY_PROMPT) :]
    assert out.stats.rounds == 6 and out.stats.drafted == 0


# ------------------------------------------------------------------------- rounds, budget, draft == target


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("gamma", [1, 3, 4])
def test_draft_equal_to_target_accepts_everything(large_target, temperature, gamma):
    recorder = Recorder(sd.DraftModelProposer(large_target))
    decoder = sd.SpeculativeDecoder(large_target, recorder, gamma=gamma)
    params = sd.SamplingParams(temperature=temperature, max_new_tokens=23, seed=3)
    out = decoder.generate(IDENTITY_PROMPT, params)
    stats = out.stats
    assert stats.acceptance_rate == 1.0 and stats.alpha == 1.0 and stats.rejections == 0
    assert stats.generated == len(out.token_ids) == 23
    assert stats.rounds == math.ceil(23 / (gamma + 1))  # gamma + 1 tokens per round, the last one cut short
    lengths = [n for n, _, _ in recorder.calls] + [len(IDENTITY_PROMPT) + 23]
    assert [b - a for a, b in zip(lengths, lengths[1:], strict=False)][:-1] == [gamma + 1] * (stats.rounds - 1)


@pytest.mark.parametrize("max_new_tokens", [1, 2, 5, 7, 10, 11])
@pytest.mark.parametrize("gamma", [1, 4, 8])
def test_never_drafts_past_the_budget_nor_more_than_gamma(large_target, large_draft, max_new_tokens, gamma):
    for proposer in (sd.DraftModelProposer(large_target), sd.DraftModelProposer(large_draft)):
        recorder = Recorder(proposer)
        decoder = sd.SpeculativeDecoder(large_target, recorder, gamma=gamma)
        out = decoder.generate(
            IDENTITY_PROMPT, sd.SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=gamma)
        )
        assert len(out.token_ids) == max_new_tokens
        prompt = len(IDENTITY_PROMPT)
        ends = [n for n, _, _ in recorder.calls[1:]] + [prompt + max_new_tokens]
        for (length, k, drafted), end in zip(recorder.calls, ends, strict=True):
            generated = length - prompt
            assert k == min(gamma, max_new_tokens - generated - 1)
            assert drafted == k  # a draft model always fills its k
            assert 1 <= end - length <= drafted + 1  # at most gamma + 1 tokens per round
        assert out.stats.rounds == len(recorder.calls)
        assert out.stats.drafted == sum(d for _, _, d in recorder.calls)
        assert len(out.stats.per_position) <= gamma


# ---------------------------------------------------------------------------------------------- stopping


def rounds_of(calls: list[tuple[int, int, int]], prompt: int, total: int) -> list[tuple[int, int]]:
    """(first, end) generated-token index range of every round."""
    starts = [n - prompt for n, _, _ in calls] + [total]
    return list(zip(starts, starts[1:], strict=False))


def test_eos_inside_an_accepted_run_stops_exactly_there(large_target):
    plain = sd.autoregressive_generate(large_target, IDENTITY_PROMPT, GREEDY_40).token_ids
    # with draft == target every round accepts gamma = 4 tokens and adds a bonus: pick EOS ids whose first
    # occurrence is an accepted token strictly inside a round (not the last of the round)
    firsts = {}
    for i, token in enumerate(plain):
        firsts.setdefault(token, i)
    inside = [(i, t) for t, i in firsts.items() if i % 5 not in (0, 4) and i < 35]
    assert inside, "the greedy output has no fresh token in the middle of a round"
    for i, eos in inside[:4]:
        target = with_eos(large_target, eos)
        recorder = Recorder(sd.DraftModelProposer(target))
        out = sd.SpeculativeDecoder(target, recorder, gamma=4).generate(IDENTITY_PROMPT, GREEDY_40)
        assert out.token_ids == plain[: i + 1]
        assert out.finish_reason == "eos" and out.stats.generated == i + 1
        (start, end) = rounds_of(recorder.calls, len(IDENTITY_PROMPT), 40)[-1]
        assert start < i < start + 4  # the EOS was an accepted draft token with more drafted after it
        assert sd.autoregressive_generate(target, IDENTITY_PROMPT, GREEDY_40).token_ids == plain[: i + 1]


@pytest.mark.parametrize("kind", ["draft", "lookup"])
def test_eos_while_sampling_cuts_the_same_random_output(small_target, small_draft, kind):
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=30, seed=7)
    proposer = sd.DraftModelProposer(small_draft) if kind == "draft" else sd.PromptLookupProposer()
    full = sd.SpeculativeDecoder(small_target, proposer, gamma=4).generate(LOOKUP_PROMPT, params).token_ids
    firsts = {}
    for i, token in enumerate(full):
        firsts.setdefault(token, i)
    for token, i in firsts.items():
        target = with_eos(small_target, token)
        proposer = sd.DraftModelProposer(small_draft) if kind == "draft" else sd.PromptLookupProposer()
        out = sd.SpeculativeDecoder(target, proposer, gamma=4).generate(LOOKUP_PROMPT, params)
        assert out.token_ids == full[: i + 1] and out.finish_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", range(1, 11))
def test_max_new_tokens_gives_exactly_that_many_tokens(large_target, large_draft, max_new_tokens):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens)
    plain = sd.autoregressive_generate(large_target, IDENTITY_PROMPT, params)
    assert len(plain.token_ids) == max_new_tokens
    for proposer in (
        sd.DraftModelProposer(large_target),
        sd.DraftModelProposer(large_draft),
        sd.PromptLookupProposer(),
    ):
        out = sd.SpeculativeDecoder(large_target, proposer, gamma=4).generate(IDENTITY_PROMPT, params)
        assert out.token_ids == plain.token_ids and out.finish_reason == "length"
    sampled = sd.SpeculativeDecoder(large_target, sd.DraftModelProposer(large_target), gamma=4).generate(
        IDENTITY_PROMPT, sd.SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=1)
    )
    assert len(sampled.token_ids) == sampled.stats.generated == max_new_tokens


@pytest.fixture(scope="module")
def worded_target(large_target):
    """The large target with a word-level tokenizer: id i is the word 'wNN' (fixed width, no false matches)."""
    return sd.load_model(large_target.model, tokenizer=word_tokenizer(fixed_width_words(large_target.vocab_size)))


def test_stop_string_spanning_tokens_inside_an_accepted_run(worded_target):
    plain = sd.autoregressive_generate(worded_target, IDENTITY_PROMPT, GREEDY_40)
    words = plain.text.split(" ")
    assert len(words) == 40
    for i in (2, 6, 13):  # tokens i-1, i are accepted draft tokens inside a round of draft == target
        stop = f"{words[i - 1][1:]} {words[i][:2]}"  # e.g. "17 w3": spans two tokens
        first = next(n for n in range(1, 41) if stop in plain.text[: 4 * n - 1])
        params = sd.SamplingParams(max_new_tokens=40, stop=(stop,))
        decoder = sd.SpeculativeDecoder(worded_target, sd.DraftModelProposer(worded_target), gamma=4)
        for out in (
            decoder.generate(IDENTITY_PROMPT, params),
            sd.autoregressive_generate(worded_target, IDENTITY_PROMPT, params),
        ):
            assert out.finish_reason == "stop"
            assert out.token_ids == plain.token_ids[:first]
            assert out.text == plain.text[: plain.text.index(stop)]


def test_streamed_text_equals_the_final_text(worded_target):
    text = sd.autoregressive_generate(worded_target, IDENTITY_PROMPT, GREEDY_40).text
    words = text.split(" ")
    stop = f"{words[20]} {words[21]}"
    params = sd.SamplingParams(max_new_tokens=40, stop=(stop,))
    pieces: list[str] = []
    decoder = sd.SpeculativeDecoder(worded_target, sd.DraftModelProposer(worded_target), gamma=3)
    out = decoder.generate(IDENTITY_PROMPT, params, on_text=pieces.append)
    assert "".join(pieces) == out.text == text[: text.index(stop)]
    assert len(pieces) > 1
    assert "".join(decoder.stream(IDENTITY_PROMPT, params)) == out.text


# ----------------------------------------------------------------------------------------- padded vocab


def test_padded_vocabulary_ids_are_never_emitted(small_target):
    """Config vocab 16, tokenizer 12: logit columns 12..15 exist but must never be sampled."""
    model = small_target.model
    padded = sd.load_model(model, tokenizer=word_tokenizer(fixed_width_words(12)))
    assert padded.vocab_size == 12 and model.config.vocab_size == 16
    with torch.no_grad():
        raw = model(torch.tensor([LOOKUP_PROMPT])).logits[0]
    assert (raw.argmax(-1) >= 12).any(), "the padded rows never win: the test would prove nothing"
    runner = padded.new_runner()
    assert runner.forward(torch.tensor(LOOKUP_PROMPT)).shape == (len(LOOKUP_PROMPT), 12)
    decoder = sd.SpeculativeDecoder(padded, sd.DraftModelProposer(padded), gamma=3)
    for temperature in (0.0, 1.0, 5.0):
        params = sd.SamplingParams(temperature=temperature, max_new_tokens=40, seed=0)
        for out in (decoder.generate(LOOKUP_PROMPT, params), sd.autoregressive_generate(padded, LOOKUP_PROMPT, params)):
            assert max(out.token_ids) < 12


# ---------------------------------------------------------------------------------------- stats and seeds


@pytest.mark.parametrize("kind", ["draft", "lookup", "layer-skip"])
def test_stats_invariants(large_target, large_draft, kind):
    recorder = Recorder(PROPOSERS[kind](large_target, large_draft))
    decoder = sd.SpeculativeDecoder(large_target, recorder, gamma=4)
    for seed in range(3):
        recorder.calls.clear()
        out = decoder.generate(IDENTITY_PROMPT, sd.SamplingParams(temperature=1.0, max_new_tokens=30, seed=seed))
        s = out.stats
        assert s.generated == len(out.token_ids) == 30
        assert s.rounds == len(recorder.calls)
        assert s.drafted == sum(d for _, _, d in recorder.calls)
        assert sum(s.per_position) == s.accepted <= s.drafted
        if s.per_position_reached:
            assert s.per_position_reached[0] == sum(1 for _, _, d in recorder.calls if d)
        assert s.rejections <= s.rounds
        assert s.alpha >= s.acceptance_rate
        assert s.generated == s.accepted + s.rounds  # each round: accepted tokens + one recovered/bonus
        assert s.tokens_per_round == pytest.approx(s.generated / s.rounds)
        assert all(0 <= r <= 1 for r in s.per_position_rate)


def test_seed_is_reported_and_replays(small_target, small_draft):
    decoder = sd.SpeculativeDecoder(small_target, sd.DraftModelProposer(small_draft), gamma=3)
    params = sd.SamplingParams(temperature=1.0, max_new_tokens=20)
    outs = [decoder.generate(LOOKUP_PROMPT, params) for _ in range(2)]
    assert all(isinstance(o.seed, int) and 0 <= o.seed < 2**63 for o in outs)
    assert outs[0].seed != outs[1].seed
    for out in outs:
        replay = sd.SamplingParams(temperature=1.0, max_new_tokens=20, seed=out.seed)
        assert decoder.generate(LOOKUP_PROMPT, replay).token_ids == out.token_ids
    plain = sd.autoregressive_generate(small_target, LOOKUP_PROMPT, params)
    replay = sd.SamplingParams(temperature=1.0, max_new_tokens=20, seed=plain.seed)
    assert sd.autoregressive_generate(small_target, LOOKUP_PROMPT, replay).token_ids == plain.token_ids


def test_same_seed_same_output_across_decoders(small_target, small_draft):
    params = sd.SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=25, seed=12345)
    runs = [
        sd.SpeculativeDecoder(small_target, sd.DraftModelProposer(small_draft), gamma=4).generate(LOOKUP_PROMPT, params)
        for _ in range(2)
    ]
    assert runs[0].token_ids == runs[1].token_ids and runs[0].seed == 12345
    other = sd.SamplingParams(temperature=0.9, top_p=0.9, max_new_tokens=25, seed=12346)
    decoder = sd.SpeculativeDecoder(small_target, sd.DraftModelProposer(small_draft), gamma=4)
    assert decoder.generate(LOOKUP_PROMPT, other).token_ids != runs[0].token_ids


def test_a_proposer_returning_too_many_tokens_is_cut_to_k(small_target):
    """A misbehaving proposer (ignores k) cannot push a round past gamma or the token budget."""

    class Greedy:
        def propose(self, context, k, params, generator):
            return sd.Draft(torch.zeros(k + 5, dtype=torch.int64))

    decoder = sd.SpeculativeDecoder(small_target, Greedy(), gamma=2)
    out = decoder.generate([1, 2, 3], sd.SamplingParams(max_new_tokens=7))
    assert len(out.token_ids) == 7
    assert out.stats.drafted <= 2 * out.stats.rounds


def test_last_output_is_none_until_a_stream_ends_and_generate_leaves_it(large_target):
    decoder = sd.SpeculativeDecoder(large_target, sd.SuffixProposer(), gamma=2)
    assert decoder.last_output is None
    params = sd.SamplingParams(max_new_tokens=6)
    list(decoder.stream([3, 4, 5], params))
    streamed = decoder.last_output
    assert streamed is not None and len(streamed.token_ids) == 6
    decoder.generate([3, 4, 5], params)
    assert decoder.last_output is streamed
