"""A plain-PyTorch runner for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) with a static KV cache.

It reads the weights of an already-loaded transformers model once (q/k/v and gate/up fused into single
matrices), then runs the same maths as transformers' sdpa path with far less Python per token:
RMSNorm in float32 cast back, RoPE from precomputed cos/sin tables, grouped-query attention through
``scaled_dot_product_attention`` with the query heads of each key/value head packed together, SiLU MLP.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2"})
# RoPE types whose inverse frequencies are fixed at load time (no per-call update in transformers).
_STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})
_DTYPES = (torch.float32, torch.bfloat16)


def supports_native(model: nn.Module) -> bool:
    """True iff ``NativeLlamaRunner`` reproduces ``model``'s forward pass exactly (else use the transformers runner)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in _MODEL_TYPES:
        return False
    base = getattr(model, "model", None)
    if not isinstance(getattr(model, "lm_head", None), nn.Linear) or base is None:
        return False
    if getattr(config, "hidden_act", None) != "silu":
        return False
    rotary = getattr(base, "rotary_emb", None)
    if getattr(rotary, "rope_type", None) not in _STATIC_ROPE_TYPES:
        return False
    if (getattr(config, "rope_parameters", None) or {}).get("partial_rotary_factor", 1.0) != 1.0:
        return False
    if config.model_type == "mistral" and getattr(config, "sliding_window", None) is not None:
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(config, name, None) is not None:
            return False
    linears = [model.lm_head]
    for layer in base.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [
            attn.q_proj,
            attn.k_proj,
            attn.v_proj,
            attn.o_proj,
            mlp.gate_proj,
            mlp.up_proj,
            mlp.down_proj,
        ]
    # Exactly nn.Linear with a dense float weight: quantized (e.g. packed GGUF) layers are subclasses or
    # carry other weight types.
    return all(type(m) is nn.Linear and m.weight.dtype in _DTYPES for m in linears) and (
        base.embed_tokens.weight.dtype == model.lm_head.weight.dtype
    )


@dataclass(frozen=True)
class _Layer:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(heads + 2 * kv_heads) * head_dim, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    gate_up_bias: torch.Tensor | None
    down: torch.Tensor
    down_bias: torch.Tensor | None


@dataclass(frozen=True)
class _Weights:
    dtype: torch.dtype
    embed: torch.Tensor
    layers: tuple[_Layer, ...]
    norm: torch.Tensor
    lm_head: torch.Tensor  # [padded vocab, hidden]


# One fused copy per decoder layer: a self-speculation draft (num_layers=N, or a transformers view of the
# first N layers) shares its target's fused weights.
_LAYERS: weakref.WeakKeyDictionary[nn.Module, _Layer] = weakref.WeakKeyDictionary()


def _bias(*linears: nn.Linear) -> torch.Tensor | None:
    if all(m.bias is None for m in linears):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in linears])


def _fuse(*linears: nn.Linear) -> torch.Tensor:
    """Concatenate the weights of ``linears`` (same input size) and make each layer's weight a view of the
    result, so the fused matrix costs no memory beyond the model's own parameters."""
    fused = torch.cat([m.weight.detach() for m in linears])
    start = 0
    for m in linears:
        m.weight.data = fused[start : start + m.out_features]
        start += m.out_features
    return fused


@torch.no_grad()
def _fused_layer(layer: nn.Module) -> _Layer:
    """Dense weights of one decoder layer (q/k/v and gate/up fused, the rest as they are), cached."""
    cached = _LAYERS.get(layer)
    attn, mlp = layer.self_attn, layer.mlp
    if cached is not None and cached.o.data_ptr() == attn.o_proj.weight.data_ptr():
        return cached
    fused = _Layer(
        input_norm=layer.input_layernorm.weight.detach(),
        qkv=_fuse(attn.q_proj, attn.k_proj, attn.v_proj),
        qkv_bias=_bias(attn.q_proj, attn.k_proj, attn.v_proj),
        o=attn.o_proj.weight.detach().contiguous(),
        o_bias=None if attn.o_proj.bias is None else attn.o_proj.bias.detach(),
        post_norm=layer.post_attention_layernorm.weight.detach(),
        gate_up=_fuse(mlp.gate_proj, mlp.up_proj),
        gate_up_bias=_bias(mlp.gate_proj, mlp.up_proj),
        down=mlp.down_proj.weight.detach().contiguous(),
        down_bias=None if mlp.down_proj.bias is None else mlp.down_proj.bias.detach(),
    )
    _LAYERS[layer] = fused
    return fused


