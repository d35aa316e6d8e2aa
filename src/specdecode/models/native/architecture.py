"""What a decoder-only model asks of the native runner beyond Llama's maths, read from its config and modules.

Three families share one decoder loop (``runner``):

- Llama (Llama 2/3, SmolLM2, Mistral without a window, Qwen2): RMSNorm → attention → residual, RMSNorm → SiLU
  MLP → residual; RMSNorm scales by ``w``.
- Qwen 3: Llama plus an RMSNorm over each query and key head (before RoPE).
- Gemma 3: query/key norms, "sandwich" norms (the attention and MLP outputs normed again before each residual
  add), RMSNorm scaling by ``1 + w``, GeGLU with tanh GELU, the embedding scaled by ``sqrt(hidden)``, the
  scaling ``query_pre_attn_scalar ** -0.5``, and local sliding-window layers (their own RoPE base)
  interleaved with global ones.

A sliding window of ``W`` lets a row attend to the last ``W`` of its visible keys (itself included), as
transformers' ``kv_idx > q_idx - W``; for a tree row the visible keys are its path, so the window is the
path's last ``W`` tokens, as a plain step at that node sees them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..formats.weights import QuantizedEmbedding, QuantizedLinear

FAMILIES = {"llama": "llama", "mistral": "llama", "qwen2": "llama", "qwen3": "qwen3", "gemma3_text": "gemma3"}
# RoPE types whose inverse frequencies are fixed at load time (no per-call update in transformers).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
FLOAT_DTYPES = (torch.float32, torch.bfloat16)
_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}


@dataclass(frozen=True)
class Rope:
    """One RoPE table's inverse frequencies ``[head_dim / 2]`` and the factor transformers scales cos/sin by."""

    inv_freq: torch.Tensor
    attention_scaling: float


@dataclass(frozen=True)
class Architecture:
    """The per-family options of the shared decoder loop (see the module docstring)."""

    family: str
    scaling: float  # attention logits' factor
    activation: str  # "silu" or "gelu_tanh": act(gate) · up
    qk_norm: bool  # an RMSNorm over each query / key head before RoPE
    sandwich_norms: bool  # the attention and MLP outputs normed before their residual adds
    unit_offset_norms: bool  # RMSNorm scales by (1 + w) in float32 (Gemma) instead of by w
    embed_scale: torch.Tensor | None  # a scalar the embedding rows are multiplied by (in the model's dtype)
    windows: tuple[int, ...]  # per layer: its sliding window (keys visible, itself included), 0 = every key
    rope_of_layer: tuple[int, ...]  # per layer: its index into ``ropes``
    ropes: tuple[Rope, ...]


def _activation(config) -> str | None:
    name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
    return _ACTIVATIONS.get(name)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why the native runner cannot reproduce ``model``'s forward pass exactly, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    family = FAMILIES.get(model_type)
    if family is None:
        return f"model type {model_type!r} is not one the native runner knows ({', '.join(sorted(FAMILIES))})"
    base = getattr(model, "model", None)
    if base is None or not isinstance(getattr(model, "lm_head", None), nn.Linear | QuantizedLinear):
        return "no decoder (.model) with a linear LM head"
    activation = _activation(config)
    if activation is None or (family != "gemma3") != (activation == "silu"):
        name = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        return f"activation {name!r} is not the family's"
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return f"{name} is set"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    layer_types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * config.num_hidden_layers)
    if any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        return f"layer types {sorted(set(layer_types))} include ones the native runner does not run"
    if model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return "Mistral's sliding window"
    if "sliding_attention" in layer_types and not getattr(config, "sliding_window", None):
        return "sliding layers without a window size"
    reason = _rope_reason(base.rotary_emb, config, layer_types, family)
    if reason is not None:
        return reason
    return _weights_reason(model, family)


def _rope_reason(rotary: nn.Module, config, layer_types: tuple[str, ...], family: str) -> str | None:
    if family == "gemma3":
        types = {t: rotary.rope_type.get(t) for t in set(layer_types)}
    else:
        types = {"all": getattr(rotary, "rope_type", None)}
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("partial_rotary_factor", 1.0) != 1.0:
            return "partial rotary embeddings"
    bad = {t: r for t, r in types.items() if r not in STATIC_ROPE_TYPES}
    return f"RoPE type {bad} changes with the sequence length" if bad else None


def _weights_reason(model: nn.Module, family: str) -> str | None:
    linears = [model.lm_head]
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj]
        if family != "llama" and (getattr(attn, "q_norm", None) is None or getattr(attn, "k_norm", None) is None):
            return "query/key norms missing"
    # Exactly nn.Linear with a dense float weight, or our QuantizedLinear: transformers' own quantized layers
    # (e.g. packed GGUF) are subclasses or carry other weight types.
    dense = [m for m in linears if not isinstance(m, QuantizedLinear)]
    if not all(type(m) is nn.Linear and m.weight.dtype in FLOAT_DTYPES for m in dense):
        return "a linear layer is not a plain float32/bfloat16 nn.Linear or one of our quantized formats"
    embed = model.model.embed_tokens
    if isinstance(embed, QuantizedEmbedding):
        return None
    if not isinstance(embed, nn.Embedding) or type(embed).forward not in (nn.Embedding.forward, _scaled_forward()):
        return f"embedding {type(embed).__name__} is not a plain (or Gemma-scaled) table"
    if not all(embed.weight.dtype == m.weight.dtype for m in dense):
        return "the embedding's dtype differs from the linear layers'"
    return None


def _scaled_forward():
    from transformers.models.gemma3.modeling_gemma3 import Gemma3TextScaledWordEmbedding

    return Gemma3TextScaledWordEmbedding.forward


def architecture_of(model: nn.Module) -> Architecture:
    """The options of a model ``unsupported_reason`` accepts."""
    config = model.config
    family = FAMILIES[config.model_type]
    base = model.model
    layer_types = tuple(getattr(config, "layer_types", None) or ("full_attention",) * config.num_hidden_layers)
    window = int(getattr(config, "sliding_window", None) or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    rotary = base.rotary_emb
    if family == "gemma3":
        kinds = sorted(set(layer_types))
        ropes = tuple(
            Rope(getattr(rotary, f"{t}_inv_freq").detach().float(), getattr(rotary, f"{t}_attention_scaling"))
            for t in kinds
        )
        rope_of_layer = tuple(kinds.index(t) for t in layer_types)
    else:
        ropes = (Rope(rotary.inv_freq.detach().float(), rotary.attention_scaling),)
        rope_of_layer = (0,) * len(layer_types)
    embed = base.embed_tokens
    scale = getattr(embed, "embed_scale", None)
    if scale is not None and not isinstance(embed, QuantizedEmbedding):
        scale = scale.to(embed.weight.dtype)
    return Architecture(
        family=family,
        scaling=float(base.layers[0].self_attn.scaling),
        activation=_activation(config),
        qk_norm=family != "llama",
        sandwich_norms=family == "gemma3",
        unit_offset_norms=family == "gemma3",
        embed_scale=None if scale is None else scale.detach().clone(),
        windows=windows,
        rope_of_layer=rope_of_layer,
        ropes=ropes,
    )


def tied_head(model: nn.Module) -> bool:
    """Whether the LM head shares the input embedding's weights (a skeleton's meta tensors: as its config says)."""
    head, embed = model.lm_head.weight, model.model.embed_tokens.weight
    if head.is_meta or embed.is_meta:
        return bool(getattr(model.config.get_text_config(), "tie_word_embeddings", False))
    return embed.data_ptr() == head.data_ptr()
