"""The native runner's static KV cache (``runner``): allocation and growth, rollback, tree-branch
retention, and the RoPE tables sized with it.

Layouts: on the torch path keys and values ``[layers, 1, kv_heads, capacity, head_dim]`` in the residual
dtype; for the compiled kernels float16, keys in tiles of 16 slots ``[layers, kv_heads, tiles, head_dim, 16]``
and values ``[layers, kv_heads, capacity, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ..runner import check_retained_slots
from .layers import KERNEL_CACHE_DTYPE


def write_rows(
    keys: torch.Tensor, values: torch.Tensor, start: int, new_keys: torch.Tensor, new_values: torch.Tensor
) -> None:
    """Store rows' keys/values ``[k, kv_heads, head_dim]`` at slots ``start..`` of a layer's cache."""
    end = start + new_keys.shape[0]
    keys[0, :, start:end] = new_keys.transpose(0, 1)
    values[0, :, start:end] = new_values.transpose(0, 1)


@dataclass(frozen=True)
class KVRows:
    """Cache entries ``start..start+tokens-1`` copied out of a runner, in its layout (``export_rows``), to append
    to a runner over the same weights (``append_rows``). On the kernels' layout the keys come as whole tiles
    of 16 slots (a last partial tile's extra lanes are never read: they sit past the length)."""

    keys: torch.Tensor
    values: torch.Tensor
    tokens: int

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


class KVCacheSlots:
    """The runner's cache bookkeeping (a mixin of ``NativeLlamaRunner``: ``_length`` tokens held in
    ``_capacity`` slots)."""

    # ``prefill`` stores what one-token steps store, so a kept prefix continues bitwise as a fresh prefill would
    exact_prefix_reuse = True

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
        write_rows(keys, values, start, new_keys, new_values)
        return keys, values

    @torch.inference_mode()
    def export_rows(self, start: int, end: int) -> KVRows:
        """A copy of the cache entries at slots ``start..end-1`` (on the kernels, ``start`` a multiple of 16)."""
        if not 0 <= start < end <= self._length:
            raise ValueError(f"export_rows({start}, {end}) outside 0..{self._length}")
        if self.uses_kernels:
            if start % 16:
                raise ValueError(f"export_rows on the kernels' layout starts at a multiple of 16, got {start}")
            keys = self._keys[:, :, start // 16 : -(-end // 16)].clone()
            return KVRows(keys, self._values[:, :, start:end].clone(), end - start)
        return KVRows(self._keys[..., start:end, :].clone(), self._values[..., start:end, :].clone(), end - start)

    @torch.inference_mode()
    def append_rows(self, rows: KVRows) -> None:
        """Append entries copied by ``export_rows`` (from a runner over the same weights) at slots ``length..``.

        The entries are the very bits a prefill of their tokens at those positions stores (row invariance:
        ``prefill`` stores what one-token steps store), so a runner fed this way continues bitwise as one
        that prefilled the same tokens."""
        start, end = self._length, self._length + rows.tokens
        self._reserve(end)
        if self.uses_kernels:
            if start % 16:
                raise ValueError(f"append_rows on the kernels' layout starts at a multiple of 16, got {start}")
            tiles = rows.keys.shape[2]
            self._keys[:, :, start // 16 : start // 16 + tiles] = rows.keys
            self._values[:, :, start:end] = rows.values
        else:
            self._keys[..., start:end, :] = rows.keys
            self._values[..., start:end, :] = rows.values
        self._length = end
