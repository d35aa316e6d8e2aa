"""Bad input fails early with a message a user can act on; mismatched vocabularies are refused."""

from __future__ import annotations

import math

import pytest
from helpers.models import tiny_llama
from helpers.tokenizers import fixed_width_words, word_tokenizer

import specdecode as sd

WORDS = fixed_width_words(12)  # "w07" in the mismatch message; 12 real ids under 16 rows


@pytest.mark.parametrize("prompt", [[], ""])
def test_empty_prompt(small_target, prompt):
    target = sd.load_model(small_target.model, tokenizer=word_tokenizer(fixed_width_words(16)))
    with pytest.raises(ValueError, match="prompt is empty"):
        sd.SpeculativeDecoder(target, sd.PromptLookupProposer()).generate(prompt, sd.SamplingParams())
    with pytest.raises(ValueError, match="prompt is empty"):
        sd.autoregressive_generate(target, prompt, sd.SamplingParams())


def test_prompt_ids_outside_the_vocabulary(small_target):
    with pytest.raises(ValueError, match="token id 16 is outside the vocabulary"):
        sd.autoregressive_generate(small_target, [1, 16], sd.SamplingParams())
    with pytest.raises(ValueError, match="token id -1"):
        sd.SpeculativeDecoder(small_target).generate([-1], sd.SamplingParams())


def test_text_prompt_and_stop_strings_need_a_tokenizer(small_target):
    with pytest.raises(ValueError, match="no tokenizer"):
        sd.autoregressive_generate(small_target, "hello", sd.SamplingParams())
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        sd.SpeculativeDecoder(small_target).generate([1, 2], sd.SamplingParams(stop=("x",)))


@pytest.mark.parametrize("gamma", [0, -1, 2.5, 4.0, "4", True, None])
def test_gamma_must_be_a_positive_integer(small_target, gamma):
    with pytest.raises(ValueError, match="gamma must be an integer >= 1"):
        sd.SpeculativeDecoder(small_target, sd.PromptLookupProposer(), gamma=gamma)


@pytest.mark.parametrize("top_p", [0.0, -0.5, 1.01, 2.0, math.nan])
def test_top_p_in_zero_one(top_p):
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\]"):
        sd.SamplingParams(top_p=top_p)


@pytest.mark.parametrize("temperature", [-0.01, -1.0, math.nan])
def test_temperature_non_negative(temperature):
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        sd.SamplingParams(temperature=temperature)


@pytest.mark.parametrize("max_new_tokens", [0, -3, 2.0, None])
def test_max_new_tokens_positive_integer(max_new_tokens):
    with pytest.raises(ValueError, match="max_new_tokens must be an integer >= 1"):
        sd.SamplingParams(max_new_tokens=max_new_tokens)


def test_other_sampling_params():
    with pytest.raises(ValueError, match="top_k"):
        sd.SamplingParams(top_k=-1)
    with pytest.raises(ValueError, match="top_k"):
        sd.SamplingParams(top_k=2.5)
    with pytest.raises(ValueError, match="seed"):
        sd.SamplingParams(seed=-1)
    with pytest.raises(ValueError, match="stop strings"):
        sd.SamplingParams(stop=("",))
    assert sd.SamplingParams(stop="abc").stop == ("abc",)
    defaults = sd.SamplingParams()
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.seed, defaults.stop) == (
        0.0,
        0,
        1.0,
        None,
        (),
    )
    assert defaults.greedy and sd.SamplingParams(top_p=1.0, temperature=1e-3).greedy is False


def test_prompt_plus_max_new_tokens_must_fit_the_context_window(small_target):
    window = small_target.model.config.max_position_embeddings
    prompt = [1, 2, 3] * 166  # 498 tokens
    fits = sd.SamplingParams(max_new_tokens=window - len(prompt))
    decoder = sd.SpeculativeDecoder(small_target, sd.PromptLookupProposer(), gamma=4)
    assert len(decoder.generate(prompt, fits).token_ids) == window - len(prompt)
    assert len(sd.autoregressive_generate(small_target, prompt, fits).token_ids) == window - len(prompt)
    over = sd.SamplingParams(max_new_tokens=window - len(prompt) + 1)
    message = rf"prompt \(498 tokens\) plus max_new_tokens \(15\).*context window of {window}.*at most 14"
    with pytest.raises(ValueError, match=message):
        decoder.generate(prompt, over)
    with pytest.raises(ValueError, match=message):
        next(decoder.stream(prompt, over))
    with pytest.raises(ValueError, match=message):
        sd.autoregressive_generate(small_target, prompt, over)
    with pytest.raises(ValueError, match="shorten the prompt"):
        sd.autoregressive_generate(small_target, [1] * window, sd.SamplingParams(max_new_tokens=1))


def test_params_must_be_sampling_params(small_target):
    with pytest.raises(ValueError, match="SamplingParams"):
        sd.autoregressive_generate(small_target, [1, 2], {"temperature": 1.0})


def test_vocabulary_sizes_differ_without_tokenizers(small_target, large_target):
    with pytest.raises(sd.VocabularyMismatch, match="16.*64"):
        sd.SpeculativeDecoder(small_target, sd.DraftModelProposer(large_target))
    assert issubclass(sd.VocabularyMismatch, ValueError)


def test_vocabularies_differing_at_one_id_name_it_and_both_tokens(small_target):
    model = tiny_llama(12, seed=5)
    target = sd.load_model(model, tokenizer=word_tokenizer(WORDS))
    other = list(WORDS)
    other[7] = "seven"
    draft = sd.load_model(tiny_llama(12, seed=6), tokenizer=word_tokenizer(other))
    with pytest.raises(sd.VocabularyMismatch) as info:
        sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft))
    message = str(info.value)
    assert "token id 7" in message and "'w07'" in message and "'seven'" in message


def test_a_padded_embedding_with_the_same_real_vocabulary_is_accepted(small_target):
    # target: 16 embedding rows, 12 real tokens; draft: exactly 12, from an equal but separate tokenizer
    target = sd.load_model(small_target.model, tokenizer=word_tokenizer(WORDS))
    draft = sd.load_model(tiny_llama(12, seed=7), tokenizer=word_tokenizer(WORDS))
    assert target.vocab_size == draft.vocab_size == 12
    assert target.model.config.vocab_size == 16
    decoder = sd.SpeculativeDecoder(target, sd.DraftModelProposer(draft), gamma=3)
    params = sd.SamplingParams(max_new_tokens=12)
    assert (
        decoder.generate([1, 2, 3], params).token_ids == sd.autoregressive_generate(target, [1, 2, 3], params).token_ids
    )
    # one more real token on one side is a mismatch, named by its id
    longer = sd.load_model(small_target.model, tokenizer=word_tokenizer(WORDS + ["w12"]))
    with pytest.raises(sd.VocabularyMismatch, match="token id 12"):
        sd.SpeculativeDecoder(longer, sd.DraftModelProposer(draft))
