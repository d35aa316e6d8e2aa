"""A GGUF file's architecture and tensors, read without parsing its metadata values.

gguf's own ``GGUFReader`` turns every metadata value into numpy views, one per element: the 49,152-token
vocabulary and 48,900 merges of the bundled SmolLM2 took ~9 s of a ~14 s load (Gemma 3's 262,144 tokens more).
Loading a model needs only ``general.architecture``, ``general.alignment``, the tensor index and a few scalar
values (the ones transformers' GGUF reader drops, such as RoPE scaling), so this reader keeps every scalar value
(a number, a bool, a string), steps over arrays (of strings by their lengths, of fixed-size values in one jump)
and gives each tensor's bytes as the same memory-mapped numpy view, shape and type ``GGUFReader`` gives.
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import quant_shape_to_byte_shape

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_FIXED_SIZES = {
    GGUFValueType.UINT8: 1, GGUFValueType.INT8: 1, GGUFValueType.BOOL: 1,
    GGUFValueType.UINT16: 2, GGUFValueType.INT16: 2,
    GGUFValueType.UINT32: 4, GGUFValueType.INT32: 4, GGUFValueType.FLOAT32: 4,
    GGUFValueType.UINT64: 8, GGUFValueType.INT64: 8, GGUFValueType.FLOAT64: 8,
}  # fmt: skip
_SCALAR_FORMATS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.BOOL: "<?",
    GGUFValueType.UINT16: "<H", GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.UINT64: "<Q", GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
Scalar = int | float | bool | str


class UnreadVariant(ValueError):
    """A GGUF file of another byte order or version, which gguf's own reader may read."""


_ELEMENT_TYPES = {
    GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
    GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8, GGMLQuantizationType.I16: np.int16,
    GGMLQuantizationType.I32: np.int32, GGMLQuantizationType.I64: np.int64,
}  # fmt: skip


@dataclass(frozen=True)
class IndexedTensor:
    """One tensor: its GGUF name, type and data (float/int types as elements, block types as bytes per row)."""

    name: str
    tensor_type: GGMLQuantizationType
    data: np.ndarray
    offset: int = -1  # where ``data`` starts in the file's memory map (-1: unknown)
    mapping: mmap.mmap | None = None

    def drop_pages(self, start: int = 0, stop: int | None = None) -> None:
        """Let go of the resident pages of rows ``start:stop`` of ``data`` (they stay in the page cache, no longer
        counted in this process's memory): once the rows are unpacked into the kernels' layout, the map of a file
        read through would otherwise hold a second copy of the weights. A later read maps them back in."""
        if self.mapping is None:
            return
        row = self.data.nbytes // max(self.data.shape[0], 1)
        stop = self.data.shape[0] if stop is None else stop
        begin = (self.offset + start * row) // mmap.PAGESIZE * mmap.PAGESIZE
        end = self.offset + stop * row
        with contextlib.suppress(OSError, ValueError):  # advice only: a platform without it keeps the pages
            self.mapping.madvise(mmap.MADV_DONTNEED, begin, end - begin)


@dataclass(frozen=True)
class GGUFIndex:
    architecture: str | None
    tensors: tuple[IndexedTensor, ...]
    keys: frozenset[str] = frozenset()  # the metadata's keys
    values: dict[str, Scalar] = field(default_factory=dict)  # the scalar values (numbers, bools, strings); no arrays


class _Cursor:
    """Little-endian reads from a buffer, advancing an offset."""

    def __init__(self, buffer) -> None:
        self.buffer, self.at = buffer, 0

    def unpack(self, fmt: str):
        values = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += struct.calcsize(fmt)
        return values

    def u32(self) -> int:
        return self.unpack("<I")[0]

    def u64(self) -> int:
        return self.unpack("<Q")[0]

    def string(self) -> str:
        n = self.u64()
        self.at += n
        return bytes(self.buffer[self.at - n : self.at]).decode("utf-8")

    def skip_value(self, kind: int) -> None:
        if kind == GGUFValueType.STRING:
            n = self.u64()  # not `self.at += self.u64()`: that adds to the offset read before the length
            self.at += n
        elif kind == GGUFValueType.ARRAY:
            element, count = self.u32(), self.u64()
            if element in _FIXED_SIZES:
                self.at += count * _FIXED_SIZES[GGUFValueType(element)]
            else:
                for _ in range(count):
                    self.skip_value(element)
        elif kind in _FIXED_SIZES:
            self.at += _FIXED_SIZES[GGUFValueType(kind)]
        else:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.at}")


