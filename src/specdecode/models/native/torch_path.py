"""The native runner's plain-PyTorch path (``runner``): RMSNorm in float32, RoPE from precomputed tables, the decoder
stack, the head, and attention one call per row over exactly that row's keys (row invariance), token-tree rows
included; one pass over the new rows of one or several caches (``torch_pass``).

Quantized weights run with a float32 residual stream and bfloat16 inputs to PyTorch's weight-only kernels; grouped-
query attention goes through ``scaled_dot_product_attention`` with the query heads of each key/value head packed
together.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import KVCache, write_rows
from .layers import REFINED_LOGITS, Decoder

Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class _Branch:
    """A tree row's visible slots: cache slots ``0..prefix-1``, then the new rows ``rows`` (its ancestors and
    itself, as indices into this call's rows), in that order."""

    prefix: int
    rows: torch.Tensor


# Per row of a forward: a prefix length, a tree branch, or any other set of slot indices (gathered).
Visible = int | _Branch | torch.Tensor


def last_visible(mask: torch.Tensor, window: int) -> torch.Tensor:
    """``mask`` [k, n] (True = may attend) with each row keeping only its last ``window`` True entries (a sliding
    window over the row's visible keys, in slot order); ``window`` 0 keeps every entry."""
    if not window:
        return mask
    seen = mask.to(torch.int32).cumsum(dim=1)
    return mask & (seen > seen[:, -1:] - window)


def torch_pass(
    decoder: Decoder,
    caches: Sequence[KVCache],
    tokens: Sequence[torch.Tensor],
    positions: Sequence[torch.Tensor | None],
    masks: Sequence[torch.Tensor | None],
    logits: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One pass of the decoder stack over every cache's new rows (``tokens[i]`` at slots ``caches[i].length..``, the
    caches reserved already; ``positions`` and ``masks`` as ``forward`` takes them): every matrix sees all rows at
    once, attention runs per row over its own cache's keys. Returns the last layer's rows and, if asked, the logits.
    The caches' lengths are left for the caller to advance."""
    starts = [cache.length for cache in caches]
    counts = [int(chunk.shape[0]) for chunk in tokens]
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    per_cache = [
        cache.rope_rows(start, start + k, where)
        for cache, start, k, where in zip(caches, starts, counts, positions, strict=True)
    ]
    tables = per_cache[0]
    if len(caches) > 1:
        tables = [(torch.cat([rows[t][0] for rows in per_cache]), torch.cat([rows[t][1] for rows in per_cache]))
                  for t in range(len(tables))]  # fmt: skip
    # None: one row over every slot up to its own (a plain step)
    visible = [
        visible_keys(start, k, mask) if k > 1 or mask is not None else None
        for start, k, mask in zip(starts, counts, masks, strict=True)
    ]
    kv_heads, groups, head_dim = decoder.kv_heads, decoder.groups, decoder.head_dim

    def attend(i: int, queries: torch.Tensor, new_keys: torch.Tensor, new_values: torch.Tensor) -> torch.Tensor:
        window = decoder.layers[i].window
        rows = []
        for cache, start, k, offset, seen in zip(caches, starts, counts, offsets, visible, strict=True):
            mine_keys, mine_values = new_keys[offset : offset + k], new_values[offset : offset + k]
            keys, values = cache.store(i, start, mine_keys, mine_values)
            mine = queries[offset : offset + k]
            if seen is None:
                end = start + 1
                first = end - window if 0 < window < end else 0
                q = mine.view(1, kv_heads, groups, head_dim)
                rows.append(
                    F.scaled_dot_product_attention(
                        q, keys[:, :, first:end], values[:, :, first:end], scale=decoder.scaling
                    )
                )
            else:
                rows.append(attend_rows(decoder, mine, keys, values, mine_keys, mine_values, start, seen, window))
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    x = decoder_layers(decoder, embed_rows(decoder, tokens[0] if len(tokens) == 1 else torch.cat(list(tokens))),
                       tables, attend)  # fmt: skip
    return x, head(decoder, x) if logits else None


def rms_norm(
    decoder: Decoder, x: torch.Tensor, weight: torch.Tensor, shape: tuple[int, ...] | None = None
) -> torch.Tensor:
    """As LlamaRMSNorm (normalise in float32, cast back, then scale) or Gemma3RMSNorm (scale by ``1 + w`` in
    float32, then cast back) over the last dims ``shape`` (the hidden size by default); one fused kernel
    in float32."""
    shape = shape or decoder.hidden_shape
    if decoder.dtype == torch.float32:
        return F.rms_norm(x.float(), shape, weight, decoder.eps)
    normed = F.rms_norm(x.float(), shape, eps=decoder.eps)
    if decoder.arch.unit_offset_norms:
        return (normed * weight).to(decoder.dtype)
    return weight * normed.to(decoder.dtype)


def embed_rows(decoder: Decoder, tokens: torch.Tensor) -> torch.Tensor:
    """The embedding rows of ``tokens`` in the residual stream's dtype (times Gemma's scale)."""
    x = decoder.embed(tokens).to(decoder.dtype)
    return x if decoder.embed_scale is None else x * decoder.embed_scale


