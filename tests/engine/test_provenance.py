"""Each token's source, text piece and logprobs: the sources agree with the round counters, the pieces concatenate
to the decoded text (multi-byte characters split across tokens included), and the logprobs are the target's own
log-softmax, bitwise the same with and without speculation (greedy, every weight format, chains and trees)."""

from __future__ import annotations

import pytest
import torch
from helpers.models import LARGE_VOCAB, perturbed, quantizable_llama, tiny_llama, with_eos
from tokenizers import ByteLevelBPETokenizer
from transformers import PreTrainedTokenizerFast

import specdecode as sd
from specdecode.engine.provenance import Detokenizer, TokenSource, round_sources, token_logprobs

PROMPT = [5, 9, 3, 5, 9, 3, 5, 9, 1, 2]
GREEDY = sd.SamplingParams(max_new_tokens=40)


def test_a_rounds_sources_are_its_accepted_guesses_then_the_targets_token():
    assert round_sources(2, True, True) == [TokenSource("accepted", 1), TokenSource("accepted", 2),
                                             TokenSource("recovered", 3)]  # fmt: skip
    assert round_sources(3, True, False)[-1] == TokenSource("bonus", 4)
    assert round_sources(0, False, False) == [TokenSource("plain", 1)]
    assert [s.source for s in round_sources(1, True, True)] == ["draft", "target"]


@pytest.fixture(scope="module")
def target() -> sd.LoadedModel:
    return sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), backend="native")


@pytest.mark.parametrize("proposer", ["draft", "lookup-tree"])
def test_sources_agree_with_the_round_counters(target, proposer):
    make = {
        "draft": lambda: sd.DraftModelProposer(sd.load_model(perturbed(target.model, seed=11, noise=0.06))),
        "lookup-tree": lambda: sd.PromptLookupProposer(branches=3),
    }[proposer]
    out = sd.SpeculativeDecoder(target, make(), gamma=4).generate(PROMPT, GREEDY)
    kinds = [s.kind for s in out.sources]
    stats = out.stats
    assert len(out.sources) == len(out.token_ids) == 40
    assert kinds.count("accepted") == stats.accepted > 0
    assert sum(s.source == "target" for s in out.sources) == stats.rounds
    assert kinds.count("recovered") == stats.rejections > 0
    depths = [s.depth for s in out.sources]
    assert all(d == 1 or (prev + 1 == d) for prev, d in zip([0, *depths], depths, strict=False))  # rounds count up
    if proposer == "lookup-tree":
        assert stats.tree_rounds > 0


def _oracle_logprobs(target: sd.LoadedModel, prompt: list[int], generated: list[int]) -> torch.Tensor:
    """log_softmax of the target's logits over prompt + generated in one plain transformers forward."""
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + generated])).logits[0].float()
    rows = logits[len(prompt) - 1 : len(prompt) - 1 + len(generated), : target.vocab_size]
    return torch.log_softmax(rows, dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_are_the_targets_own_before_the_sampling_warps(target, temperature):
    params = sd.SamplingParams(temperature=temperature, top_k=5, max_new_tokens=24, seed=3)
    out = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=4).generate(PROMPT, params, logprobs=3)
    oracle = _oracle_logprobs(target, PROMPT, out.token_ids)
    got = torch.tensor([lp.logprob for lp in out.logprobs])
    want = oracle.gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    for lp, row in zip(out.logprobs, oracle, strict=True):
        assert [t for t, _ in lp.top] == torch.topk(row, 3).indices.tolist()
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
    if temperature == 0:
        assert all(lp.token == lp.top[0][0] for lp in out.logprobs)


@pytest.mark.parametrize(("dtype", "quantization"), [("float32", None), ("bfloat16", None), ("float32", "int4")])
def test_greedy_logprobs_are_bitwise_the_same_with_and_without_speculation(dtype, quantization):
    model = quantizable_llama(LARGE_VOCAB, seed=11)
    target = sd.load_model(model, dtype=dtype, quantization=quantization)
    draft = sd.load_model(perturbed(model, seed=12, noise=0.3), dtype=dtype, quantization=quantization)
    plain = sd.autoregressive_generate(target, PROMPT, GREEDY, logprobs=5)
    assert plain.logprobs is not None and len(plain.logprobs) == 40
    for proposer in (sd.DraftModelProposer(draft), sd.PromptLookupProposer(branches=3)):
        out = sd.SpeculativeDecoder(target, proposer, gamma=4).generate(PROMPT, GREEDY, logprobs=5)
        assert out.token_ids == plain.token_ids
        assert out.stats.accepted > 0
        assert out.logprobs == plain.logprobs, type(proposer).__name__  # floats compared exactly


def test_logprobs_are_recorded_only_when_asked_for_and_checked(target):
    assert sd.autoregressive_generate(target, PROMPT, GREEDY).logprobs is None
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError, match="logprobs"):
            sd.autoregressive_generate(target, PROMPT, GREEDY, logprobs=bad)


def test_logprobs_stop_with_the_text_at_a_stop_token(target):
    plain = sd.autoregressive_generate(target, PROMPT, GREEDY)
    eos = plain.token_ids[5]
    stopping = with_eos(target, eos)
    out = sd.SpeculativeDecoder(stopping, sd.PromptLookupProposer(), gamma=4).generate(PROMPT, GREEDY, logprobs=0)
    assert out.token_ids[-1] == eos and len(out.logprobs) == len(out.sources) == len(out.token_ids)


def test_token_logprobs_ranks_ties_by_id():
    rows = torch.tensor([[0.0, 1.0, 1.0, -2.0]])
    (lp,) = token_logprobs(rows, [2], top=3)
    assert [t for t, _ in lp.top] == [1, 2, 0]
    assert lp.logprob == pytest.approx(float(torch.log_softmax(rows[0], -1)[2]))


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE whose merges do not cover the emoji and CJK below: their bytes split across tokens."""
    backend = ByteLevelBPETokenizer()
    backend.train_from_iterator(["the cat sat on the mat, héllo wörld"] * 5, vocab_size=280, show_progress=False)
    return PreTrainedTokenizerFast(tokenizer_object=backend._tokenizer)


@pytest.mark.parametrize("text", ["the cat sat 😀 on 日本語 the mat", "héllo wörld, the  cat\n\nsat", "😀😀 é"])
def test_pieces_concatenate_to_the_decoded_text(text):
    tokenizer = byte_level_tokenizer()
    ids = tokenizer.encode(text)
    detok = Detokenizer(tokenizer.decode)
    pieces = []
    for token in ids:
        peeked = detok.peek(token)
        pieces.append(detok.push(token))
        assert peeked == pieces[-1]
    assert "".join(pieces) == tokenizer.decode(ids) == text
    assert "" in pieces  # a token inside a character: its piece waits for the token that completes it
    assert all("\ufffd" not in piece for piece in pieces)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3-270m"])
def test_pieces_concatenate_to_the_text_with_the_bundled_tokenizers(name):
    from specdecode.models.loading.sources import load_tokenizer

    tokenizer = load_tokenizer(name)  # the tokenizer load_model attaches, without the weights
    text = "Grüße aus Köln — 東京タワー 🗼🎉 naïve café\n\n  indented\tcode() {}"
    ids = tokenizer.encode(text, add_special_tokens=False)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731 as LoadedModel.decode
    detok = Detokenizer(decode)
    pieces = [detok.push(t) for t in ids]
    assert "".join(pieces) == decode(ids)
