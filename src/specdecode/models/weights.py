"""Weight formats of a linear layer: dense, int4 groupwise and int8 per-channel, each a callable ``x -> x @ W.T``.

A format is a property of the weights, not of the runner: the native runner and transformers' modules
(through ``QuantizedLinear``) call the same objects. The quantized formats run PyTorch's weight-only CPU
kernels (``_weight_int4pack_mm_for_cpu``, ``_weight_int8pack_mm``) on bfloat16 activations, their fast path;
both are row-invariant (each row of a k-row product is bitwise the one-row product), which the tests check.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

ACTIVATION_DTYPE = torch.bfloat16  # what the weight-only kernels are fast for
GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class GroupQuant:
    """Groupwise asymmetric 4-bit weights: w[n, j] = (q[n, j] − 8)·scale[n, g] + zero[n, g], g = j // group_size."""

    q: torch.Tensor  # uint8 [N, K], values 0..15
    scale: torch.Tensor  # float32 [N, K / group_size]
    zero: torch.Tensor  # float32 [N, K / group_size]
    group_size: int

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        q = self.q.float().view(n, k // self.group_size, self.group_size) - 8
        return (q * self.scale[..., None] + self.zero[..., None]).view(n, k)

    @staticmethod
    def quantize(weight: torch.Tensor, group_size: int) -> GroupQuant:
        """Round each group of ``group_size`` weights onto 16 levels spanning its min..max."""
        n, k = weight.shape
        if group_size not in GROUP_SIZES or k % group_size:
            raise ValueError(f"group size must be one of {GROUP_SIZES} and divide {k}, got {group_size}")
        groups = weight.detach().float().view(n, k // group_size, group_size)
        low, high = groups.amin(-1), groups.amax(-1)
        # Round scale and zero to what the kernel will use first, then pick each q against those.
        scale = _kernel_round(((high - low) / 15).clamp_min(torch.finfo(ACTIVATION_DTYPE).tiny))
        zero = _kernel_round(low + 8 * scale)
        q = torch.round((groups - zero[..., None]) / scale[..., None] + 8).clamp(0, 15).to(torch.uint8).view(n, k)
        return GroupQuant(q, scale, zero, group_size)

    @staticmethod
    def cat(parts: Sequence[GroupQuant]) -> GroupQuant:
        """Stack output rows of several matrices with the same input size and group size."""
        return GroupQuant(
            torch.cat([p.q for p in parts]),
            torch.cat([p.scale for p in parts]),
            torch.cat([p.zero for p in parts]),
            parts[0].group_size,
        )


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

    def to_group_quant(self) -> GroupQuant:
        """4-bit blocks as ``GroupQuant`` (w = (q − 8)·scale + zero) for the pure-torch kernels."""
        if self.bits > 4:
            raise ValueError(f"{self.bits}-bit blocks do not fit GroupQuant's 4 bits")
        zero = self.offset + 8 * self.scale if self.offset is not None else (8 - self.sym) * self.scale
        return GroupQuant(self.u, self.scale, zero, self.group_size)

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

    @staticmethod
    def from_group_quant(weights: GroupQuant) -> IntBlocks:
        return IntBlocks(weights.q, weights.scale, weights.zero - 8 * weights.scale, -1, weights.group_size, 4)

    @staticmethod
    def from_int8(weights: Int8Linear) -> IntBlocks:
        """Int8 rows with one scale per row, as 8-bit blocks of 32 sharing their row's scale."""
        n, k = weights.q.shape
        group = 32 if k % 32 == 0 else 16
        scale = weights.scale.float()[:, None].expand(n, k // group).contiguous()
        half = bool(torch.equal(scale.half().float(), scale))
        u = weights.q.view(torch.uint8) ^ 0x80  # q + 128 for every int8 q, without int16 temporaries
        return IntBlocks(u, scale, None, 128, group, 8, half)


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


BF16_ROWS_PER_CALL = 32  # bfloat16 F.linear is row-invariant from 2 to 32 rows on every CPU measured (AMX: not past)


def _bf16_rows(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.linear`` on 1..``BF16_ROWS_PER_CALL`` rows, a single row as a pair (its own path differs)."""
    return F.linear(x.expand(2, -1), weight)[:1] if x.shape[0] == 1 else F.linear(x, weight)


@dataclass(frozen=True)
class DenseLinear:
    """Dense weights in the model dtype, computed so that each row's result never depends on the row count.

    float32 GEMMs round a row differently for every row count, so each row is its own ``torch.mv`` (a k-row
    call reads the weights k times: the price of bitwise identity). bfloat16 ``F.linear`` is row-invariant from
    2 to 32 rows but takes another path for 1 row, and on a CPU with AMX (oneDNN's tiles) another from 33 rows
    up (measured on an Intel Xeon, family 6 model 207), so rows go in calls of ``BF16_ROWS_PER_CALL`` at most
    and a single row is computed as a pair.
    """

    weight: torch.Tensor  # [N, K]
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if self.weight.dtype == torch.float32:
            y = torch.stack([torch.mv(self.weight, row) for row in x])
        elif rows:
            y = torch.cat([_bf16_rows(part, self.weight) for part in x.split(BF16_ROWS_PER_CALL)])
        else:
            y = F.linear(x, self.weight)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int4Linear:
    """4-bit groupwise weights in torch's packed CPU layout; bfloat16 in and out (bias added in float32)."""

    packed: torch.Tensor  # uint8 [N, K / 2], rows in blocks of 64
    scales_zeros: torch.Tensor  # bfloat16 [K / group_size, N, 2]
    group_size: int
    bias: torch.Tensor | None = None

    @staticmethod
    def from_groups(weights: GroupQuant, bias: torch.Tensor | None = None) -> Int4Linear:
        n = weights.q.shape[0]
        if n % 16:
            raise ValueError(f"int4 weights need a multiple of 16 output rows, got {n}")
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.q.to(torch.int32), 1)
        scales_zeros = torch.stack([weights.scale.t(), weights.zero.t()], dim=-1).to(ACTIVATION_DTYPE).contiguous()
        return Int4Linear(packed, scales_zeros, weights.group_size, _float(bias))

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.to(ACTIVATION_DTYPE), self.packed, self.group_size, self.scales_zeros
        )
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class Int8Linear:
    """8-bit weights with one scale per output row (symmetric); bfloat16 in and out."""

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # bfloat16 [N]
    bias: torch.Tensor | None = None

    @staticmethod
    def quantize(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Int8Linear:
        """w ≈ scale[n]·q[n, j], q = round(w / scale) with scale = max|w[n]| / 127."""
        w = weight.detach().float()
        largest = w.abs().amax(-1)
        scale = (largest / 127).clamp_min(torch.finfo(ACTIVATION_DTYPE).tiny).to(ACTIVATION_DTYPE)
        # The kernel's bfloat16 scale may round down: step it up so that 127 steps still reach the largest weight.
        scale = torch.where(scale.float() * 127 < largest, torch.nextafter(scale, scale.new_tensor(torch.inf)), scale)
        q = torch.round(w / scale.float()[:, None]).clamp(-127, 127).to(torch.int8)
        return Int8Linear(q, scale, _float(bias))

    def dequantize(self) -> torch.Tensor:
        return self.rows(torch.arange(self.q.shape[0]))

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The weights of output rows ``index`` as the kernel sees them, in float32."""
        return self.q[index].float() * self.scale[index].float()[..., None]

    def exact_rows(self) -> Int8Groups:
        """The same weights as an int8 table (one scale per row), sharing ``q``."""
        return Int8Groups(self.q, self.scale.float()[:, None])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int8pack_mm(x.to(ACTIVATION_DTYPE), self.q, self.scale)
        return y if self.bias is None else y + self.bias


@dataclass(frozen=True)
class ConcatLinear:
    """Several formats side by side (outputs concatenated): the fusion of parts that cannot share one matrix."""

    parts: tuple[Linear, ...]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([p(x) for p in self.parts], dim=-1)


@dataclass(frozen=True)
class RowSlice:
    """Output rows ``start:stop`` of a fused matrix, computed through it: a module's view of a fused format that
    costs no memory (the native runner calls the fused matrix itself; transformers' forward calls this)."""

    fused: Int4Linear | Int8Linear | KernelLinear
    start: int
    stop: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[:, self.start : self.stop]


@dataclass(frozen=True)
class KernelLinear:
    """Integer blocks in the compiled kernels' tile layout (``kernels/csrc/weights.h``): float32 in and out, each
    input row quantized to int16 per group, integer dot products, float32 sums in a fixed order (row-invariant)."""

    packed: torch.Tensor  # uint8: 4-bit blocks as nibbles, 5- to 8-bit ones as bytes, tiles of 16 outputs
    scales: torch.Tensor  # float32, float16, or int8 times ``supers`` [tiles, groups, 16]
    offsets: torch.Tensor | None  # as scales, for asymmetric blocks
    supers: torch.Tensor | None  # two-level scales (K-quants): float16 factors [tiles, groups / per, 16]
    super_offsets: torch.Tensor | None  # and the offsets' (asymmetric K-quants)
    bias: torch.Tensor | None  # float32 [N]
    in_features: int
    out_features: int
    group_size: int
    nibbles: bool
    sym: int
    activation_bits: int  # 16, or 8: llama.cpp's numerics (W4A8), twice the multiply rate, a little less exact
    handle: KernelHandle = dataclasses.field(compare=False, repr=False)

    @staticmethod
    def from_blocks(blocks: BlockSource, bias: torch.Tensor | None = None, activation_bits: int = 16) -> KernelLinear:
        """Pack ``blocks`` (groups of 16 or 32, or larger ones split into 32s) and register them with the kernels;
        each input row is quantized to ``activation_bits`` per group. The blocks are read a slice of rows at a
        time (``FileBlocks`` stay in the file until then)."""
        from ..kernels import ops

        kernels = ops()
        if kernels is None:
            raise RuntimeError("the CPU kernels are not available")
        n, k = blocks.shape
        group, bits, sym, symmetric, scale_format = blocks.layout
        repeat = max(group // 32, 1)  # the kernels sum integers per group of ≤ 32: repeat each scale over its 32s
        group //= repeat
        two_level = scale_format.startswith("super")
        per = int(scale_format[5:]) if two_level else 1
        if two_level and repeat > 1:
            raise ValueError("two-level scales come in groups of at most 32")
        nibbles = bits <= 4
        quads = activation_bits == 8 and kernels.quad_layout()
        tiles = _Tiles.zeros(n, k, group, nibbles, scale_format, symmetric, per)
        files = _file_parts(blocks) if repeat == 1 else None
        if files is not None:  # the compiled repacker reads the file's blocks straight into the tiles
            tiles.repack(kernels, files, k, quads)
        else:
            tiles.lay_out(blocks, group, repeat, nibbles, quads)
        packed, scales, offsets, supers, super_offsets = tiles.flat()
        bias = _float(bias)
        matrix = kernels.register_matrix(packed, scales, offsets, bias, n, k, group, nibbles, sym, activation_bits,
                                         supers, super_offsets, per)  # fmt: skip
        handle = KernelHandle(kernels, matrix)
        return KernelLinear(packed, scales, offsets, supers, super_offsets, bias, k, n, group, nibbles, sym,
                            activation_bits, handle)  # fmt: skip

    @staticmethod
    def cat(
        parts: Sequence[BlockSource], bias: torch.Tensor | None = None, activation_bits: int = 16
    ) -> KernelLinear | None:
        """One matrix of ``parts`` stacked by output rows, if they share one layout (else None)."""
        if len({(g, bits <= 4, sym, symmetric, fmt) for g, bits, sym, symmetric, fmt in (p.layout for p in parts)}) > 1:
            return None
        return KernelLinear.from_blocks(StackedBlocks(tuple(parts)), bias, activation_bits)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.handle.kernels.linear(x.reshape(-1, self.in_features).float(), [self.handle.id])


class KernelHandle:
    """A matrix (or a decoder layer) registered with one build of the compiled kernels (``kernels``, whose
    operators run it); released when its holder goes."""

    def __init__(self, kernels, matrix: int = -1, layer: int = -1) -> None:
        self.kernels = kernels
        self.id = matrix if layer < 0 else layer
        self._matrix, self._layer = matrix, layer

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter shutdown there is nothing left to free
            self.kernels.release(self._matrix, self._layer)


def kernel_parts(linear: Linear) -> list[int] | None:
    """The kernel matrices computing ``linear`` side by side, or None if any part is another format."""
    if isinstance(linear, KernelLinear):
        return [linear.handle.id]
    if isinstance(linear, ConcatLinear) and all(isinstance(p, KernelLinear) for p in linear.parts):
        return [p.handle.id for p in linear.parts]
    return None


@dataclass(frozen=True)
class _Tiles:
    """One matrix's buffers in the kernels' layout (``KernelLinear``'s fields), zeroed: nibbles are or-ed into their
    bytes, and the last tile's missing outputs stay zero."""

    packed: torch.Tensor
    scales: torch.Tensor
    offsets: torch.Tensor | None
    supers: torch.Tensor | None
    super_offsets: torch.Tensor | None

    @staticmethod
    def zeros(n: int, k: int, group: int, nibbles: bool, scale_format: str, symmetric: bool, per: int) -> _Tiles:
        tiles = -(-n // 16)
        packed = torch.zeros(tiles * 16 * k // (2 if nibbles else 1), dtype=torch.uint8)
        dtype = {"f16": torch.float16, "f32": torch.float32}.get(scale_format, torch.int8)
        scales = torch.zeros(tiles, k // group, 16, dtype=dtype)
        offsets = None if symmetric else torch.zeros_like(scales)
        two_level = scale_format.startswith("super")
        supers = torch.zeros(tiles, k // group // per, 16, dtype=torch.float16) if two_level else None
        super_offsets = None if symmetric or not two_level else torch.zeros_like(supers)
        return _Tiles(packed, scales, offsets, supers, super_offsets)

    def repack(self, kernels, files: list, k: int, quads: bool) -> None:
        """The GGUF files' blocks decoded and tiled by the kernels (``repack_rows``), ~16 MB of rows at a time, each
        slice's pages let go once read."""
        row0 = 0
        for part in files:
            for start, stop in row_chunks(part.shape[0], k):
                kernels.repack_rows(part.raw_rows(start, stop), part.kind, row0 + start, k, quads, self.packed,
                                    self.scales, self.offsets, self.supers, self.super_offsets)  # fmt: skip
                part.done_rows(start, stop)
            row0 += part.shape[0]

    def lay_out(self, blocks: BlockSource, group: int, repeat: int, nibbles: bool, quads: bool) -> None:
        """Decoded blocks (``IntBlocks`` a slice at a time) laid out by ``_tile_layout`` and ``_per_tile``; each
        scale repeated over the ``repeat`` groups of ≤ 32 its group splits into."""
        n, k = blocks.shape
        for start, stop in row_chunks(n, k):
            part = blocks.rows(start, stop)
            tile = start // 16
            p = _tile_layout(part.u, group, nibbles, quads)
            self.packed[tile * 16 * k // (2 if nibbles else 1) :][: p.numel()] = p
            if part.factors is not None:
                fields = [part.factors.sc, part.factors.mn, part.factors.d, part.factors.m]
            else:
                fields = [part.scale, part.offset, None, None]
            for values, target in zip(
                fields, (self.scales, self.offsets, self.supers, self.super_offsets), strict=True
            ):
                if target is not None:
                    values = values.repeat_interleave(repeat, dim=1) if repeat > 1 else values
                    laid = _per_tile(values, target.dtype)
                    target[tile : tile + laid.shape[0]] = laid

    def flat(self) -> tuple[torch.Tensor | None, ...]:
        """The buffers as the kernels' ``register_matrix`` takes them (one dimension each)."""
        fields = (self.packed, self.scales, self.offsets, self.supers, self.super_offsets)
        return tuple(None if t is None else t.view(-1) for t in fields)


def _file_parts(blocks: BlockSource) -> list | None:
    """The GGUF file blocks (``FileBlocks``) that ``blocks`` stacks, when every part is one the compiled repacker
    reads (``raw_rows``); None sends the blocks through the decoders and ``_tile_layout``."""
    parts = blocks.parts if isinstance(blocks, StackedBlocks) else (blocks,)
    return list(parts) if all(hasattr(p, "raw_rows") for p in parts) else None


def _tile_layout(u: torch.Tensor, group: int, nibbles: bool, quads: bool = False) -> torch.Tensor:
    """The kernels' layout of the integers (``kernels/csrc/weights.h``): outputs in tiles of 16 (zero rows pad the
    last), per tile each group's integers as pairs (2p, 2p+1) per output (nibbles: pair q low, pair q + group/4 high)
    or, for int8 activations on vpdpbusd builds, as quads (4q..4q+3; nibbles: quad 2b low, 2b+1 high)."""
    n, k = u.shape
    tiles = -(-n // 16)
    if tiles * 16 > n:
        u = torch.cat([u, u.new_zeros(tiles * 16 - n, k)])
    groups = k // group
    if quads:
        if nibbles:  # [tile, group, chunk, output, 4]: low nibbles quad 2b, high quad 2b+1
            halves = u.view(tiles, 16, groups, group // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
            pairs = halves[..., 0] | (halves[..., 1] << 4)
        else:
            pairs = u.view(tiles, 16, groups, group // 4, 4).permute(0, 2, 3, 1, 4)
    else:
        pairs = u.view(tiles, 16, groups, group // 2, 2).permute(0, 2, 3, 1, 4)  # [tile, group, pair, output, 2]
        if nibbles:
            quarter = group // 4
            pairs = pairs[:, :, :quarter] | (pairs[:, :, quarter:] << 4)
    return pairs.contiguous().view(-1)


def _per_tile(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-output values [N, columns] (scales, offsets, super-block factors) as the kernels read them:
    [tile, column, 16], zero rows padding the last tile."""
    n, columns = values.shape
    tiles = -(-n // 16)
    if tiles * 16 > n:
        values = torch.cat([values, values.new_zeros(tiles * 16 - n, columns)])
    return values.view(tiles, 16, columns).permute(0, 2, 1).to(dtype).contiguous()


Linear = DenseLinear | Int4Linear | Int8Linear | KernelLinear | ConcatLinear | RowSlice


@dataclass(frozen=True)
class Int8Groups:
    """Int8 rows with one scale per block (GGUF's Q8_0: blocks of 32; a per-row format: one block per row):
    w[n, j] = scale[n, j // block]·q[n, j], exact in float32.

    Called with token ids it is an embedding table that dequantizes only the rows it reads.
    """

    q: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / block]

    def dequantize(self) -> torch.Tensor:
        return self(torch.arange(self.q.shape[0]))

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        q = self.q[tokens].float()
        return (q.view(*q.shape[:-1], self.scale.shape[-1], -1) * self.scale[tokens][..., None]).view(q.shape)

    @staticmethod
    def from_blocks(blocks: BlockSource) -> Int8Groups:
        """Symmetric blocks of up to 8 bits (Q8_0: u = q + 128; Q6_K: u = q + 32, ...) as int8 q = u − sym, read a
        slice of rows at a time."""
        if not int8_rows(blocks):
            raise ValueError("only symmetric blocks of up to 8 bits are int8 rows")
        n, k = blocks.shape
        group, sym = blocks.layout[0], blocks.layout[2]
        q, scale = torch.empty(n, k, dtype=torch.int8), torch.empty(n, k // group)
        for start, stop in row_chunks(n, k):
            part = blocks.rows(start, stop)
            q[start:stop] = (part.u.to(torch.int16) - sym).to(torch.int8)
            scale[start:stop] = part.scale
        return Int8Groups(q, scale)


@dataclass(frozen=True)
class KernelRows:
    """The exact rows of a symmetric ``KernelLinear`` (w = scale·q, q int8), read back from its tile layout: a tied
    head's embedding table and exact rows without a second vocabulary-sized copy. Called with token ids (any
    shape): float32 rows, bitwise what ``Int8Groups`` of the same blocks gives."""

    matrix: KernelLinear

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        handle = self.matrix.handle
        q, scale = handle.kernels.matrix_rows(handle.id, tokens.reshape(-1))
        rows = Int8Groups(q, scale)(torch.arange(q.shape[0]))
        return rows.view(*tokens.shape, self.matrix.in_features)

    def dequantize(self) -> torch.Tensor:
        return self(torch.arange(self.matrix.out_features))


def int8_rows(blocks: BlockSource) -> bool:
    """Blocks whose weights are exactly int8 values times a scale (symmetric types of up to 8 bits)."""
    _, bits, sym, symmetric, _ = blocks.layout
    return symmetric and bits <= 8 and 0 <= sym <= 128


@dataclass(frozen=True)
class DenseEmbedding:
    weight: torch.Tensor

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)


@dataclass(frozen=True)
class FloatRows:
    """A dense table kept in its stored dtype (bfloat16, float16), rows read out in float32 (exact)."""

    weight: torch.Tensor

    def __call__(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight).float()


Embedding = Callable[[torch.Tensor], torch.Tensor]  # token ids -> float rows: DenseEmbedding, Int8Groups, ...


class QuantizedEmbedding(nn.Module):
    """An ``nn.Embedding`` replacement over a quantized table (float32 rows out), times ``embed_scale`` when the
    embedding it replaces scaled its rows (Gemma)."""

    def __init__(
        self, table: Embedding, num_embeddings: int, embedding_dim: int, embed_scale: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.embed_scale = embed_scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.table(ids)
        return rows if self.embed_scale is None else rows * self.embed_scale


def embedding_of(module: nn.Module) -> Embedding:
    """The table behind an ``nn.Embedding`` or a ``QuantizedEmbedding``."""
    if isinstance(module, QuantizedEmbedding):
        return module.table
    return DenseEmbedding(module.weight.detach())


def _kernel_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to the kernels' scale dtype, kept as float32."""
    return x.to(ACTIVATION_DTYPE).float()


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float()


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` replacement that runs a quantized format, so transformers' own forward uses it too."""

    def __init__(
        self,
        kernel: Int4Linear | Int8Linear | KernelLinear | RowSlice,
        in_features: int,
        out_features: int,
        exact_rows: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.kernel = kernel
        self.in_features = in_features
        self.out_features = out_features
        # An LM head may carry its weights' exact rows (float32 by token id): the native runner recomputes
        # the few highest logits of each row from them (see NativeLlamaRunner).
        self.exact_rows = exact_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel(x.reshape(-1, self.in_features))
        return y.to(x.dtype).view(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {type(self.kernel).__name__}"


def linear_of(module: nn.Module) -> Linear:
    """The format object behind a dense ``nn.Linear`` or a ``QuantizedLinear``."""
    if isinstance(module, QuantizedLinear):
        return module.kernel
    bias = None if module.bias is None else module.bias.detach()
    return DenseLinear(module.weight.detach(), bias)


# Fused formats registered by the quantizer, keyed by the first module of the group (q_proj, gate_proj).
_FUSED: weakref.WeakKeyDictionary[nn.Module, Linear] = weakref.WeakKeyDictionary()


def register_fused(modules: Sequence[nn.Module], fused: Linear) -> None:
    """Record that ``fused`` computes ``modules`` side by side (their outputs concatenated)."""
    _FUSED[modules[0]] = fused


def concat_biases(modules: Sequence[nn.Module]) -> torch.Tensor | None:
    """The biases of side-by-side linears as one vector (zeros where a module has none), or None if none has."""
    if all(m.bias is None for m in modules):
        return None
    return torch.cat([m.bias.detach() if m.bias is not None else m.weight.new_zeros(m.out_features) for m in modules])


def fused_of(module: nn.Module) -> Linear | None:
    """The fused format registered for the group that ``module`` leads, if any."""
    return _FUSED.get(module)


def fuse_linears(modules: Sequence[nn.Module]) -> Linear:
    """One format computing ``modules`` side by side (same input).

    Dense weights are concatenated once and each module's weight becomes a view of the result (no extra
    memory); quantized modules use the fused matrix the quantizer registered; anything else runs part by part.
    """
    if all(type(m) is nn.Linear for m in modules):
        fused = torch.cat([m.weight.detach() for m in modules])
        start = 0
        for m in modules:
            m.weight.data = fused[start : start + m.out_features]
            start += m.out_features
        return DenseLinear(fused, concat_biases(modules))
    registered = fused_of(modules[0])
    if registered is not None:
        return registered
    return ConcatLinear(tuple(linear_of(m) for m in modules))
