"""Read a GGUF file's quantized blocks without dequantizing them, in the form our kernels take.

Every integer block type becomes ``IntBlocks``, the file's integers and scales exactly: w = s·(u − o) for the
symmetric types (Q4_0, Q5_0: o = 8, 16 per block of 32; Q6_K: o = 32 per 16; Q8_0: u = q + 128, o = 128) and
w = s·u + m for the others (Q4_1, Q5_1: s = d per 32; Q4_K, Q5_K: s = d·sc_j, m = −dmin·m_j per 32-wide
sub-block). Other types (F32 norms, F16, ...) are dequantized to float32. Tensors are keyed by the transformers
parameter name; Llama's q/k rows are un-permuted as transformers does.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import torch

from ..formats.blocks import IntBlocks, SuperScales
from .index import IndexedTensor, gguf_index

GROUP = 32


def _half(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return _half(blocks, at).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: a 32-wide group stores elements 0..15 in the low and 16..31 in the high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """The 32 fifth bits of a Q5_0/Q5_1 block (a little-endian uint32), element j at bit j, as 0/16."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [..., 32]: byte b's bit i is element 8b + i
    return bits.astype(np.uint8) << 4


def _tensor(values: np.ndarray, dtype) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values.reshape(values.shape[0], -1), dtype=dtype))


def _blocks(u: np.ndarray, scale: np.ndarray, offset: np.ndarray | None, sym: int, bits: int, group: int = GROUP,
            half: bool = False, factors: SuperScales | None = None) -> IntBlocks:  # fmt: skip
    return IntBlocks(
        _tensor(u, np.uint8), _tensor(scale, np.float32), None if offset is None else _tensor(offset, np.float32),
        sym if offset is None else -1, group, bits, half, factors,
    )  # fmt: skip


def _two_level(d: np.ndarray, sc: np.ndarray, dmin: np.ndarray | None, mn: np.ndarray | None) -> SuperScales:
    """A K-quant's per-super-block f16 factors [N, blocks] and per-group integers [N, blocks, per] as ``SuperScales``
    (offsets' factor m = −dmin: negating a float16 is exact)."""
    per = sc.shape[-1]
    m = None if dmin is None else _tensor(-dmin, np.float16)
    return SuperScales(_tensor(d, np.float16), _tensor(sc, np.int8), m, None if mn is None else _tensor(mn, np.int8),
                       per)  # fmt: skip


def decode_q4_0(raw: np.ndarray) -> IntBlocks:
    """Q4_0 blocks (f16 d, 16 bytes of nibbles): w = d·(q − 8)."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    return _blocks(_nibbles(blocks[..., 2:]), _f16(blocks, 0), None, 8, 4, half=True)


def decode_q4_1(raw: np.ndarray) -> IntBlocks:
    """Q4_1 blocks (f16 d, f16 m, 16 bytes of nibbles): w = d·q + m."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    return _blocks(_nibbles(blocks[..., 4:]), _f16(blocks, 0), _f16(blocks, 2), -1, 4, half=True)


def decode_q5_0(raw: np.ndarray) -> IntBlocks:
    """Q5_0 blocks (f16 d, 4 bytes of fifth bits, 16 bytes of nibbles): w = d·(q − 16)."""
    blocks = raw.reshape(raw.shape[0], -1, 22)
    u = _nibbles(blocks[..., 6:]) | _high_bits(blocks[..., 2:6])
    return _blocks(u, _f16(blocks, 0), None, 16, 5, half=True)


