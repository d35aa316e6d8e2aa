"""The tensors of a Hugging Face folder's safetensors checkpoint, read one at a time from disk.

A safetensors file is an 8-byte little-endian header length, a JSON header (name → dtype, shape, byte offsets
into the data that follows) and the raw tensors. ``Checkpoint`` reads the headers of ``model.safetensors`` or of
the shards ``model.safetensors.index.json`` names, and a tensor only when asked, with ``readinto`` into a tensor of
its own (no memory map): a load holds the tensors it keeps and the one it is reading, never the file's pages.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}  # fmt: skip
FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class Checkpoint(Mapping[str, torch.Tensor]):
    """Name → tensor of a folder's safetensors files; ``checkpoint[name]`` reads that tensor (a fresh copy)."""

    def __init__(self, files: Mapping[str, Path]) -> None:
        self._where: dict[str, tuple[Path, torch.dtype, tuple[int, ...], int, int]] = {}
        for path in sorted(set(files.values())):
            with open(path, "rb") as handle:
                (length,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(length))
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                if entry["dtype"] not in _DTYPES:
                    raise ValueError(f"{path.name}: tensor {name} has dtype {entry['dtype']}, which is not read here")
                start, stop = entry["data_offsets"]
                self._where[name] = (path, _DTYPES[entry["dtype"]], tuple(entry["shape"]), 8 + length + start,
                                     stop - start)  # fmt: skip

    def __getitem__(self, name: str) -> torch.Tensor:
        path, dtype, shape, offset, size = self._where[name]
        tensor = torch.empty(shape, dtype=dtype)
        with open(path, "rb") as handle:
            handle.seek(offset)
            if handle.readinto(memoryview(tensor.view(-1).view(torch.uint8).numpy())) != size:
                raise ValueError(f"{path.name} is cut short: tensor {name} is incomplete")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __len__(self) -> int:
        return len(self._where)

    @property
    def dtype(self) -> torch.dtype | None:
        """The float dtype holding most of the weights' bytes (None when no tensor is a float)."""
        found: dict[torch.dtype, int] = {}
        for _, dtype, _, _, size in self._where.values():
            if dtype in FLOAT_DTYPES:
                found[dtype] = found.get(dtype, 0) + size
        return max(found, key=found.__getitem__) if found else None


def checkpoint_of(folder: Path) -> Checkpoint | None:
    """The safetensors checkpoint of an HF folder (one file or shards), or None when it has none."""
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    if single.is_file():
        return Checkpoint({"": single})
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return Checkpoint({name: folder / shard for name, shard in weight_map.items()})
    return None
