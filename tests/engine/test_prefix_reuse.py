"""``SpeculativeDecoder`` reuses its runner's cache when a prompt extends the last request's context (a chat).

Each turn's output must equal a fresh decoder's token for token (greedy, and seeded sampling in reproducible
mode: bitwise logits give the same draws), with speculative rounds that reject and roll back, on every weight
format; only the prompt's new tokens are prefilled (``cached_tokens``). Control: a decoder that believes it
holds other tokens than it does reuses a wrong prefix, and the test sees it.
"""

from __future__ import annotations

import pytest
import torch
from helpers.models import LARGE_VOCAB, perturbed, quantizable_llama, tiny_llama

import specdecode as sd
from specdecode.engine.prefix_reuse import HeldPrefix
from specdecode.sampling.draft import EMPTY_DRAFT

FORMATS = [("float32", None), ("bfloat16", None), ("float32", "int8"), ("float32", "int4")]
GREEDY = sd.SamplingParams(max_new_tokens=24)
SAMPLED = sd.SamplingParams(temperature=0.8, max_new_tokens=24, seed=5)
QUESTIONS = ([5, 9, 2, 7, 7, 1, 30, 4], [11, 3, 3, 8], [40, 2, 19, 19, 6, 1], [7])


@pytest.fixture(scope="module", params=FORMATS, ids=["-".join(map(str, f)) for f in FORMATS])
def models(request):
    dtype, quantization = request.param
    model = quantizable_llama(LARGE_VOCAB, seed=11)
    target = sd.load_model(model, dtype=dtype, quantization=quantization)
    draft = sd.load_model(perturbed(model, seed=12, noise=0.3), dtype=dtype, quantization=quantization)
    return target, draft


def _chat(decoder: sd.SpeculativeDecoder, params: sd.SamplingParams, fresh) -> list[sd.GenerationOutput]:
    """Four turns, each prompt the whole history plus a question; each turn also run on ``fresh()``."""
    history: list[int] = []
    outputs = []
    for question in QUESTIONS:
        prompt = history + question
        out = decoder.generate(prompt, params)
        alone = fresh().generate(prompt, params)
        assert out.token_ids == alone.token_ids, f"turn {len(outputs) + 1}"
        assert alone.cached_tokens == 0
        outputs.append(out)
        history = prompt + out.token_ids
    return outputs


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_each_turn_reuses_the_history_and_equals_a_fresh_decoder(models, params):
    target, draft = models
    trees = lambda: sd.PromptLookupProposer(branches=3)  # noqa: E731  (token trees: retain, not rollback)
    for make in (lambda: sd.DraftModelProposer(draft), sd.PromptLookupProposer, trees):
        decoder = sd.SpeculativeDecoder(target, make(), gamma=4, mode="reproducible")
        outputs = _chat(
            decoder, params, lambda make=make: sd.SpeculativeDecoder(target, make(), 4, mode="reproducible")
        )
        assert outputs[0].cached_tokens == 0
        history = len(QUESTIONS[0])
        for question, previous, out in zip(QUESTIONS[1:], outputs, outputs[1:], strict=False):
            # the last turn's prompt and answer, but its newest token (never fed to the target) is reused
            history += len(previous.token_ids)
            assert out.cached_tokens == history - 1
            history += len(question)
        assert sum(o.stats.drafted - o.stats.accepted for o in outputs) > 0  # rollbacks happened


def test_a_prompt_that_edits_the_history_reuses_only_the_common_prefix(models):
    target, draft = models
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=3)
    first = decoder.generate(QUESTIONS[0] * 3, GREEDY)
    edited = QUESTIONS[0] * 2 + [1, 2, 3]
    out = decoder.generate(edited, GREEDY)
    assert out.cached_tokens == len(QUESTIONS[0]) * 2
    assert out.token_ids == sd.autoregressive_generate(target, edited, GREEDY).token_ids
    assert first.cached_tokens == 0
    again = decoder.generate(edited[:5], GREEDY)  # a prefix of what is held: all but its last token reused
    assert again.cached_tokens == 4
    assert again.token_ids == sd.autoregressive_generate(target, edited[:5], GREEDY).token_ids


def test_control_a_wrong_prefix_reused_changes_the_text(models):
    target, _ = models
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=3)
    decoder.generate([4] * 20, GREEDY)
    held = decoder._runner.length  # [4] * 20 and the answer, but the decoder believes it holds other tokens
    decoder._held = HeldPrefix((QUESTIONS[0] * 10)[:held])
    prompt = decoder._held.tokens + [2]
    out = decoder.generate(prompt, GREEDY)
    assert out.cached_tokens == held
    assert out.token_ids != sd.autoregressive_generate(target, prompt, GREEDY).token_ids


class _FeatureReader:
    """A proposer that reads the target's features as an EAGLE head does, and never drafts."""

    needs_target_hidden = True

    def __init__(self) -> None:
        self.features: list[torch.Tensor] = []

    def observe_target(self, hidden: list[torch.Tensor]) -> None:
        self.features = hidden

    def propose(self, context, k, params, generator):
        return EMPTY_DRAFT


def test_the_target_features_of_a_reused_prefix_are_those_of_a_full_prefill(models):
    target, _ = models
    reader, fresh_reader = _FeatureReader(), _FeatureReader()
    decoder = sd.SpeculativeDecoder(target, reader, gamma=2)
    first = decoder.generate(QUESTIONS[0], GREEDY)
    prompt = QUESTIONS[0] + first.token_ids + QUESTIONS[1]
    out = decoder.generate(prompt, GREEDY)
    fresh = sd.SpeculativeDecoder(target, fresh_reader, gamma=2).generate(prompt, GREEDY)
    assert out.cached_tokens > len(QUESTIONS[0]) and out.token_ids == fresh.token_ids
    assert torch.equal(torch.cat(reader.features), torch.cat(fresh_reader.features))


def test_the_transformers_runner_always_prefills_in_full():
    target = sd.load_model(tiny_llama(LARGE_VOCAB, seed=10), backend="transformers")
    decoder = sd.SpeculativeDecoder(target, sd.PromptLookupProposer(), gamma=3)
    first = decoder.generate(QUESTIONS[0], GREEDY)
    out = decoder.generate(QUESTIONS[0] + first.token_ids + QUESTIONS[1], GREEDY)
    assert out.cached_tokens == 0