def visible_keys(start: int, k: int, attn_mask: torch.Tensor | None) -> list[Visible]:
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


def decoder_layers(
    decoder: Decoder, x: torch.Tensor, tables: Sequence[tuple[torch.Tensor, torch.Tensor]], attend: Attend
) -> torch.Tensor:
    """The decoder stack over rows ``x``, with per RoPE table its (cos, signed sin) rows ``[k, head_dim]``.

    ``attend(layer, queries, keys, values)`` stores the rows' keys/values and returns their attention
    output ``[k, heads, head_dim]``; everything else is per row and row-invariant.
    """
    k = x.shape[0]
    tables = [(cos[:, None], sin[:, None]) for cos, sin in tables]  # broadcast over heads
    heads, kv_heads, head_dim = decoder.heads, decoder.kv_heads, decoder.head_dim
    qk_width = (heads + kv_heads) * head_dim
    half = head_dim // 2
    for i, layer in enumerate(decoder.layers):
        cos, sin = tables[layer.rope]
        h = rms_norm(decoder, x, layer.input_norm)
        qkv = layer.qkv(h).to(decoder.dtype)
        qk = qkv[:, :qk_width].view(k, heads + kv_heads, head_dim)
        if layer.q_norm is not None:
            q = rms_norm(decoder, qk[:, :heads], layer.q_norm, (head_dim,))
            qk = torch.cat((q, rms_norm(decoder, qk[:, heads:], layer.k_norm, (head_dim,))), dim=1)
        qk = qk * cos + qk.roll(half, dims=-1) * sin
        attn = attend(i, qk[:, :heads], qk[:, heads:], qkv[:, qk_width:].view(k, kv_heads, head_dim))
        out = layer.o(attn.reshape(k, heads * head_dim))
        if layer.attn_out_norm is not None:
            out = rms_norm(decoder, out, layer.attn_out_norm)
        x = x + out
        h = rms_norm(decoder, x, layer.post_norm)
        gate, up = layer.gate_up(h).split(decoder.intermediate, dim=-1)
        out = layer.down((F.gelu(gate, approximate="tanh") if layer.gelu else F.silu(gate)) * up)
        if layer.mlp_out_norm is not None:
            out = rms_norm(decoder, out, layer.mlp_out_norm)
        x = x + out
    return x


def head(decoder: Decoder, x: torch.Tensor) -> torch.Tensor:
    """The final norm and LM head: float32 logits ``[k, vocab_size]``."""
    h = rms_norm(decoder, x, decoder.norm)
    out = decoder.lm_head(h)[:, : decoder.vocab_size].float()
    if decoder.exact_head_rows is not None:
        _refine_top_logits(decoder, out, h)
    return out


def _refine_top_logits(decoder: Decoder, logits: torch.Tensor, hidden: torch.Tensor) -> None:
    """Recompute each row's ``REFINED_LOGITS`` highest logits in float32 from the head's exact rows.

    A quantized head returns bfloat16 logits: 0.125 apart at the magnitudes of SmolLM2's top logits, so
    near-ties between the top tokens would be decided by rounding. Per row (row invariance holds).
    """
    top = logits.topk(REFINED_LOGITS, dim=-1).indices
    rows = decoder.exact_head_rows(top)  # [k, REFINED_LOGITS, hidden]
    for i in range(logits.shape[0]):
        logits[i, top[i]] = torch.mv(rows[i], hidden[i])


def attend_rows(
    decoder: Decoder,
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
    scaling = decoder.scaling
    q = queries.view(-1, 1, decoder.kv_heads, decoder.groups, decoder.head_dim)
    branches = [j for j, v in enumerate(visible) if isinstance(v, _Branch)]
    branches.sort(key=lambda j: -visible[j].prefix)
    out: list[torch.Tensor | None] = [None] * len(visible)
    for j, v in enumerate(visible):
        if isinstance(v, int):
            first = max(0, v - window) if window else 0
            out[j] = F.scaled_dot_product_attention(q[j], keys[:, :, first:v], values[:, :, first:v], scale=scaling)
        elif not isinstance(v, _Branch):
            v = v[-window:] if window else v
            out[j] = F.scaled_dot_product_attention(q[j], keys[:, :, v], values[:, :, v], scale=scaling)
    for j in branches:
        prefix, rows = visible[j].prefix, visible[j].rows
        end = prefix + rows.numel()
        first = max(0, end - window) if window else 0
        keys[0, :, prefix:end] = new_keys[rows].transpose(0, 1)
        values[0, :, prefix:end] = new_values[rows].transpose(0, 1)
        out[j] = F.scaled_dot_product_attention(q[j], keys[:, :, first:end], values[:, :, first:end], scale=scaling)
    if branches:  # the new rows' own entries back at their slots
        write_rows(keys, values, start, new_keys, new_values)
    return torch.cat(out)
