"""The native runner's KV cache (``runner``): its keys and values in the layout its path reads, the RoPE tables sized
with it, growth, rollback, tree-branch retention, and copying entries between caches over the same weights.

Layouts: on the torch path keys and values ``[layers, 1, kv_heads, capacity, head_dim]`` in the residual
dtype; for the compiled kernels float16, keys in tiles of 16 slots ``[layers, kv_heads, tiles, head_dim, 16]``
and values ``[layers, kv_heads, capacity, head_dim]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..runner import KVRows, check_retained_slots
from .architecture import Rope
from .layers import KERNEL_CACHE_DTYPE


def write_rows(
    keys: torch.Tensor, values: torch.Tensor, start: int, new_keys: torch.Tensor, new_values: torch.Tensor
) -> None:
    """Store rows' keys/values ``[k, kv_heads, head_dim]`` at slots ``start..`` of a layer's cache."""
    end = start + new_keys.shape[0]
    keys[0, :, start:end] = new_keys.transpose(0, 1)
    values[0, :, start:end] = new_values.transpose(0, 1)


class KVCache:
    """``length`` tokens held in ``capacity`` slots: ``keys`` and ``values`` of every layer, and per RoPE table the
    (cos, signed sin) rows ``cos`` / ``signed_sin`` of every slot. Rollback is a length reset (the slots are
    overwritten later); the capacity doubles on demand, never past ``max_capacity`` by doubling (a pass that needs
    more, a token tree at the cap, gets exactly its slots)."""

    def __init__(
        self,
        layers: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        ropes: Sequence[Rope],
        kernels: bool,
        capacity: int,
        max_capacity: int | None = None,
    ) -> None:
        self.kernels = kernels  # the compiled kernels' layout (else the torch path's)
        self.length = 0
        self.capacity = 0
        self.max_capacity = max_capacity
        self._layers, self._kv_heads, self._head_dim = layers, kv_heads, head_dim
        self._dtype, self._device, self._ropes = dtype, device, tuple(ropes)
        self._allocate(capacity)

    def rollback_to(self, length: int) -> None:
        """Drop cache entries past ``length``: the slots are simply overwritten later."""
        if not 0 <= length <= self.length:
            raise ValueError(f"rollback_to({length}) outside 0..{self.length}")
        self.length = length

    @torch.inference_mode()
    def retain(self, start: int, slots: Sequence[int]) -> None:
        """Keep the cache entries at ``slots`` (ascending, in ``start..length-1``), moved to ``start, start+1, ...``.

        After a token-tree pass this keeps the accepted branch: ``length`` becomes ``start + len(slots)``.
        """
        slots = check_retained_slots(start, slots, self.length)
        m = len(slots)
        if m and int(slots[-1]) != start + m - 1:  # not already in place
            if self.kernels:  # keys in tiles of 16 slots: slot s is (tile s // 16, lane s % 16)
                for to, at in enumerate(slots.tolist(), start):
                    if to != at:
                        self.keys[:, :, to // 16, :, to % 16] = self.keys[:, :, at // 16, :, at % 16]
            else:
                self.keys[..., start : start + m, :] = self.keys[..., slots, :]
            self.values[..., start : start + m, :] = self.values[..., slots, :]
        self.length = start + m

    def reset(self) -> None:
        """Empty the cache."""
        self.length = 0

    def reserve(self, end: int) -> None:
        """Grow the cache (doubling, up to ``max_capacity``) so that slots up to ``end`` exist."""
        if end > self.capacity:
            doubled = 2 * self.capacity
            self._allocate(max(end, doubled if self.max_capacity is None else min(doubled, self.max_capacity)))

    def advance(self, k: int) -> None:
        """``k`` more entries are held: a pass wrote them at slots ``length..length+k-1``."""
        self.length += k

    def store(
        self, layer: int, start: int, new_keys: torch.Tensor, new_values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[k, kv_heads, head_dim]`` keys/values at slots ``start..`` (the torch path's layout); return the
        layer's cache."""
        keys, values = self.keys[layer], self.values[layer]
        write_rows(keys, values, start, new_keys, new_values)
        return keys, values

    def rope_rows(
        self, start: int, end: int, positions: torch.Tensor | None
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per RoPE table, the (cos, signed sin) rows of slots ``start..end-1`` or of ``positions``."""
        where = slice(start, end) if positions is None else positions
        return [(cos[where], sin[where]) for cos, sin in zip(self.cos, self.signed_sin, strict=True)]

    @torch.inference_mode()
    def export_rows(self, start: int, end: int) -> KVRows:
        """A copy of the cache entries at slots ``start..end-1`` (on the kernels, ``start`` a multiple of 16: the keys
        come as whole tiles of 16 slots, a last partial tile's extra lanes past the length, never read)."""
        if not 0 <= start < end <= self.length:
            raise ValueError(f"export_rows({start}, {end}) outside 0..{self.length}")
        if self.kernels:
            if start % 16:
                raise ValueError(f"export_rows on the kernels' layout starts at a multiple of 16, got {start}")
            keys = self.keys[:, :, start // 16 : -(-end // 16)].clone()
            return KVRows(keys, self.values[:, :, start:end].clone(), end - start)
        return KVRows(self.keys[..., start:end, :].clone(), self.values[..., start:end, :].clone(), end - start)

    @torch.inference_mode()
    def append_rows(self, rows: KVRows) -> None:
        """Append entries copied by ``export_rows`` (from a cache over the same weights) at slots ``length..``.

        The entries are the very bits a prefill of their tokens at those positions stores (row invariance:
        ``prefill`` stores what one-token steps store), so a runner fed this way continues bitwise as one
        that prefilled the same tokens."""
        start, end = self.length, self.length + rows.tokens
        self.reserve(end)
        if self.kernels:
            if start % 16:
                raise ValueError(f"append_rows on the kernels' layout starts at a multiple of 16, got {start}")
            tiles = rows.keys.shape[2]
            self.keys[:, :, start // 16 : start // 16 + tiles] = rows.keys
            self.values[:, :, start:end] = rows.values
        else:
            self.keys[..., start:end, :] = rows.keys
            self.values[..., start:end, :] = rows.values
        self.length = end

    @torch.inference_mode()
    def _allocate(self, capacity: int) -> None:
        """(Re)allocate the KV cache and RoPE tables for ``capacity`` slots, keeping the cached entries."""
        n = self.length
        if self.kernels:  # the kernels' layout: keys in tiles of 16 slots [layers, kv_heads, tiles, head_dim, 16]
            capacity = -(-capacity // 16) * 16
            layers, kv_heads, d = self._layers, self._kv_heads, self._head_dim
            keys = torch.zeros((layers, kv_heads, capacity // 16, d, 16), dtype=KERNEL_CACHE_DTYPE)
            values = torch.zeros((layers, kv_heads, capacity, d), dtype=KERNEL_CACHE_DTYPE)
            if n:
                tiles = -(-n // 16)
                keys[:, :, :tiles] = self.keys[:, :, :tiles]
                values[..., :n, :] = self.values[..., :n, :]
        else:
            shape = (self._layers, 1, self._kv_heads, capacity, self._head_dim)
            keys = torch.empty(shape, dtype=self._dtype, device=self._device)
            values = torch.empty(shape, dtype=self._dtype, device=self._device)
            if n:
                keys[..., :n, :] = self.keys[..., :n, :]
                values[..., :n, :] = self.values[..., :n, :]
        self.keys, self.values = keys, values
        self.slots = torch.arange(capacity, device=self._device)
        self.cos: list[torch.Tensor] = []
        self.signed_sin: list[torch.Tensor] = []
        for rope in self._ropes:  # one table per RoPE base (Gemma 3: local and global layers)
            # As transformers' rotary embedding: float32 angles, cos/sin scaled, then cast to the model dtype.
            freqs = self.slots[:, None].float() * rope.inv_freq.to(self._device)
            emb = torch.cat((freqs, freqs), dim=-1)
            self.cos.append((emb.cos() * rope.attention_scaling).to(self._dtype))
            sin = (emb.sin() * rope.attention_scaling).to(self._dtype)
            # rotate_half(x) * sin == swap_halves(x) * [-sin_a, sin_b] exactly: fold the sign into the table.
            half = self._head_dim // 2
            self.signed_sin.append(torch.cat((-sin[:, :half], sin[:, half:]), dim=-1))
        self.capacity = capacity
