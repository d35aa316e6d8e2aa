"""Integer blocks on the compiled kernels: ``KernelLinear`` (a matrix in their tile layout, registered with them),
the layout itself (``_tile_layout``, ``_per_tile``) and the two ways a matrix gets there — the kernels' own
``repack_rows`` from a GGUF file's blocks, or decoded ``IntBlocks`` laid out here."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from .blocks import BlockSource, StackedBlocks, row_chunks

# 5-bit blocks (Q5_0, Q5_1, Q5_K) held as nibbles plus a plane of their fifth bits, 5/8 of a byte per weight;
# False holds them one byte per weight as before (the same integers, so bitwise the same outputs: the tests'
# comparison path).
HIGH_BIT_PLANES = True


@dataclass(frozen=True)
class KernelLinear:
    """Integer blocks in the compiled kernels' tile layout (``kernels/csrc/weights.h``): float32 in and out, each
    input row quantized to int16 per group, integer dot products, float32 sums in a fixed order (row-invariant)."""

    packed: torch.Tensor  # uint8, tiles of 16 outputs: 4-bit blocks as nibbles, 5-bit ones as nibbles + high bits,
    # 6- to 8-bit ones as bytes (weights.h)
    scales: torch.Tensor  # float32, float16, or int8 times ``supers`` [tiles, groups, 16]
    offsets: torch.Tensor | None  # as scales, for asymmetric blocks
    supers: torch.Tensor | None  # two-level scales (K-quants): float16 factors [tiles, groups / per, 16]
    super_offsets: torch.Tensor | None  # and the offsets' (asymmetric K-quants)
    bias: torch.Tensor | None  # float32 [N]
    in_features: int
    out_features: int
    group_size: int
    nibbles: bool  # the low 4 bits as nibbles (4- and 5-bit blocks)
    high_bits: bool  # and a plane of fifth bits (5-bit blocks)
    sym: int
    activation_bits: int  # 16, or 8: llama.cpp's numerics (W4A8), twice the multiply rate, a little less exact
    handle: KernelHandle = field(compare=False, repr=False)

    @staticmethod
    def from_blocks(blocks: BlockSource, bias: torch.Tensor | None = None, activation_bits: int = 16) -> KernelLinear:
        """Pack ``blocks`` (groups of 16 or 32, or larger ones split into 32s) and register them with the kernels;
        each input row is quantized to ``activation_bits`` per group. The blocks are read a slice of rows at a
        time (``FileBlocks`` stay in the file until then)."""
        from ...kernels import ops

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
        nibbles, high_bits = packing_of(bits, group)
        quads = activation_bits == 8 and kernels.quad_layout()
        tiles = _Tiles.zeros(n, k, group, (nibbles, high_bits), scale_format, symmetric, per)
        files = _file_parts(blocks) if repeat == 1 else None
        if files is not None:  # the compiled repacker reads the file's blocks straight into the tiles
            tiles.repack(kernels, files, k, quads, high_bits)
        else:
            tiles.lay_out(blocks, group, repeat, (nibbles, high_bits), quads)
        packed, scales, offsets, supers, super_offsets = tiles.flat()
        bias = _float(bias)
        matrix = kernels.register_matrix(packed, scales, offsets, bias, n, k, group, nibbles, sym, activation_bits,
                                         supers, super_offsets, per, high_bits)  # fmt: skip
        handle = KernelHandle(kernels, matrix)
        return KernelLinear(packed, scales, offsets, supers, super_offsets, bias, k, n, group, nibbles, high_bits,
                            sym, activation_bits, handle)  # fmt: skip

    @staticmethod
    def cat(
        parts: Sequence[BlockSource], bias: torch.Tensor | None = None, activation_bits: int = 16
    ) -> KernelLinear | None:
        """One matrix of ``parts`` stacked by output rows, if they share one layout (else None)."""
        keys = {
            (g, packing_of(bits, min(g, 32)), sym, symmetric, fmt)
            for g, bits, sym, symmetric, fmt in (p.layout for p in parts)
        }
        if len(keys) > 1:
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
    def zeros(
        n: int, k: int, group: int, packing: tuple[bool, bool], scale_format: str, symmetric: bool, per: int
    ) -> _Tiles:
        """``packing``: (nibbles, high bits), as ``packing_of`` gives them. Every step streams these buffers whole:
        they go on huge pages where the OS allows (``kernels.streamed_zeros``)."""
        from ...kernels import streamed_zeros

        tiles = -(-n // 16)
        packed = streamed_zeros((tiles * 16 * packed_row_bytes(k, *packing),), torch.uint8)
        dtype = {"f16": torch.float16, "f32": torch.float32}.get(scale_format, torch.int8)
        scales = streamed_zeros((tiles, k // group, 16), dtype)
        offsets = None if symmetric else streamed_zeros(tuple(scales.shape), dtype)
        two_level = scale_format.startswith("super")
        supers = streamed_zeros((tiles, k // group // per, 16), torch.float16) if two_level else None
        super_offsets = None if symmetric or not two_level else streamed_zeros(tuple(supers.shape), torch.float16)
        return _Tiles(packed, scales, offsets, supers, super_offsets)

    def repack(self, kernels, files: list, k: int, quads: bool, high_bits: bool) -> None:
        """The GGUF files' blocks decoded and tiled by the kernels (``repack_rows``), ~16 MB of rows at a time, each
        slice's pages let go once read."""
        row0 = 0
        for part in files:
            for start, stop in row_chunks(part.shape[0], k):
                kernels.repack_rows(part.raw_rows(start, stop), part.kind, row0 + start, k, quads, self.packed,
                                    self.scales, self.offsets, self.supers, self.super_offsets, high_bits)  # fmt: skip
                part.done_rows(start, stop)
            row0 += part.shape[0]

    def lay_out(self, blocks: BlockSource, group: int, repeat: int, packing: tuple[bool, bool], quads: bool) -> None:
        """Decoded blocks (``IntBlocks`` a slice at a time) laid out by ``_tile_layout`` and ``_per_tile``; each
        scale repeated over the ``repeat`` groups of ≤ 32 its group splits into."""
        n, k = blocks.shape
        for start, stop in row_chunks(n, k):
            part = blocks.rows(start, stop)
            tile = start // 16
            p = _tile_layout(part.u, group, packing[0], quads, packing[1])
            self.packed[tile * 16 * packed_row_bytes(k, *packing) :][: p.numel()] = p
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