def _weights(model: nn.Module) -> _Weights:
    """The runner's view of ``model``'s weights: fused layers (shared, cached) and views of the rest."""
    base = model.model
    return _Weights(
        dtype=base.embed_tokens.weight.dtype,
        embed=base.embed_tokens.weight.detach().contiguous(),
        layers=tuple(_fused_layer(layer) for layer in base.layers),
        norm=base.norm.weight.detach(),
        lm_head=model.lm_head.weight.detach().contiguous(),  # tied: the same storage as embed
    )


def _linear_rows(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)``, the bias added separately so that one row and many rows round alike."""
    y = F.linear(x, weight)
    return y if bias is None else y + bias


def _linear_row(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``_linear_rows`` for a single row as a matrix-vector product: bitwise the same gemv, less dispatch."""
    y = torch.mv(weight, x[0])[None]
    return y if bias is None else y + bias


class NativeLlamaRunner:
    """``ModelRunner`` for a Llama-family transformers model: static KV cache, rollback is a length reset.

    ``num_layers=N`` runs only the first N decoder layers, then the final norm and LM head (a
    self-speculation draft that shares the model's weights but keeps its own cache).
    """

    def __init__(self, model: nn.Module, vocab_size: int, max_length: int = 4096, num_layers: int | None = None):
        if not supports_native(model):
            raise ValueError(
                f"{type(model).__name__} is not a plain Llama-family model this runner reproduces exactly; "
                "use the transformers runner"
            )
        config = model.config
        total = config.num_hidden_layers
        num_layers = total if num_layers is None else num_layers
        if not 1 <= num_layers <= total:
            raise ValueError(f"num_layers must be in 1..{total}, got {num_layers}")
        if max_length < 1:
            raise ValueError(f"max_length must be positive, got {max_length}")
        weights = _weights(model)
        if not 1 <= vocab_size <= weights.lm_head.shape[0]:
            raise ValueError(f"vocab_size must be in 1..{weights.lm_head.shape[0]}, got {vocab_size}")
        attn = model.model.layers[0].self_attn
        rotary = model.model.rotary_emb

        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self._dtype = weights.dtype
        self._device = weights.embed.device
        self._embed = weights.embed
        self._layers = weights.layers[:num_layers]
        self._norm = weights.norm
        self._lm_head = weights.lm_head[:vocab_size]  # a prefix of rows: still contiguous
        self._eps = config.rms_norm_eps
        self._hidden_shape = (config.hidden_size,)
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._groups = self._heads // self._kv_heads
        self._head_dim = attn.head_dim
        self._scaling = attn.scaling
        self._intermediate = config.intermediate_size
        self._inv_freq = rotary.inv_freq.detach().float()
        self._attention_scaling = rotary.attention_scaling
        self._length = 0
        self._capacity = 0
        self._allocate(max_length)

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        return self._length

    def rollback_to(self, length: int) -> None:
        """Drop cache entries past ``length``: the slots are simply overwritten later."""
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback_to({length}) outside 0..{self._length}")
        self._length = length

    def reset(self) -> None:
        """Empty the cache."""
        self._length = 0

    @torch.inference_mode()
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the KV cache and RoPE tables for ``capacity`` slots, keeping the cached entries."""
        shape = (len(self._layers), 1, self._kv_heads, capacity, self._head_dim)
        keys = torch.empty(shape, dtype=self._dtype, device=self._device)
        values = torch.empty(shape, dtype=self._dtype, device=self._device)
        if self._length:
            keys[..., : self._length, :] = self._keys[..., : self._length, :]
            values[..., : self._length, :] = self._values[..., : self._length, :]
        self._keys, self._values = keys, values
        # As transformers' rotary embedding: float32 angles, cos/sin scaled, then cast to the model dtype.
        self._slots = torch.arange(capacity, device=self._device)
        freqs = self._slots[:, None].float() * self._inv_freq.to(self._device)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = (emb.cos() * self._attention_scaling).to(self._dtype)
        sin = (emb.sin() * self._attention_scaling).to(self._dtype)
        # rotate_half(x) * sin == swap_halves(x) * [-sin_a, sin_b] exactly: fold the sign into the table.
        half = self._head_dim // 2
        self._signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        self._capacity = capacity

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """As LlamaRMSNorm: normalise in float32, cast back, then scale (one fused kernel in float32)."""
        if self._dtype == torch.float32:
            return F.rms_norm(x, self._hidden_shape, weight, self._eps)
        return weight * F.rms_norm(x.float(), self._hidden_shape, eps=self._eps).to(self._dtype)

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache without computing their logits."""
        self._run(tokens, None, None, logits=False)

    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Append ``tokens`` (int64 ``[k]``) at slots ``length..length+k-1``; return float32 logits ``[k, vocab_size]``.

        By default token i sits at position ``length+i`` and attends to slots ``<= length+i``. For a token
        tree, ``positions`` (int64 ``[k]``) overrides the RoPE positions and ``attn_mask`` (bool
        ``[k, length+k]``, True = may attend) overrides the causal mask.
        """
        return self._run(tokens, positions, attn_mask, logits=True)

    @torch.inference_mode()
    def _run(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, attn_mask: torch.Tensor | None, logits: bool
    ) -> torch.Tensor | None:
        k = tokens.shape[0]
        start = self._length
        end = start + k
        if end > self._capacity:
            self._allocate(max(end, 2 * self._capacity))
        if positions is None:
            cos, sin = self._cos[start:end], self._signed_sin[start:end]
        else:
            cos, sin = self._cos[positions], self._signed_sin[positions]
        if attn_mask is None and k > 1:
            attn_mask = self._slots[:end] <= self._slots[start:end, None]
        if attn_mask is not None:
            if attn_mask.shape != (k, end):
                raise ValueError(f"attn_mask must have shape ({k}, {end}), got {tuple(attn_mask.shape)}")
            # Rows follow the packed query layout: (query head within the group, token).
            attn_mask = attn_mask.repeat(self._groups, 1)
        cos, sin = cos[:, None], sin[:, None]  # broadcast over heads
        heads, kv_heads, groups, head_dim = self._heads, self._kv_heads, self._groups, self._head_dim
        qk_width = (heads + kv_heads) * head_dim
        half = head_dim // 2

        linear = _linear_row if k == 1 else _linear_rows
        x = F.embedding(tokens, self._embed)
        for i, layer in enumerate(self._layers):
            h = self._rms_norm(x, layer.input_norm)
            qkv = linear(h, layer.qkv, layer.qkv_bias)
            qk = qkv[:, :qk_width].view(k, heads + kv_heads, head_dim)
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            keys, values = self._keys[i], self._values[i]
            keys[0, :, start:end] = qk[:, heads:].transpose(0, 1)
            values[0, :, start:end] = qkv[:, qk_width:].view(k, kv_heads, head_dim).transpose(0, 1)
            # Pack the query heads that share a key/value head: [1, kv_heads, groups * k, head_dim]
            # (4-D inputs reach the fused CPU kernel).
            q = qk[:, :heads].view(k, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
            q = q.reshape(1, kv_heads, groups * k, head_dim)
            attn = F.scaled_dot_product_attention(
                q, keys[:, :, :end], values[:, :, :end], attn_mask=attn_mask, scale=self._scaling
            )
            attn = attn.view(kv_heads, groups, k, head_dim).permute(2, 0, 1, 3).reshape(k, heads * head_dim)
            x = x + linear(attn, layer.o, layer.o_bias)
            h = self._rms_norm(x, layer.post_norm)
            gate, up = linear(h, layer.gate_up, layer.gate_up_bias).split(self._intermediate, dim=-1)
            x = x + linear(F.silu(gate) * up, layer.down, layer.down_bias)
        self._length = end
        if not logits:
            return None
        return linear(self._rms_norm(x, self._norm), self._lm_head, None).float()
