"""The native runner for the Llama family (Llama 2/3, SmolLM2, Mistral, Qwen2) and its relatives Qwen 3 and
Gemma 3 (``architecture.py``: query/key norms, sandwich norms, GeGLU, sliding-window layers), with a static KV
cache.

It reads the weights of an already-loaded transformers model once (q/k/v and gate/up fused), in whatever
format they are stored (dense, or the quantized formats of ``weights.py``), then runs the same maths as
transformers' sdpa path with far less Python per token. Two paths:

- the compiled kernels (``kernels/``), when every matrix is a ``KernelLinear``: the whole decoder stack in one
  call, the KV cache in float16 with keys in tiles of 16 slots, attention in fixed key chunks;
- plain PyTorch otherwise (dense weights, or quantized ones where the kernels did not build): RMSNorm in
  float32, RoPE from precomputed cos/sin tables, grouped-query attention through
  ``scaled_dot_product_attention`` with the query heads of each key/value head packed together, SiLU MLP;
  quantized weights with a float32 residual stream and bfloat16 inputs to PyTorch's weight-only kernels.

Row invariance (what makes greedy speculative output identical to plain decoding): a k-token ``forward``
gives every row bitwise the logits of a one-token step over the same keys. Every weight format is
row-invariant; on the torch path attention is made so by one call per row over exactly that row's keys, on
the kernels by a reduction that depends only on the row's own keys.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .architecture import Architecture, architecture_of, unsupported_reason
from .base import check_retained_slots
from .weights import (
    ConcatLinear,
    Embedding,
    Int8Groups,
    KernelHandle,
    KernelLinear,
    KernelRows,
    Linear,
    QuantizedEmbedding,
    QuantizedLinear,
    embedding_of,
    fuse_linears,
    kernel_parts,
    linear_of,
)

REFINED_LOGITS = 32  # per row, the logits a quantized head recomputes exactly
KERNEL_CACHE_DTYPE = torch.float16  # the compiled kernels' KV cache (llama.cpp's default): half the bytes per step
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Branch:
    """A tree row's visible slots: cache slots ``0..prefix-1``, then the new rows ``rows`` (its ancestors and
    itself, as indices into this call's rows), in that order."""

    prefix: int
    rows: torch.Tensor


# Per row of a forward: a prefix length, a tree branch, or any other set of slot indices (gathered).
Visible = int | _Branch | torch.Tensor


def _write(
    keys: torch.Tensor, values: torch.Tensor, start: int, new_keys: torch.Tensor, new_values: torch.Tensor
) -> None:
    """Store rows' keys/values ``[k, kv_heads, head_dim]`` at slots ``start..`` of a layer's cache."""
    end = start + new_keys.shape[0]
    keys[0, :, start:end] = new_keys.transpose(0, 1)
    values[0, :, start:end] = new_values.transpose(0, 1)


def supports_native(model: nn.Module) -> bool:
    """True iff ``NativeLlamaRunner`` reproduces ``model``'s forward pass exactly (else use the transformers runner);
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
    """Whether a ``NativeLlamaRunner`` over ``model`` runs the compiled kernels."""
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


_NO_SLOTS = torch.zeros(0, dtype=torch.int64)


def _visible_slots(start: int, k: int, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each of ``k`` new rows at slots ``start..`` attends to under ``mask`` [k, start + k], for the kernels:
    (prefix, extra slots, extras per row). Row i sees slots ``0..prefix[i]-1``, then its extras in ascending
    order (a tree row: its ancestors and itself)."""
    prefix = mask.to(torch.int32).cumprod(dim=1).sum(dim=1).to(torch.int64)
    rest = mask & (torch.arange(mask.shape[1]) >= prefix[:, None])
    rows, slots = rest.nonzero(as_tuple=True)
    return prefix, slots, torch.bincount(rows, minlength=k)


