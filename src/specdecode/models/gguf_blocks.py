"""Read a GGUF file's quantized blocks without dequantizing them, in the form our kernels take.

4-bit types become ``GroupQuant`` (w = (q − 8)·scale + zero per group of 32, q in 0..15), exactly as stored:
Q4_0 (w = d·(q − 8)), Q4_1 (w = d·q + m) and Q4_K (w = d·sc_j·q − dmin·m_j per 32-wide sub-block).
Q8_0 (w = d·q, q int8 per group of 32) becomes ``Int8Groups``. Every other type is dequantized to float32.
Tensors are keyed by the transformers parameter name; Llama's q/k rows are un-permuted as transformers does.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .weights import GroupQuant, Int8Groups

GROUP = 32


def _f16(blocks: np.ndarray, at: int) -> np.ndarray:
    return blocks[..., at : at + 2].copy().view(np.float16)[..., 0].astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """ggml's 4-bit layout: a 32-wide group stores elements 0..15 in the low and 16..31 in the high nibbles."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _group_quant(q: np.ndarray, scale: np.ndarray, zero: np.ndarray) -> GroupQuant:
    n = q.shape[0]
    return GroupQuant(
        torch.from_numpy(np.ascontiguousarray(q.reshape(n, -1), dtype=np.uint8)),
        torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32)),
        torch.from_numpy(np.ascontiguousarray(zero.reshape(n, -1), dtype=np.float32)),
        GROUP,
    )


def decode_q4_0(raw: np.ndarray) -> GroupQuant:
    """Q4_0 blocks (f16 d, 16 bytes of nibbles) → scale d, zero 0."""
    blocks = raw.reshape(raw.shape[0], -1, 18)
    d = _f16(blocks, 0)
    return _group_quant(_nibbles(blocks[..., 2:]), d, np.zeros_like(d))


def decode_q4_1(raw: np.ndarray) -> GroupQuant:
    """Q4_1 blocks (f16 d, f16 m, 16 bytes of nibbles): w = d·q + m = (q − 8)·d + (m + 8d)."""
    blocks = raw.reshape(raw.shape[0], -1, 20)
    d, m = _f16(blocks, 0), _f16(blocks, 2)
    return _group_quant(_nibbles(blocks[..., 4:]), d, m + 8 * d)


def _q4_k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit (scale, min) pairs of a Q4_K super-block, as ggml's get_scale_min_k4."""
    lo, hi = packed[..., 0:4].astype(np.int32), packed[..., 4:8].astype(np.int32)
    tail = packed[..., 8:12].astype(np.int32)
    sc = np.concatenate([lo & 63, (tail & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mn = np.concatenate([hi & 63, (tail >> 4) | ((hi >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def decode_q4_k(raw: np.ndarray) -> GroupQuant:
    """Q4_K super-blocks of 256 (f16 d, f16 dmin, 12 bytes of 6-bit scales/mins, 128 bytes of nibbles).

    Sub-block j: w = d·sc_j·q − dmin·m_j, so scale = d·sc_j and zero = 8·scale − dmin·m_j. Each 64-wide chunk
    stores sub-block 2i in the low nibbles and 2i+1 in the high nibbles of the same 32 bytes.
    """
    blocks = raw.reshape(raw.shape[0], -1, 144)
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _q4_k_scales(blocks[..., 4:16])
    qs = blocks[..., 16:].reshape(*blocks.shape[:2], 4, 32)
    q = np.stack([qs & 0x0F, qs >> 4], axis=-2)  # [N, blocks, 4 chunks, 2 halves, 32]
    scale = d[..., None] * sc
    zero = 8 * scale - dmin[..., None] * mn
    return _group_quant(q, scale, zero)


def decode_q8_0(raw: np.ndarray) -> Int8Groups:
    """Q8_0 blocks (f16 d, 32 int8)."""
    blocks = raw.reshape(raw.shape[0], -1, 34)
    n = blocks.shape[0]
    q = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(n, -1)
    return Int8Groups(torch.from_numpy(q.copy()), torch.from_numpy(np.ascontiguousarray(_f16(blocks, 0))))


_DECODERS = {"Q4_0": decode_q4_0, "Q4_1": decode_q4_1, "Q4_K": decode_q4_k, "Q8_0": decode_q8_0}
BLOCK_TYPES = tuple(_DECODERS)

StoredTensor = GroupQuant | Int8Groups | torch.Tensor


def read_gguf_tensors(path: str | Path, model: torch.nn.Module) -> dict[str, StoredTensor]:
    """Every tensor of the GGUF file at ``path``, keyed by ``model``'s parameter name, in its stored format.

    Block types in ``BLOCK_TYPES`` keep their blocks; other types are dequantized to float32 (e.g. F32 norms,
    Q6_K, Q5_K). Rows of Llama's q/k projections are permuted as transformers' loader permutes them.
    """
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor, get_gguf_hf_weights_map

    names = get_gguf_hf_weights_map(model, TensorProcessor())
    reader = gguf.GGUFReader(str(path))
    field = reader.fields["general.architecture"]
    architecture = bytes(field.parts[field.data[0]]).decode()
    found: dict[str, StoredTensor] = {}
    for tensor in reader.tensors:
        hf_name = names.get(tensor.name)
        if hf_name is None:
            continue
        kind = tensor.tensor_type.name
        raw = np.asarray(tensor.data)
        if kind in _DECODERS:
            stored = _DECODERS[kind](raw)
        else:
            stored = torch.from_numpy(np.array(gguf.dequantize(raw, tensor.tensor_type), dtype=np.float32))
        perm = _rows_order(architecture, tensor.name, model.config, _rows(stored))
        found[hf_name] = stored if perm is None else _take_rows(stored, perm)
    return found


def _rows(stored: StoredTensor) -> int:
    return stored.q.shape[0] if isinstance(stored, GroupQuant | Int8Groups) else stored.shape[0]


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


def _take_rows(stored: StoredTensor, order: torch.Tensor) -> StoredTensor:
    if isinstance(stored, GroupQuant):
        return GroupQuant(stored.q[order], stored.scale[order], stored.zero[order], stored.group_size)
    if isinstance(stored, Int8Groups):
        return Int8Groups(stored.q[order], stored.scale[order])
    return stored[order]
