"""The native runner's view of a model's weights (``runner``): per decoder layer the matrices fused (q/k/v and
gate/up) in whatever format they are stored, the norms as the runner applies them, and whether the compiled kernels
can run the stack; and the ``Decoder`` a pass runs (those layers, the head, the embedding and the shapes). Fused
layers are cached per module, so runners over one model share them.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..formats.kernel_linear import KernelHandle, KernelLinear
from ..formats.weights import (
    ConcatLinear,
    Embedding,
    Int8Groups,
    KernelRows,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    embedding_of,
    fuse_linears,
    kernel_parts,
    linear_of,
)
from .architecture import Architecture, architecture_of, unsupported_reason

REFINED_LOGITS = 32  # per row, the logits a quantized head recomputes exactly
KERNEL_CACHE_DTYPE = torch.float16  # the compiled kernels' KV cache (llama.cpp's default): half the bytes per step


def supports_native(model: nn.Module) -> bool:
    """True iff ``NativeRunner`` reproduces ``model``'s forward pass exactly (else use the transformers runner);
    ``architecture.unsupported_reason`` says why not."""
    return unsupported_reason(model) is None


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: Linear  # [(heads + 2 * kv_heads) * head_dim] outputs
    o: Linear
    post_norm: torch.Tensor  # before the MLP
    gate_up: Linear  # [2 * intermediate] outputs
    down: Linear
    q_norm: torch.Tensor | None = None  # per query / key head, before RoPE (Qwen 3, Gemma 3)
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None  # the attention / MLP output before its residual add (Gemma 3)
    mlp_out_norm: torch.Tensor | None = None
    gelu: bool = False  # GeGLU with tanh GELU (Gemma 3), else SiLU
    window: int = 0  # sliding window (keys visible, itself included); 0 = every key
    rope: int = 0  # which RoPE table
    kernel: KernelHandle | None = None  # the layer registered with the compiled kernels, when all its matrices are


@dataclass(frozen=True)
class _Weights:
    dtype: torch.dtype  # the residual stream's: the model's float dtype, float32 when any matrix is quantized
    arch: Architecture
    embed: Embedding
    layers: tuple[_Layer, ...]
    norm: torch.Tensor
    lm_head: Linear
    exact_head_rows: Callable[[torch.Tensor], torch.Tensor] | None  # quantized heads: exact rows by token id


# One fused view per decoder layer: a self-speculation draft (num_layers=N, or a transformers view of the
# first N layers) shares its target's fused weights. Keyed by the layer; the o_proj module it was built from
# tells a stale entry (weights swapped since) from a current one.
_LAYERS: weakref.WeakKeyDictionary[nn.Module, tuple[nn.Module, _Layer]] = weakref.WeakKeyDictionary()


# Gemma's norm scales 1 + w, computed once per norm module: runners over one model share them (forward_batch
# checks that its runners' weights are the same tensors). Keyed by the module; the weight's storage and version
# tell a stale entry from a current one.
_OFFSET_NORMS: weakref.WeakKeyDictionary[nn.Module, tuple[int, int, torch.Tensor]] = weakref.WeakKeyDictionary()


def _norm_weight(norm: nn.Module | None, dtype: torch.dtype, arch: Architecture) -> torch.Tensor | None:
    """An RMSNorm's scale as the runner applies it: ``w`` in the model's dtype, or Gemma's ``1 + w`` in float32."""
    if norm is None:
        return None
    weight = norm.weight.detach()
    if not arch.unit_offset_norms:
        return weight.to(dtype)
    key = (weight.data_ptr(), weight._version)
    cached = _OFFSET_NORMS.get(norm)
    if cached is None or cached[:2] != key:
        cached = (*key, 1.0 + weight.float())
        _OFFSET_NORMS[norm] = cached
    return cached[2]


@torch.no_grad()
def _fused_layer(layer: nn.Module, dtype: torch.dtype, arch: Architecture, index: int) -> _Layer:
    """The formats of one decoder layer (q/k/v and gate/up fused, the rest as they are), cached."""
    attn, mlp = layer.self_attn, layer.mlp
    cached = _LAYERS.get(layer)
    if cached is not None and cached[0] is attn.o_proj and _same_weights(cached[1].o, attn.o_proj):
        return cached[1]
    sandwich = arch.sandwich_norms
    fused = _Layer(
        input_norm=_norm_weight(layer.input_layernorm, dtype, arch),
        qkv=fuse_linears([attn.q_proj, attn.k_proj, attn.v_proj]),
        o=linear_of(attn.o_proj),
        post_norm=_norm_weight(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
                               dtype, arch),
        gate_up=fuse_linears([mlp.gate_proj, mlp.up_proj]),
        down=linear_of(mlp.down_proj),
        q_norm=_norm_weight(getattr(attn, "q_norm", None) if arch.qk_norm else None, dtype, arch),
        k_norm=_norm_weight(getattr(attn, "k_norm", None) if arch.qk_norm else None, dtype, arch),
        attn_out_norm=_norm_weight(layer.post_attention_layernorm if sandwich else None, dtype, arch),
        mlp_out_norm=_norm_weight(layer.post_feedforward_layernorm if sandwich else None, dtype, arch),
        gelu=arch.activation == "gelu_tanh",
        window=arch.windows[index],
        rope=arch.rope_of_layer[index],
    )  # fmt: skip
    parts = [kernel_parts(linear) for linear in (fused.qkv, fused.o, fused.gate_up, fused.down)]
    if all(p is not None for p in parts):
        library = _kernels_of(fused.down)
        layer_id = library.register_layer(
            fused.input_norm, parts[0], parts[1], fused.post_norm, *parts[2:], fused.q_norm, fused.k_norm,
            fused.attn_out_norm, fused.mlp_out_norm, fused.window, fused.rope, fused.gelu,
        )  # fmt: skip
        fused = dataclasses.replace(fused, kernel=KernelHandle(library, layer=layer_id))
    _LAYERS[layer] = (attn.o_proj, fused)
    return fused


