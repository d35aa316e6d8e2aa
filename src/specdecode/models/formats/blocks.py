"""Integer weights as a GGUF file stores them, and reading them a slice of rows at a time: ``IntBlocks`` (the
integers, their scales and offsets, and K-quants' two-level scales), ``StackedBlocks`` (several sources by output
rows), ``row_chunks`` (the ~16 MB slices every repacking walks) and ``int8_rows`` (which blocks are exact int8)."""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SuperScales:
    """A K-quant's scales as its file stores them, two levels: per group g of a row, scale = d[g // per]·sc[g] and
    offset = m[g // per]·mn[g] (m = −dmin), float16 factors per super-block of ``per`` groups times small integers.
    Each product is exact in float32 (11 × 8 significant bits), so the kernels compute the one-level scales bitwise
    from a quarter of their bytes."""

    d: torch.Tensor  # float16 [N, G / per]
    sc: torch.Tensor  # int8 [N, G]
    m: torch.Tensor | None  # float16 [N, G / per], asymmetric types only
    mn: torch.Tensor | None  # int8 [N, G]
    per: int

    def rows(self, index) -> SuperScales:
        """Output rows ``index`` (a slice or a tensor of row ids)."""
        m, mn = (None, None) if self.m is None else (self.m[index], self.mn[index])
        return SuperScales(self.d[index], self.sc[index], m, mn, self.per)

    @staticmethod
    def cat(parts: Sequence[SuperScales]) -> SuperScales:
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        mn = None if parts[0].mn is None else torch.cat([p.mn for p in parts])
        return SuperScales(torch.cat([p.d for p in parts]), torch.cat([p.sc for p in parts]), m, mn, parts[0].per)


@dataclass(frozen=True)
class IntBlocks:
    """Integer weights exactly as a GGUF file stores them, per group g = j // group_size of each row:
    w[n, j] = scale[n, g]·(u[n, j] − sym) for symmetric types (Q4_0, Q5_0, Q6_K, Q8_0: ``offset`` None), else
    scale[n, g]·u[n, j] + offset[n, g] (Q4_1, Q5_1, Q4_K, Q5_K). u is unsigned, below 2**bits."""

    u: torch.Tensor  # uint8 [N, K]
    scale: torch.Tensor  # float32 [N, K / group_size]
    offset: torch.Tensor | None  # float32 [N, K / group_size]
    sym: int  # the zero point of a symmetric type; −1 when ``offset`` is given
    group_size: int
    bits: int
    half_scales: bool = False  # every scale and offset is exactly a float16 value (the file's own fields)
    factors: SuperScales | None = None  # the same scales and offsets in two levels (K-quants), for the kernels

    def dequantize(self) -> torch.Tensor:
        """The weights in float32 (computed in float64, rounded once)."""
        n, k = self.u.shape
        u = self.u.double().view(n, k // self.group_size, self.group_size)
        scale = self.scale.double()[..., None]
        w = scale * (u - self.sym) if self.offset is None else scale * u + self.offset.double()[..., None]
        return w.view(n, k).float()

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.u.shape)

    @property
    def layout(self) -> Layout:
        """(group size, bits, sym, symmetric, scale format): what blocks must share to be stacked into one matrix."""
        return self.group_size, self.bits, self.sym, self.offset is None, self.scale_format

    @property
    def scale_format(self) -> str:
        """How the kernels store the scales: "super" (``factors``), "f16" (``half_scales``) or "f32"."""
        if self.factors is not None:
            return f"super{self.factors.per}"
        return "f16" if self.half_scales else "f32"

    def blocks(self) -> IntBlocks:
        return self

    def dense(self) -> torch.Tensor:
        return self.dequantize()

    def dense_rows(self, index: torch.Tensor) -> torch.Tensor:
        return self.take(index.reshape(-1)).dequantize().view(*index.shape, -1)

    def take(self, index: torch.Tensor | slice) -> IntBlocks:
        """Output rows ``index`` (a slice or a tensor of row ids)."""
        offset = None if self.offset is None else self.offset[index]
        factors = None if self.factors is None else self.factors.rows(index)
        return dataclasses.replace(self, u=self.u[index], scale=self.scale[index], offset=offset, factors=factors)

    def rows(self, start: int, stop: int) -> IntBlocks:
        return self.take(slice(start, stop))

    @staticmethod
    def cat(parts: Sequence[IntBlocks]) -> IntBlocks:
        """Blocks of one layout stacked by output rows."""
        first = parts[0]
        offset = None if first.offset is None else torch.cat([p.offset for p in parts])
        factors = None if first.factors is None else SuperScales.cat([p.factors for p in parts])
        return dataclasses.replace(first, u=torch.cat([p.u for p in parts]), scale=torch.cat([p.scale for p in parts]),
                                   offset=offset, factors=factors)  # fmt: skip


Layout = tuple[int, int, int, bool, str]  # IntBlocks.layout


class BlockSource(Protocol):
    """Integer blocks that can be read a slice of rows at a time: ``IntBlocks`` in memory, ``FileBlocks`` in a
    GGUF file, or ``StackedBlocks`` of either."""

    shape: tuple[int, int]
    layout: Layout

    def rows(self, start: int, stop: int) -> IntBlocks: ...


@dataclass(frozen=True)
class StackedBlocks:
    """Several block sources of one layout stacked by output rows (q/k/v, gate/up), read without copying them."""

    parts: tuple[BlockSource, ...]

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def layout(self) -> Layout:
        return self.parts[0].layout

    def rows(self, start: int, stop: int) -> IntBlocks:
        pieces, at = [], 0
        for part in self.parts:
            n = part.shape[0]
            if start < at + n and stop > at:
                pieces.append(part.rows(max(start - at, 0), min(stop - at, n)))
            at += n
        return pieces[0] if len(pieces) == 1 else IntBlocks.cat(pieces)


CHUNK_BYTES = 1 << 24  # a matrix is unpacked and laid out ~16 MB of weights at a time


def row_chunks(rows: int, cols: int) -> Iterator[tuple[int, int]]:
    """Row slices of ~``CHUNK_BYTES`` unpacked weights, each a whole number of 16-output tiles but the last; the
    previous slice's freed temporaries go back to the system before the next (else glibc keeps them: ~250 MB of
    a 1.7B-shaped file's peak)."""
    step = max(16, CHUNK_BYTES // max(cols, 1) // 16 * 16)
    for start in range(0, rows, step):
        yield start, min(start + step, rows)
        return_freed_memory()


def return_freed_memory() -> None:
    """Hand freed memory back to the system (``malloc_trim``); a no-op where the C library has none."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def int8_rows(blocks: BlockSource) -> bool:
    """Blocks whose weights are exactly int8 values times a scale (symmetric types of up to 8 bits)."""
    _, bits, sym, symmetric, _ = blocks.layout
    return symmetric and bits <= 8 and 0 <= sym <= 128
