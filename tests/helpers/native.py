"""The native runner under test: random Llama-family models and token ids, every (dtype, weight format, kernels)
setting the row-invariance tests run, and the bitwise check of a k-row pass against one-token steps."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import PreTrainedModel

from helpers.models import tiny_model

VOCAB = 48


def random_ids(n: int, seed: int = 1) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Row invariance: the contract that makes greedy speculative output identical to plain decoding.
# Layer sizes are multiples of 64 so that every quantized format (int4 packs rows in blocks of 64) applies.
# (dtype, quantization, group size, kernels): quantized weights run the compiled kernels ("kernels") or, as where
# they cannot be built, PyTorch's weight-only kernels ("torch"); both must keep every promise.
SETTINGS = [
    ("float32", None, 32, "torch"),
    ("bfloat16", None, 32, "torch"),
    ("float32", "int8", 32, "kernels"),
    ("float32", "int4", 32, "kernels"),
    ("float32", "int4", 64, "kernels"),
    ("float32", "int8", 32, "torch"),
    ("float32", "int4", 32, "torch"),
]

SETTING_NAMES = ("dtype", "quantization", "group_size", "kernels")


def native_model(family: str = "llama", seed: int = 0, **config) -> PreTrainedModel:
    """A random 3-layer ``family`` model over ``VOCAB`` tokens (``tiny_model``; ``config`` overrides the sizes)."""
    fields = dict(num_hidden_layers=3, max_position_embeddings=256, rms_norm_eps=1e-5) | config
    return tiny_model(family, VOCAB, seed, **fields)


def wide_llama(family: str = "llama", **config) -> PreTrainedModel:
    """``native_model`` with layer sizes every weight format takes (multiples of 64: int4 packs rows in blocks)."""
    return native_model(family, **(dict(hidden_size=128, intermediate_size=256) | config))


# The native runner's other families (Gemma 3: sliding-window layers, which every test prompt outlasts).
WINDOW = 8
FAMILY_SIZES = dict(hidden_size=128, intermediate_size=256, head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6)


def gemma3(window: int = WINDOW, seed: int = 0, vocab_size: int = VOCAB, **config) -> PreTrainedModel:
    """A random 4-layer Gemma 3 (sliding, full, sliding, sliding) with sliding ``window``."""
    layer_types = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
    fields = FAMILY_SIZES | dict(num_hidden_layers=4, layer_types=layer_types, sliding_window=window,
                                 query_pre_attn_scalar=24) | config  # fmt: skip
    return tiny_model("gemma3", vocab_size, seed, **fields)


def qwen3(seed: int = 0, vocab_size: int = VOCAB, **config) -> PreTrainedModel:
    """A random 3-layer Qwen 3."""
    return tiny_model("qwen3", vocab_size, seed, **(FAMILY_SIZES | dict(num_hidden_layers=3) | config))


FAMILIES = {"gemma3": gemma3, "qwen3": qwen3}


def loaded_as(model, dtype: str, quantization: str | None, group_size: int, kernels: str = "kernels"):
    import specdecode as sd
    from specdecode.kernels import ops

    with pytest.MonkeyPatch.context() as patch:
        if kernels == "torch":
            patch.setenv("SPECDECODE_KERNELS", "0")
        loaded = sd.load_model(copy.deepcopy(model), dtype=dtype, quantization=quantization, group_size=group_size)
    assert loaded.backend == "native" and loaded.quantization == quantization
    expected = quantization is not None and kernels == "kernels" and ops() is not None
    assert loaded.new_runner().uses_kernels == expected
    return loaded


def assert_rows_equal_single_steps(runner, context: list[int], tokens: list[int]) -> None:
    """forward(tokens) after ``context`` gives, row by row, bitwise the logits of one-token steps."""
    runner.reset()
    runner.prefill(torch.tensor(context))
    together = runner.forward(torch.tensor(tokens))
    runner.rollback_to(len(context))
    for row, token in enumerate(tokens):
        single = runner.forward(torch.tensor([token]))[0]
        assert torch.equal(together[row], single), f"row {row} of {len(tokens)} after {len(context)} tokens"
