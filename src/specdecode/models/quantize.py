"""Put a loaded transformers model's linear layers into a quantized format, in place.

``gguf`` keeps a GGUF file's own 4-bit blocks (Q4_0, Q4_1, Q4_K: the file's integers and scales, scales rounded
to bfloat16 for the kernel); ``int4`` rounds dense weights groupwise to 4 bits; ``int8`` per output row to 8 bits.
In every mode the LM head is int8 per row (the head is sensitive and too large to keep dense), and a tied input
embedding reads its rows (``gguf``: the file's Q8_0 embedding, exact). Matrices the file stores in another type
(F32, F16, Q6_K, …) stay dense float32.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .gguf_blocks import read_gguf_tensors
from .weights import (
    GROUP_SIZES,
    GroupQuant,
    Int4Linear,
    Int8Groups,
    Int8Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    RowSlice,
    concat_biases,
    register_fused,
)

QUANTIZATIONS = ("gguf", "int8", "int4")
_LLAMA_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("self_attn.o_proj",),
                 ("mlp.gate_proj", "mlp.up_proj"), ("mlp.down_proj",))  # fmt: skip


@dataclass(frozen=True)
class Quantization:
    """How to store the weights: ``kind`` in QUANTIZATIONS; ``group_size`` for ``int4`` (GGUF blocks fix their own)."""

    kind: str
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.kind not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} or None, got {self.kind!r}")
        if self.group_size not in GROUP_SIZES:
            raise ValueError(f"group size must be one of {', '.join(map(str, GROUP_SIZES))}, got {self.group_size}")


def quantize_model(model: nn.Module, quantization: Quantization, gguf_path: Path | None = None) -> None:
    """Replace ``model``'s decoder linears, LM head and tied embedding by quantized modules, in place."""
    if quantization.kind == "gguf" and gguf_path is None:
        raise ValueError("quantization='gguf' needs a GGUF file: load a .gguf path or a bundled model")
    stored = read_gguf_tensors(gguf_path, model) if quantization.kind == "gguf" else {}
    llama = getattr(model.config, "model_type", None) in ("llama", "mistral", "qwen2")
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}."
        groups = _LLAMA_GROUPS if llama else tuple((name,) for name, m in layer.named_modules() if _is_linear(m))
        for group in groups:
            modules = [layer.get_submodule(name) for name in group]
            stored_weights = [stored.get(f"{prefix}{name}.weight") for name in group]
            sources = [_source(m, w, quantization) for m, w in zip(modules, stored_weights, strict=True)]
            _quantize_group(layer, group, modules, sources)
    _quantize_head(model, stored.get("model.embed_tokens.weight"))


def _is_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear


def _source(module: nn.Module, stored, quantization: Quantization) -> GroupQuant | Int8Linear | None:
    """What ``module`` becomes: 4-bit groups, int8 rows, or None (stays dense)."""
    bias = module.bias
    if quantization.kind == "int4":
        return GroupQuant.quantize(module.weight, quantization.group_size)
    if quantization.kind == "int8":
        return Int8Linear.quantize(module.weight, bias)
    if isinstance(stored, GroupQuant):
        return stored
    if isinstance(stored, Int8Groups):
        return Int8Linear.quantize(stored.dequantize(), bias)
    return None


def _quantize_group(layer: nn.Module, names, modules, sources) -> None:
    """Swap the modules of one fusable group; register their fused format for the native runner."""
    fused: Int4Linear | Int8Linear | None = None
    if all(isinstance(s, GroupQuant) for s in sources):
        fused = Int4Linear.from_groups(GroupQuant.cat(sources), concat_biases(modules))
    elif all(isinstance(s, Int8Linear) for s in sources):
        q, scale = torch.cat([s.q for s in sources]), torch.cat([s.scale for s in sources])
        fused = Int8Linear(q, scale, concat_biases(modules))
    if fused is not None:
        if len(modules) == 1:
            kernels = [fused]
        else:
            bounds = torch.tensor([0] + [m.out_features for m in modules]).cumsum(0).tolist()
            kernels = [RowSlice(fused, a, b) for a, b in itertools.pairwise(bounds)]
    else:  # mixed or dense: each part on its own (the native runner concatenates their outputs)
        kernels = [s if isinstance(s, Int8Linear) else None if s is None else Int4Linear.from_groups(s, m.bias)
                   for s, m in zip(sources, modules, strict=True)]  # fmt: skip
    swapped = []
    for name, module, kernel in zip(names, modules, kernels, strict=True):
        if kernel is None:
            swapped.append(module)
            continue
        new = QuantizedLinear(kernel, module.in_features, module.out_features)
        layer.set_submodule(name, new)
        swapped.append(new)
    if fused is not None and len(swapped) > 1:
        register_fused(swapped, fused)


def _quantize_head(model: nn.Module, stored_embedding) -> None:
    """LM head → int8 per row, carrying its exact rows (the file's Q8_0 table when the head is tied to it);
    the input embedding → that table, or the tied head's int8 rows."""
    head = model.lm_head
    embed = model.model.embed_tokens
    tied = embed.weight.data_ptr() == head.weight.data_ptr()
    kernel = Int8Linear.quantize(head.weight, head.bias)
    exact = stored_embedding if tied and isinstance(stored_embedding, Int8Groups) else kernel.rows
    model.lm_head = QuantizedLinear(kernel, head.in_features, head.out_features, exact_rows=exact)
    if isinstance(stored_embedding, Int8Groups):
        table = stored_embedding
    elif tied:
        table = kernel.rows  # the int8 head's own rows
    else:
        return
    model.model.embed_tokens = QuantizedEmbedding(table, embed.num_embeddings, embed.embedding_dim)