def read_gguf_index(path: str | Path) -> GGUFIndex:
    """The file's ``general.architecture`` and tensors; ``UnreadVariant`` where it is not a little-endian GGUF v2/v3
    (the caller may fall back to gguf's own reader), ``ValueError`` where it is not GGUF, is cut short or malformed."""
    data = np.memmap(path, mode="r")
    try:
        return _read_index(path, data)
    except struct.error as error:
        raise ValueError(f"{path}: the GGUF header is cut short ({error})") from None


def _read_index(path: str | Path, data: np.ndarray) -> GGUFIndex:
    cursor = _Cursor(data)
    if bytes(data[:4]) != MAGIC:
        raise ValueError(f"{path} is not a GGUF file")
    cursor.at = 4
    version = cursor.u32()
    if version not in VERSIONS:
        raise UnreadVariant(f"{path}: GGUF version {version} (or another byte order) is not read here")
    tensor_count, kv_count = cursor.u64(), cursor.u64()
    architecture, alignment, keys, values = None, DEFAULT_ALIGNMENT, set(), {}
    for _ in range(kv_count):
        key, kind = cursor.string(), cursor.u32()
        keys.add(key)
        if key == "general.architecture" and kind == GGUFValueType.STRING:
            architecture = values[key] = cursor.string()
        elif key == "general.alignment" and kind == GGUFValueType.UINT32:
            alignment = values[key] = cursor.u32()
        elif kind == GGUFValueType.STRING:
            values[key] = cursor.string()
        elif kind in _SCALAR_FORMATS:
            values[key] = cursor.unpack(_SCALAR_FORMATS[GGUFValueType(kind)])[0]
        else:
            cursor.skip_value(kind)
    if alignment == 0 or alignment & (alignment - 1):
        raise ValueError(f"{path}: alignment {alignment} is not a power of two")
    infos, names = [], set()
    for _ in range(tensor_count):
        name = cursor.string()
        if name in names:
            raise ValueError(f"{path}: tensor {name} appears twice")
        names.add(name)
        dims = cursor.unpack(f"<{cursor.u32()}Q")
        infos.append((name, dims, GGMLQuantizationType(cursor.u32()), cursor.u64()))
    start = -(-cursor.at // alignment) * alignment
    tensors = []
    for name, dims, kind, offset in infos:
        elements = int(np.prod(dims))
        shape = tuple(reversed(dims))
        at = start + offset
        if kind in _ELEMENT_TYPES:
            dtype = np.dtype(_ELEMENT_TYPES[kind])
            view = data[at : at + elements * dtype.itemsize].view(dtype)
        else:
            block, size = GGML_QUANT_SIZES[kind]
            view = data[at : at + elements * size // block]
            shape = quant_shape_to_byte_shape(shape, kind)
        if view.nbytes < int(np.prod(shape)) * view.itemsize:
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        tensors.append(IndexedTensor(name, kind, view.reshape(shape), at, getattr(data, "_mmap", None)))
    return GGUFIndex(architecture, tuple(tensors), frozenset(keys), values)


def read_gguf_index_with_gguf(path: str | Path) -> GGUFIndex:
    """The same from gguf's own ``GGUFReader`` (every byte order and version it reads; slow on large vocabularies)."""
    import gguf

    reader = gguf.GGUFReader(str(path))
    field = reader.fields.get("general.architecture")
    architecture = None if field is None else bytes(field.parts[field.data[0]]).decode()
    tensors = tuple(IndexedTensor(t.name, t.tensor_type, t.data) for t in reader.tensors)
    values = {key: f.contents() for key, f in reader.fields.items()
              if f.types and f.types[0] != GGUFValueType.ARRAY and not key.startswith("GGUF.")}  # fmt: skip
    return GGUFIndex(architecture, tensors, frozenset(reader.fields), values)


def gguf_index(path: str | Path) -> GGUFIndex:
    """``read_gguf_index``, or gguf's reader for a file of another byte order or version; a file cut short or
    malformed is refused with ``read_gguf_index``'s message."""
    try:
        return read_gguf_index(path)
    except UnreadVariant:
        return read_gguf_index_with_gguf(path)