def packing_of(bits: int, group: int) -> tuple[bool, bool]:
    """(nibbles, high bits): how the kernels hold ``bits``-bit integers in groups of ``group`` (≤ 32)."""
    high_bits = HIGH_BIT_PLANES and bits == 5 and group == 32
    return bits <= 4 or high_bits, high_bits


def packed_row_bytes(k: int, nibbles: bool, high_bits: bool = False) -> int:
    """Packed bytes per output row of ``k`` inputs: a byte per weight, half of one (nibbles) or 5/8 (high bits)."""
    return k * 5 // 8 if high_bits else k // 2 if nibbles else k


def _tile_layout(
    u: torch.Tensor, group: int, nibbles: bool, quads: bool = False, high_bits: bool = False
) -> torch.Tensor:
    """The kernels' layout of the integers (``kernels/csrc/weights.h``): outputs in tiles of 16 (zero rows pad the
    last), per tile each group's integers as pairs (2p, 2p+1) per output (nibbles: pair q low, pair q + group/4 high)
    or, for int8 activations on vpdpbusd builds, as quads (4q..4q+3; nibbles: quad 2b low, 2b+1 high). High bits:
    each group's nibbles of u & 15, then its plane of fifth bits, per nibble chunk its low nibbles' bits then its
    high nibbles', little-endian."""
    n, k = u.shape
    tiles = -(-n // 16)
    if tiles * 16 > n:
        u = torch.cat([u, u.new_zeros(tiles * 16 - n, k)])
    groups = k // group
    if quads:
        if nibbles:  # [tile, group, chunk, output, 4, half]: low nibbles quad 2b, high quad 2b+1
            halves = u.view(tiles, 16, groups, group // 8, 2, 4).permute(0, 2, 3, 1, 5, 4)
            low, high = halves[..., 0], halves[..., 1]
        else:
            pairs = u.view(tiles, 16, groups, group // 4, 4).permute(0, 2, 3, 1, 4)
    else:
        pairs = u.view(tiles, 16, groups, group // 2, 2).permute(0, 2, 3, 1, 4)  # [tile, group, pair, output, 2]
        if nibbles:
            quarter = group // 4
            low, high = pairs[:, :, :quarter], pairs[:, :, quarter:]
    if not nibbles:
        return pairs.contiguous().view(-1)
    chunks = low.shape[2]  # [tile, group, chunk, lanes...]: each chunk's nibble bytes in order
    nibble_bytes = ((low & 15) | ((high & 15) << 4)).reshape(tiles, groups, -1)
    if not high_bits:
        return nibble_bytes.contiguous().view(-1)
    fifth = torch.stack([low.reshape(tiles, groups, chunks, -1), high.reshape(tiles, groups, chunks, -1)], 3) >> 4
    weights = 1 << torch.arange(8, dtype=torch.int32)
    plane = (fifth.reshape(tiles, groups, -1, 8).int() * weights).sum(-1).to(torch.uint8)
    return torch.cat([nibble_bytes, plane], -1).contiguous().view(-1)


def _per_tile(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-output values [N, columns] (scales, offsets, super-block factors) as the kernels read them:
    [tile, column, 16], zero rows padding the last tile."""
    n, columns = values.shape
    tiles = -(-n // 16)
    if tiles * 16 > n:
        values = torch.cat([values, values.new_zeros(tiles * 16 - n, columns)])
    return values.view(tiles, 16, columns).permute(0, 2, 1).to(dtype).contiguous()


def _float(bias: torch.Tensor | None) -> torch.Tensor | None:
    return None if bias is None else bias.detach().float()