def last_visible(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [k, n] (True = may attend) with each row keeping only its last ``window`` True entries (a sliding
    window over the row's visible keys, in slot order); ``window`` 0 keeps every entry."""
    if not window:
        return mask
    seen = mask.to(torch.int32).cumsum(dim=1)
    return mask & (seen > seen[:, -1:] - window)


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


class NativeLlamaRunner:
    """``ModelRunner`` for a Llama-family transformers model: static KV cache, rollback is a length reset.

    ``num_layers=N`` runs only the first N decoder layers, then the final norm and LM head (a
    self-speculation draft that shares the model's weights but keeps its own cache). The cache starts with
    ``max_length`` slots and doubles on demand, never past ``max_capacity`` slots by doubling (a pass that
    needs more, a token tree at the cap, gets exactly its slots).
    """

    def __init__(
        self,
        model: nn.Module,
        vocab_size: int,
        max_length: int = 4096,
        num_layers: int | None = None,
        max_capacity: int | None = None,
    ):
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(
                f"the native runner does not reproduce {type(model).__name__} exactly ({reason}); "
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
        rows = model.lm_head.out_features
        if not 1 <= vocab_size <= rows:
            raise ValueError(f"vocab_size must be in 1..{rows}, got {vocab_size}")
        attn = model.model.layers[0].self_attn

        self.vocab_size = vocab_size
        self.num_layers = num_layers
        self._dtype = weights.dtype
        self._arch = weights.arch
        self._embed_scale = None if weights.arch.embed_scale is None else weights.arch.embed_scale.to(weights.dtype)
        self._device = weights.norm.device
        self._embed = weights.embed
        self._layers = weights.layers[:num_layers]
        self._norm = weights.norm
        self._lm_head = weights.lm_head
        self._exact_head_rows = exact = weights.exact_head_rows
        # The kernels' head refines its top logits from an int8 table, or from its own tiles (KernelRows), or not.
        q, scale = (exact.q, exact.scale) if isinstance(exact, Int8Groups) else (None, None)
        from_head = isinstance(exact, KernelRows) and exact.matrix is weights.lm_head
        self._head_refinement = (q, scale, REFINED_LOGITS if q is not None or from_head else 0, from_head)
        self._eps = config.rms_norm_eps
        self._hidden_shape = (config.hidden_size,)
        self._heads = config.num_attention_heads
        self._kv_heads = config.num_key_value_heads
        self._groups = self._heads // self._kv_heads
        self._head_dim = attn.head_dim
        self._scaling = attn.scaling
        self._intermediate = config.intermediate_size
        self._kernel_layers = _kernel_layers(self._layers, self._lm_head, config, self._head_dim)
        self._length = 0
        self._capacity = 0
        self._max_capacity = max_capacity
        self._allocate(max_length)
        self.capture_hidden = False
        self.hidden: torch.Tensor | None = None

    @property
    def uses_kernels(self) -> bool:
        """True when forwards run the compiled kernels (``specdecode.kernels``), False on the pure-torch path."""
        return self._kernel_layers is not None

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        return self._length

    def rollback_to(self, length: int) -> None:
        """Drop cache entries past ``length``: the slots are simply overwritten later."""
        if not 0 <= length <= self._length:
            raise ValueError(f"rollback_to({length}) outside 0..{self._length}")
        self._length = length

    @torch.inference_mode()
    def retain(self, start: int, slots: Sequence[int]) -> None:
        """Keep the cache entries at ``slots`` (ascending, in ``start..length-1``), moved to ``start, start+1, ...``.

        After a token-tree pass this keeps the accepted branch: ``length`` becomes ``start + len(slots)``.
        """
        slots = check_retained_slots(start, slots, self._length)
        m = len(slots)
        if m and int(slots[-1]) != start + m - 1:  # not already in place
            if self.uses_kernels:  # keys in tiles of 16 slots: slot s is (tile s // 16, lane s % 16)
                for to, at in enumerate(slots.tolist(), start):
                    if to != at:
                        self._keys[:, :, to // 16, :, to % 16] = self._keys[:, :, at // 16, :, at % 16]
            else:
                self._keys[..., start : start + m, :] = self._keys[..., slots, :]
            self._values[..., start : start + m, :] = self._values[..., slots, :]
        self._length = start + m

    def reset(self) -> None:
        """Empty the cache."""
        self._length = 0

    @torch.inference_mode()
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the KV cache and RoPE tables for ``capacity`` slots, keeping the cached entries."""
        n = self._length
        if self.uses_kernels:  # the kernels' layout: keys in tiles of 16 slots [layers, kv_heads, tiles, head_dim, 16]
            capacity = -(-capacity // 16) * 16
            layers, kv_heads, d = len(self._layers), self._kv_heads, self._head_dim
            keys = torch.zeros((layers, kv_heads, capacity // 16, d, 16), dtype=KERNEL_CACHE_DTYPE)
            values = torch.zeros((layers, kv_heads, capacity, d), dtype=KERNEL_CACHE_DTYPE)
            if n:
                tiles = -(-n // 16)
                keys[:, :, :tiles] = self._keys[:, :, :tiles]
                values[..., :n, :] = self._values[..., :n, :]
        else:
            shape = (len(self._layers), 1, self._kv_heads, capacity, self._head_dim)
            keys = torch.empty(shape, dtype=self._dtype, device=self._device)
            values = torch.empty(shape, dtype=self._dtype, device=self._device)
            if n:
                keys[..., :n, :] = self._keys[..., :n, :]
                values[..., :n, :] = self._values[..., :n, :]
        self._keys, self._values = keys, values
        self._slots = torch.arange(capacity, device=self._device)
        self._cos, self._signed_sin = [], []
        for rope in self._arch.ropes:  # one table per RoPE base (Gemma 3: local and global layers)
            # As transformers' rotary embedding: float32 angles, cos/sin scaled, then cast to the model dtype.
            freqs = self._slots[:, None].float() * rope.inv_freq.to(self._device)
            emb = torch.cat((freqs, freqs), dim=-1)
            self._cos.append((emb.cos() * rope.attention_scaling).to(self._dtype))
            sin = (emb.sin() * rope.attention_scaling).to(self._dtype)
            # rotate_half(x) * sin == swap_halves(x) * [-sin_a, sin_b] exactly: fold the sign into the table.
            half = self._head_dim // 2
            self._signed_sin.append(torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        self._capacity = capacity

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """As LlamaRMSNorm (normalise in float32, cast back, then scale) or Gemma3RMSNorm (scale by ``1 + w`` in
        float32, then cast back) over the last dims ``shape`` (the hidden size by default); one fused kernel
        in float32."""
        shape = shape or self._hidden_shape
        if self._dtype == torch.float32:
            return F.rms_norm(x.float(), shape, weight, self._eps)
        normed = F.rms_norm(x.float(), shape, eps=self._eps)
        if self._arch.unit_offset_norms:
            return (normed * weight).to(self._dtype)
        return weight * normed.to(self._dtype)

    def _embed_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        """The embedding rows of ``tokens`` in the residual stream's dtype (times Gemma's scale)."""
        x = self._embed(tokens).to(self._dtype)
        return x if self._embed_scale is None else x * self._embed_scale

    def _rope_rows(
        self, start: int, end: int, positions: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per RoPE table, the (cos, signed sin) rows of slots ``start..end-1`` or of ``positions``."""
        where = slice(start, end) if positions is None else positions
        return [(cos[where], sin[where]) for cos, sin in zip(self._cos, self._signed_sin, strict=True)]

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache without computing their logits (one attention call for all rows:
        fast, and the same cache for the plain and the speculative path, which both prefill the prompt alike)."""
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

        Row invariance: each row's logits are bitwise those of a one-token call that sees the same keys in the
        same order (for a chain, plain decoding). Every matrix format is row-invariant; attention runs one
        call per row over exactly that row's keys, because a k-row attention reduces in another order.
        """
        return self._run(tokens, positions, attn_mask, logits=True)

    def _visible_keys(self, start: int, k: int, attn_mask: torch.Tensor | None) -> list[Visible]:
        """Per row, the cache slots it attends to, in order: a prefix length, a tree branch (a prefix, then new
        rows of this call), or slot indices."""
        if attn_mask is None:
            return [start + i + 1 for i in range(k)]
        visible: list[Visible] = []
        for row in attn_mask:
            slots = row.nonzero().squeeze(1)
            prefix = int((slots == torch.arange(slots.numel())).sum())  # slots 0..prefix-1 all visible
            if prefix == slots.numel():
                visible.append(prefix)
            elif prefix >= start and int(slots[prefix]) >= start:
                visible.append(_Branch(prefix, slots[prefix:] - start))
            else:
                visible.append(slots)
        return visible

    @torch.inference_mode()
    def _run(
        self, tokens: torch.Tensor, positions: torch.Tensor | None, attn_mask: torch.Tensor | None, logits: bool
    ) -> torch.Tensor | None:
        k = tokens.shape[0]
        start = self._length
        end = start + k
        if attn_mask is not None and attn_mask.shape != (k, end):
            raise ValueError(f"attn_mask must have shape ({k}, {end}), got {tuple(attn_mask.shape)}")
        self._reserve(end)
        if self.uses_kernels:
            return self._run_kernels([self], [tokens], [positions], [attn_mask], logits)[0]
        tables = self._rope_rows(start, end, positions)
        prefill_mask = None  # a prefill's [k, end] mask: one attention call for all rows
        causal_prefill = not logits and k > 1 and start == 0 and attn_mask is None
        if not logits and k > 1:
            prefill_mask = self._slots[:end] <= self._slots[start:end, None] if attn_mask is None else attn_mask
        batched_masks: dict[int, torch.Tensor] = {}  # per window: the prefill mask in the packed layout
        visible = self._visible_keys(start, k, attn_mask) if logits and (k > 1 or attn_mask is not None) else None
        kv_heads, groups, head_dim = self._kv_heads, self._groups, self._head_dim

        def attend(i: int, queries: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
            keys, values = self._store(i, start, new_keys, new_values)
            window = self._layers[i].window
            windowed = 0 < window < end
            if causal_prefill and not windowed:  # an empty cache: the causal kernel skips the masked half
                q = queries.transpose(0, 1)[None]
                attn = F.scaled_dot_product_attention(
                    q, keys[:, :, :end], values[:, :, :end], is_causal=True, scale=self._scaling, enable_gqa=True
                )
                return attn[0].transpose(0, 1)
            if visible is None and prefill_mask is None:  # one row
                first = end - window if windowed else 0
                q = queries.view(1, kv_heads, groups, head_dim)
                return F.scaled_dot_product_attention(
                    q, keys[:, :, first:end], values[:, :, first:end], scale=self._scaling
                )
            if visible is None:
                # Pack the query heads that share a key/value head: [1, kv_heads, groups * k, head_dim]
                # (4-D inputs reach the fused CPU kernel); rows follow the packed (query head, token) layout.
                key = window if windowed else 0
                if key not in batched_masks:
                    batched_masks[key] = last_visible(prefill_mask, key).repeat(groups, 1)
                q = queries.reshape(k, kv_heads, groups, head_dim).permute(1, 2, 0, 3)
                q = q.reshape(1, kv_heads, groups * k, head_dim)
                attn = F.scaled_dot_product_attention(
                    q, keys[:, :, :end], values[:, :, :end], attn_mask=batched_masks[key], scale=self._scaling
                )
                return attn.view(kv_heads, groups, k, head_dim).permute(2, 0, 1, 3)
            return self._attend_rows(queries, keys, values, new_keys, new_values, start, visible, window)

        x = self._decoder_layers(self._embed_rows(tokens), tables, attend)
        self._length = end
        if self.capture_hidden:
            self.hidden = x.float()
        return self._head(x) if logits else None

    def _run_kernels(
        self,
        runners: Sequence[NativeLlamaRunner],
        tokens: Sequence[torch.Tensor],
        positions: Sequence[torch.Tensor | None],
        masks: Sequence[torch.Tensor | None],
        logits: bool,
    ) -> list[torch.Tensor | None]:
        """One pass of the compiled decoder over every runner's new rows (their caches reserved already), then
        the head; each runner's rows and cache exactly as its own ``forward`` gives them (row invariance)."""
        meta: list[list[int]] = []
        offsets, extras, counts = [0], [], []
        for index, (runner, chunk, pos, mask) in enumerate(zip(runners, tokens, positions, masks, strict=True)):
            start, k = runner.length, int(chunk.shape[0])
            counts.append(k)
            where = range(start, start + k) if pos is None else pos.tolist()
            if mask is None:  # a chain: row i sees slots 0..start+i
                meta.extend([index, start + i, p, start + i + 1] for i, p in enumerate(where))
                offsets.extend([offsets[-1]] * k)
                continue
            prefix, slots, per_row = _visible_slots(start, k, mask)
            meta.extend([index, start + i, p, q] for i, (p, q) in enumerate(zip(where, prefix.tolist(), strict=True)))
            extras.append(slots)
            offsets.extend((offsets[-1] + per_row.cumsum(0)).tolist())
        if not extras:  # chains only: no extras
            offsets = []
        x = self._embed_rows(torch.cat(list(tokens))).to(torch.float32).contiguous()
        self._lm_head.handle.kernels.decoder(
            x, self._kernel_layers, [r._keys for r in runners], [r._values for r in runners],
            [t for r in runners for t in r._cos], [t for r in runners for t in r._signed_sin], len(self._cos),
            torch.tensor(meta, dtype=torch.int32), torch.tensor(offsets, dtype=torch.int64),
            torch.cat(extras) if extras else _NO_SLOTS, self._heads, self._kv_heads, self._head_dim, self._eps,
            self._scaling,
        )  # fmt: skip
        head = self._kernel_head(x) if logits else None
        out: list[torch.Tensor | None] = []
        row = 0
        for runner, k in zip(runners, counts, strict=True):
            runner._length += k
            if runner.capture_hidden:
                runner.hidden = x[row : row + k]
            out.append(None if head is None else head[row : row + k])
            row += k
        return out

    def _kernel_head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head through the kernels: float32 logits, the top rows refined exactly."""
        return self._lm_head.handle.kernels.lm_head(
            x, self._norm, self._eps, [self._lm_head.handle.id], self.vocab_size, *self._head_refinement
        )

    def _reserve(self, end: int) -> None:
        """Grow the cache (doubling, up to ``max_capacity``) so that slots up to ``end`` exist."""
        if end > self._capacity:
            doubled = 2 * self._capacity
            self._allocate(max(end, doubled if self._max_capacity is None else min(doubled, self._max_capacity)))

    def _store(
        self, layer: int, start: int, new_keys: torch.Tensor, new_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[k, kv_heads, head_dim]`` keys/values at slots ``start..``; return the layer's cache."""
        keys, values = self._keys[layer], self._values[layer]
        _write(keys, values, start, new_keys, new_values)
        return keys, values

    def _decoder_layers(
        self, x: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]], attend: Attend
    ) -> torch.Tensor:
        """The decoder stack over rows ``x``, with per RoPE table its (cos, signed sin) rows ``[k, head_dim]``.

        ``attend(layer, queries, keys, values)`` stores the rows' keys/values and returns their attention
        output ``[k, heads, head_dim]``; everything else is per row and row-invariant.
        """
        k = x.shape[0]
        tables = [(cos[:, None], sin[:, None]) for cos, sin in tables]  # broadcast over heads
        heads, kv_heads, head_dim = self._heads, self._kv_heads, self._head_dim
        qk_width = (heads + kv_heads) * head_dim
        half = head_dim // 2
        for i, layer in enumerate(self._layers):
            cos, sin = tables[layer.rope]
            h = self._rms_norm(x, layer.input_norm)
            qkv = layer.qkv(h).to(self._dtype)
            qk = qkv[:, :qk_width].view(k, heads + kv_heads, head_dim)
            if layer.q_norm is not None:
                q = self._rms_norm(qk[:, :heads], layer.q_norm, (head_dim,))
                qk = torch.cat((q, self._rms_norm(qk[:, heads:], layer.k_norm, (head_dim,))), dim=1)
            qk = qk * cos + qk.roll(half, dims=-1) * sin
            attn = attend(i, qk[:, :heads], qk[:, heads:], qkv[:, qk_width:].view(k, kv_heads, head_dim))
            out = layer.o(attn.reshape(k, heads * head_dim))
            if layer.attn_out_norm is not None:
                out = self._rms_norm(out, layer.attn_out_norm)
            x = x + out
            h = self._rms_norm(x, layer.post_norm)
            gate, up = layer.gate_up(h).split(self._intermediate, dim=-1)
            out = layer.down((F.gelu(gate, approximate="tanh") if layer.gelu else F.silu(gate)) * up)
            if layer.mlp_out_norm is not None:
                out = self._rms_norm(out, layer.mlp_out_norm)
            x = x + out
        return x

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The final norm and LM head: float32 logits ``[k, vocab_size]``."""
        h = self._rms_norm(x, self._norm)
        out = self._lm_head(h)[:, : self.vocab_size].float()
        if self._exact_head_rows is not None:
            self._refine_top_logits(out, h)
        return out

    def _refine_top_logits(self, logits: torch.Tensor, hidden: torch.Tensor) -> None:
        """Recompute each row's ``REFINED_LOGITS`` highest logits in float32 from the head's exact rows.

        A quantized head returns bfloat16 logits: 0.125 apart at the magnitudes of SmolLM2's top logits, so
        near-ties between the top tokens would be decided by rounding. Per row (row invariance holds).
        """
        top = logits.topk(REFINED_LOGITS, dim=-1).indices
        rows = self._exact_head_rows(top)  # [k, REFINED_LOGITS, hidden]
        for i in range(logits.shape[0]):
            logits[i, top[i]] = torch.mv(rows[i], hidden[i])

    def _attend_rows(
        self,
        queries: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        new_keys: torch.Tensor,
        new_values: torch.Tensor,
        start: int,
        visible: Sequence[Visible],
        window: int = 0,
    ) -> torch.Tensor:
        """Each query row's attention over its visible slots, one call per row, exactly as a one-token step
        computes it (the new rows' keys/values sit at slots ``start..``); with a sliding ``window``, over the
        last ``window`` of them.

        A tree row (``_Branch``) sees a prefix of the cache, then its ancestors and itself. Those few entries
        are copied to just after the prefix for its call, so it attends over one run of slots ``:end`` laid
        out as the plain step will see it once ``retain`` has compacted the path; the new rows' own entries
        are written back at the end. Rows reading the cache as it is go first; then branches, highest prefix
        first: a branch's copies land at or past its prefix, so they never cover a slot a later row reads.
        (Copying the path instead of gathering every visible slot saves ~10 µs per row and layer at 200
        cached tokens, more with length.)
        """
        q = queries.view(-1, 1, self._kv_heads, self._groups, self._head_dim)
        branches = [j for j, v in enumerate(visible) if isinstance(v, _Branch)]
        branches.sort(key=lambda j: -visible[j].prefix)
        out: list[torch.Tensor | None] = [None] * len(visible)
        for j, v in enumerate(visible):
            if isinstance(v, int):
                first = max(0, v - window) if window else 0
                out[j] = F.scaled_dot_product_attention(
                    q[j], keys[:, :, first:v], values[:, :, first:v], scale=self._scaling
                )
            elif not isinstance(v, _Branch):
                v = v[-window:] if window else v
                out[j] = F.scaled_dot_product_attention(q[j], keys[:, :, v], values[:, :, v], scale=self._scaling)
        for j in branches:
            prefix, rows = visible[j].prefix, visible[j].rows
            end = prefix + rows.numel()
            first = max(0, end - window) if window else 0
            keys[0, :, prefix:end] = new_keys[rows].transpose(0, 1)
            values[0, :, prefix:end] = new_values[rows].transpose(0, 1)
            out[j] = F.scaled_dot_product_attention(
                q[j], keys[:, :, first:end], values[:, :, first:end], scale=self._scaling
            )
        if branches:  # the new rows' own entries back at their slots
            _write(keys, values, start, new_keys, new_values)
        return torch.cat(out)


@torch.inference_mode()
def forward_batch(runners: Sequence[NativeLlamaRunner], tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Append ``tokens[i]`` (a chain, int64 ``[k_i]``) to ``runners[i]``'s cache in ONE pass through the weights.

    The runners share one model's weights, each with its own KV cache. Every matrix sees all rows at once;
    attention runs per row over its own request's keys. Row invariance makes each runner's logits
    ``[k_i, vocab_size]`` bitwise those of its own ``forward(tokens[i])``: a request's output does not depend
    on which requests share the batch.
    """
    lead = runners[0]
    for runner in runners[1:]:
        same_layers = len(runner._layers) == len(lead._layers) and all(
            a is b for a, b in zip(runner._layers, lead._layers, strict=True)
        )
        if not same_layers or runner._norm.data_ptr() != lead._norm.data_ptr():
            raise ValueError("forward_batch needs runners over the same model's weights and layers")
    starts = [runner.length for runner in runners]
    counts = [int(t.shape[0]) for t in tokens]
    for runner, start, k in zip(runners, starts, counts, strict=True):
        runner._reserve(start + k)
    if lead.uses_kernels:
        return lead._run_kernels(runners, tokens, [None] * len(runners), [None] * len(runners), logits=True)
    per_runner = [r._rope_rows(s, s + k, None) for r, s, k in zip(runners, starts, counts, strict=True)]
    tables = [
        (torch.cat([rows[t][0] for rows in per_runner]), torch.cat([rows[t][1] for rows in per_runner]))
        for t in range(len(lead._cos))
    ]
    offsets = [sum(counts[:i]) for i in range(len(counts))]

    def attend(i: int, queries: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
        rows = []
        for runner, start, k, offset in zip(runners, starts, counts, offsets, strict=True):
            mine_keys, mine_values = new_keys[offset : offset + k], new_values[offset : offset + k]
            keys, values = runner._store(i, start, mine_keys, mine_values)
            chain = [start + j + 1 for j in range(k)]
            mine = queries[offset : offset + k]
            window = lead._layers[i].window
            rows.append(runner._attend_rows(mine, keys, values, mine_keys, mine_values, start, chain, window))
        return torch.cat(rows)

    x = lead._decoder_layers(lead._embed_rows(torch.cat(list(tokens))), tables, attend)
    logits = lead._head(x)
    out = []
    for runner, start, k, offset in zip(runners, starts, counts, offsets, strict=True):
        runner._length = start + k
        if runner.capture_hidden:
            runner.hidden = x[offset : offset + k].float()
        out.append(logits[offset : offset + k])
    return out