def decode_q5_1(raw: np.ndarray) -> IntBlocks:
    """Q5_1 blocks (f16 d, f16 m, 4 bytes of fifth bits, 16 bytes of nibbles): w = d·q + m."""
    blocks = raw.reshape(raw.shape[0], -1, 24)
    u = _nibbles(blocks[..., 8:]) | _high_bits(blocks[..., 4:8])
    return _blocks(u, _f16(blocks, 0), _f16(blocks, 2), -1, 5, half=True)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K/Q5_K super-block, as ggml's get_scale_min_k4."""
    lo, hi = packed[..., 0:4].astype(np.int32), packed[..., 4:8].astype(np.int32)
    tail = packed[..., 8:12].astype(np.int32)
    sc = np.concatenate([lo & 63, (tail & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc.astype(np.int8), mn.astype(np.int8)


def decode_q4_k(raw: np.ndarray) -> IntBlocks:
    """Q4_K super-blocks of 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles).

    Sub-block j: w = d·sc_j·q − dmin·m_j. Each 64-wide chunk stores sub-block 2i in the low nibbles and 2i+1
    in the high nibbles of the same 32 bytes.
    """
    blocks = raw.reshape(raw.shape[0], -1, 144)
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    u = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [N, blocks, 4 chunks, 2 halves, 32]
    scale, offset = _k_scales(d, sc, dmin, mn)
    return _blocks(u, scale, offset, -1, 4, factors=_two_level(d, sc, dmin, mn))


def _k_scales(d, sc, dmin=None, mn=None) -> tuple[np.ndarray, np.ndarray | None]:
    """One-level scales d·sc and offsets −dmin·mn in float32 (exact products) from a K-quant's two levels."""
    scale = d.astype(np.float32)[..., None] * sc.astype(np.float32)
    offset = None if dmin is None else -dmin.astype(np.float32)[..., None] * mn.astype(np.float32)
    return scale, offset


def decode_q5_k(raw: np.ndarray) -> IntBlocks:
    """Q5_K super-blocks of 256 (f16 d, f16 dmin, 12 bytes of scales/mins, 32 bytes of fifth bits, 128 of nibbles).

    As Q4_K, with q = nibble + 16·bit: chunk i's sub-block 2i takes bit 2i and 2i+1 bit 2i+1 of qh[l].
    """
    blocks = raw.reshape(raw.shape[0], -1, 176)
    d, dmin = _half(blocks, 0), _half(blocks, 2)
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qh = blocks[..., 16:48][..., None, None, :]  # [N, blocks, 1, 1, 32]
    qs = blocks[..., 48:].reshape(*blocks.shape[:2], 4, 1, 32)
    shift = (2 * np.arange(4)[:, None] + np.arange(2)[None, :])[..., None].astype(np.uint8)  # [4, 2, 1]
    nibble = np.concatenate([qs & 0x0F, qs >> 4], axis=-2)  # [N, blocks, 4, 2, 32]
    u = nibble | (((qh >> shift) & 1) << 4)
    scale, offset = _k_scales(d, sc, dmin, mn)
    return _blocks(u, scale, offset, -1, 5, factors=_two_level(d, sc, dmin, mn))


def decode_q6_k(raw: np.ndarray) -> IntBlocks:
    """Q6_K super-blocks of 256 (128 bytes of low nibbles, 64 of high 2-bit pairs, 16 int8 scales, f16 d):
    w = d·sc_j·(q − 32) per 16-wide sub-block j. Each half of 128 takes 64 bytes of ql and 32 of qh: elements
    l, l+32, l+64, l+96 are ql[l] low, ql[l+32] low, ql[l] high, ql[l+32] high, with qh[l] bits 0-1, 2-3, 4-5, 6-7.
    """
    blocks = raw.reshape(raw.shape[0], -1, 210)
    d = _half(blocks, 208)
    sc = blocks[..., 192:208].copy().view(np.int8)
    halves = []
    for half in range(2):
        ql = blocks[..., 64 * half : 64 * half + 64]
        qh = blocks[..., 128 + 32 * half : 128 + 32 * half + 32]
        parts = [
            (ql[..., :32] & 0x0F) | ((qh & 3) << 4),
            (ql[..., 32:] & 0x0F) | (((qh >> 2) & 3) << 4),
            (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4),
            (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4),
        ]
        halves.append(np.concatenate(parts, axis=-1))
    u = np.concatenate(halves, axis=-1)
    scale, _ = _k_scales(d, sc)
    return _blocks(u, scale, None, 32, 6, group=16, factors=_two_level(d, sc, None, None))


def decode_q8_0(raw: np.ndarray) -> IntBlocks:
    """Q8_0 blocks (f16 d, 32 int8): w = d·q, stored as u = q + 128."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).astype(np.int16)
    return _blocks((q + 128).astype(np.uint8), _f16(blocks, 0), None, 128, 8, half=True)


_DECODERS = {
    "Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q5_0": decode_q5_0, "Q5_1": decode_q5_1,
    "Q4_K": decode_q4_k, "Q5_K": decode_q5_k, "Q6_K": decode_q6_k, "Q8_0": decode_q8_0,
}  # fmt: skip
BLOCK_TYPES = tuple(_DECODERS)


class FileBlocks:
    """A matrix's blocks where the GGUF file keeps them (a memory-mapped view), decoded to ``IntBlocks`` a slice of
    rows at a time: the whole matrix is never unpacked at once (loading an 8B model keeps the transient small).

    ``order``: the row permutation transformers' loader applies (Llama's q/k), or None for the file's order."""

    def __init__(self, tensor: IndexedTensor, order: torch.Tensor | None = None) -> None:
        self.tensor, self.raw, self.kind, self.order = tensor, tensor.data, tensor.tensor_type.name, order
        first = self.rows(0, 1)
        self.shape = (self.raw.shape[0], first.u.shape[1])
        # Every IntBlocks field but the arrays: the same for every slice of one GGUF type.
        self.layout = first.layout

    def _raw_rows(self, start: int, stop: int) -> np.ndarray:
        if self.order is None:
            return self.raw[start:stop]
        return self.raw[self.order[start:stop].numpy()]

    def rows(self, start: int, stop: int) -> IntBlocks:
        """Rows ``start:stop`` (after the permutation) as ``IntBlocks`` (new arrays: the file's pages are let go)."""
        blocks = _DECODERS[self.kind](np.asarray(self._raw_rows(start, stop)))
        self._drop_pages(start, stop)
        return blocks

    def raw_rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (after the permutation) as the file stores them, uint8 [rows, bytes per row], for the
        kernels' ``repack_rows``; the pages are dropped when ``done_rows`` says they have been read."""
        raw = np.asarray(self._raw_rows(start, stop))
        with warnings.catch_warnings():  # a read-only view of the map: the kernels only read it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(np.ascontiguousarray(raw))

    def done_rows(self, start: int, stop: int) -> None:
        """Rows ``start:stop`` are unpacked: let the file's pages go."""
        self._drop_pages(start, stop)

    def _drop_pages(self, start: int, stop: int) -> None:
        if self.order is None:
            self.tensor.drop_pages(start, stop)
        else:  # permuted rows come from anywhere in the tensor (a q/k projection: small)
            self.tensor.drop_pages()

    def blocks(self) -> IntBlocks:
        """The whole matrix as ``IntBlocks`` (for the pure-torch formats, which need it at once)."""
        return self.rows(0, self.shape[0])

    def dense(self) -> torch.Tensor:
        """The weights in float32 as transformers' loader dequantizes them (gguf's ``dequantize``)."""
        weights = self._dequantize(np.asarray(self._raw_rows(0, self.shape[0])))
        self.tensor.drop_pages()
        return weights

    def dense_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows ``index`` (any shape of row ids) in float32, as ``dense()[index]``: an embedding table that reads
        only the rows it is asked for."""
        flat = index.reshape(-1)
        if self.order is not None:
            flat = self.order[flat]
        return self._dequantize(self.raw[flat.numpy()]).view(*index.shape, self.shape[1])

    def _dequantize(self, raw: np.ndarray) -> torch.Tensor:
        import gguf

        return torch.from_numpy(np.array(gguf.dequantize(raw, gguf.GGMLQuantizationType[self.kind]), np.float32))


StoredTensor = FileBlocks | torch.Tensor


def read_gguf_tensors(
    path: str | Path, model: torch.nn.Module, types: dict[str, str] | None = None
) -> dict[str, StoredTensor]:
    """Every tensor of the GGUF file at ``path``, keyed by ``model``'s parameter name, in its stored format
    (``types``, when given, gets each one's GGUF type name: Q4_K, F32, ...).

    Block types in ``BLOCK_TYPES`` stay in the file (``FileBlocks``, decoded when used); other types (F32 norms,
    F16, ...) are dequantized to float32 and processed as transformers' loader processes them (Gemma's norms
    stored as 1 + w). Rows of Llama's q/k projections are permuted as transformers' loader permutes them.
    ``model`` may be a skeleton with its parameters on the meta device: only its names and config are read.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    names = gguf_to_hf_names(model)
    index = gguf_index(path)
    architecture = index.architecture
    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    found: dict[str, StoredTensor] = {}
    for tensor in index.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue
        kind = tensor.tensor_type.name
        if types is not None:
            types[hf_name] = kind
        if kind in _DECODERS:
            found[hf_name] = FileBlocks(tensor, _rows_order(architecture, tensor.name, model.config,
                                                            tensor.data.shape[0]))  # fmt: skip
        else:
            values = np.array(gguf.dequantize(np.asarray(tensor.data), tensor.tensor_type), dtype=np.float32)
            values = processor.process(weights=values, name=tensor.name).weights
            found[hf_name] = torch.from_numpy(np.array(values, dtype=np.float32))
    return found


def gguf_to_hf_names(model: torch.nn.Module) -> dict[str, str]:
    """transformers' map from GGUF tensor names to ``model``'s parameter names.

    ``get_gguf_hf_weights_map`` recurses into each of the model's ~400 modules and builds gguf's name map for
    the architecture anew in each (~23 ms apiece: 9 s of loading SmolLM2); the map depends only on the
    architecture and layer count, so one is built and reused for the call.
    """
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    from .transformers_speedups import faster_transformers_gguf

    model_type = "llama" if model.config.model_type == "mistral" else None  # gguf has no Mistral: llama.cpp's Llama
    with faster_transformers_gguf():  # gguf's name map built once
        return get_gguf_hf_weights_map(model, TensorProcessor(), model_type)


def _rows_order(architecture: str, name: str, config, rows: int) -> torch.Tensor | None:
    """The row order transformers' loader gives a q/k projection of this GGUF architecture (llama.cpp stores
    Llama's permuted for its RoPE layout), or None when it keeps the file's order."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, LlamaTensorProcessor

    if TENSOR_PROCESSORS.get(architecture) is not LlamaTensorProcessor:
        return None
    if not (".attn_q." in name or ".attn_k." in name):
        return None
    processor = LlamaTensorProcessor(config=config.to_dict())
    return torch.from_numpy(processor.process(np.arange(rows), name).weights.copy())