def _kernels_of(linear: Linear):
    """The kernels build a kernel format (or the first part of a concatenation of them) is registered with."""
    first = linear.parts[0] if isinstance(linear, ConcatLinear) else linear
    return first.handle.kernels


def uses_kernels(model: nn.Module) -> bool:
    """Whether a ``NativeRunner`` over ``model`` runs the compiled kernels."""
    weights = _weights(model)
    attn = model.model.layers[0].self_attn
    return _kernel_layers(weights.layers, weights.lm_head, model.config, attn.head_dim) is not None


def _kernel_layers(layers: Sequence[_Layer], lm_head: Linear, config, head_dim: int) -> list[int] | None:
    """The kernel ids of ``layers`` when the compiled decoder can run them all (and the head), else None."""
    if not isinstance(lm_head, KernelLinear) or any(layer.kernel is None for layer in layers):
        return None
    if config.hidden_size % 16 or config.intermediate_size % 16 or head_dim % 16 or head_dim > 256:
        return None
    return [layer.kernel.id for layer in layers]


def _same_weights(linear: Linear, module: nn.Module) -> bool:
    if isinstance(module, QuantizedLinear):
        return linear is module.kernel
    return getattr(linear, "weight", None) is not None and linear.weight.data_ptr() == module.weight.data_ptr()


def _weights(model: nn.Module) -> _Weights:
    """The runner's view of ``model``'s weights: fused layers (shared, cached) and views of the rest."""
    base = model.model
    quantized = any(isinstance(m, QuantizedLinear | QuantizedEmbedding) for m in model.modules())
    dtype = torch.float32 if quantized else base.embed_tokens.weight.dtype
    arch = architecture_of(model)
    return _Weights(
        dtype=dtype,
        arch=arch,
        embed=embedding_of(base.embed_tokens),
        layers=tuple(_fused_layer(layer, dtype, arch, i) for i, layer in enumerate(base.layers)),
        norm=_norm_weight(base.norm, dtype, arch),
        lm_head=linear_of(model.lm_head),
        exact_head_rows=getattr(model.lm_head, "exact_rows", None),
    )


@dataclass(frozen=True, eq=False)
class Decoder:
    """What a native pass runs (``torch_path``, ``kernel_path``): the first ``len(layers)`` fused decoder layers of a
    model, its embedding, final norm and LM head, and the shapes and constants both paths read. Runners over one
    model and layer count hold decoders over the same fused layers (``same_weights``): one pass may run them all."""

    dtype: torch.dtype  # the residual stream's
    arch: Architecture
    device: torch.device
    embed: Embedding
    embed_scale: torch.Tensor | None  # Gemma's sqrt(hidden), in the residual dtype
    layers: tuple[_Layer, ...]
    norm: torch.Tensor
    lm_head: Linear
    exact_head_rows: Callable[[torch.Tensor], torch.Tensor] | None  # a quantized head's exact rows, by token id
    head_refinement: tuple  # (int8 table, its scales, rows refined, from the head's own tiles): the kernels' head
    vocab_size: int
    eps: float
    hidden_shape: tuple[int, ...]
    heads: int
    kv_heads: int
    groups: int  # query heads per key/value head
    head_dim: int
    scaling: float
    intermediate: int
    kernel_layers: list[int] | None  # the layers' ids in the compiled kernels, None on the torch path

    @property
    def uses_kernels(self) -> bool:
        return self.kernel_layers is not None

    def same_weights(self, other: Decoder) -> bool:
        """Whether ``other`` runs these very layers and final norm (one pass may compute rows for both)."""
        return (
            len(other.layers) == len(self.layers)
            and all(a is b for a, b in zip(other.layers, self.layers, strict=True))
            and other.norm.data_ptr() == self.norm.data_ptr()
        )


def decoder_of(model: nn.Module, vocab_size: int, num_layers: int) -> Decoder:
    """The ``Decoder`` of ``model``'s first ``num_layers`` layers, its logits cut to ``vocab_size`` columns."""
    weights = _weights(model)
    config = model.config
    attn = model.model.layers[0].self_attn
    layers = weights.layers[:num_layers]
    exact = weights.exact_head_rows
    # The kernels' head refines its top logits from an int8 table, or from its own tiles (KernelRows), or not.
    q, scale = (exact.q, exact.scale) if isinstance(exact, Int8Groups) else (None, None)
    from_head = isinstance(exact, KernelRows) and exact.matrix is weights.lm_head
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    return Decoder(
        dtype=weights.dtype,
        arch=weights.arch,
        device=weights.norm.device,
        embed=weights.embed,
        embed_scale=None if weights.arch.embed_scale is None else weights.arch.embed_scale.to(weights.dtype),
        layers=layers,
        norm=weights.norm,
        lm_head=weights.lm_head,
        exact_head_rows=exact,
        head_refinement=(q, scale, REFINED_LOGITS if q is not None or from_head else 0, from_head),
        vocab_size=vocab_size,
        eps=config.rms_norm_eps,
        hidden_shape=(config.hidden_size,),
        heads=heads,
        kv_heads=kv_heads,
        groups=heads // kv_heads,
        head_dim=attn.head_dim,
        scaling=attn.scaling,
        intermediate=config.intermediate_size,
        kernel_layers=_kernel_layers(layers, weights.lm_head, config, attn.head_dim),
    )
