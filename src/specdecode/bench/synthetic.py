"""GGUF files of random weights in real models' shapes, with the bundled SmolLM2's tokenizer: stand-ins for timing
and memory (load time, peak RSS, step, prefill, v(k)) next to llama.cpp on the same file. Their text is noise, so
acceptance cannot be measured on them.

Q4_K matrices with Q6_K ``ffn_down`` / ``attn_v`` on llama.cpp's Q4_K_M layer pattern; where a row is not a multiple
of 256 (the 360M shape's 960) llama.cpp's fallbacks, Q5_0 for Q4_K and Q8_0 for Q6_K. A tied embedding is Q8_0 (as
the bundled file's); an untied model's is Q4_K with a Q6_K head, as a Q4_K_M file of Llama 3.1 8B has. A vocabulary
larger than the tokenizer's is padded with unused tokens, so the embedding and head have the real model's rows.
Files are written once under the cache (``synthetic_path``), in tensor order, never holding more than one matrix.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from ..disk_cache import cache_root

Q = gguf.GGMLQuantizationType
FORMAT = 1  # bump when the files written change: older cached files are then not reused
_FILE_TYPE_Q4_K_M = 15  # llama.cpp's LLAMA_FTYPE_MOSTLY_Q4_K_M
_SCALES = {Q.Q4_K: 3e-4, Q.Q5_0: 3e-3, Q.Q6_K: 2e-4, Q.Q8_0: 2e-3}  # f16 block scales that keep activations sane


@dataclass(frozen=True)
class Shape:
    """A Llama-architecture decoder's dimensions (``vocab`` None: the tokenizer's own size)."""

    model: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int | None = None
    tied: bool = True

    def __post_init__(self) -> None:
        if self.hidden % self.heads or self.heads % self.kv_heads or self.hidden % 32 or self.ffn % 32:
            raise ValueError(f"{self.model}: hidden and ffn must be multiples of 32, heads of kv_heads: {self}")


SHAPES = {
    "360m": Shape("SmolLM2-360M", 960, 32, 15, 5, 2560, 49152, tied=True),
    "1.7b": Shape("SmolLM2-1.7B", 2048, 24, 32, 32, 8192, 49152, tied=True),
    "8b": Shape("Llama-3.1-8B", 4096, 32, 32, 8, 14336, 128256, tied=False),
}
Progress = Callable[[int, int], None]  # (bytes written so far, bytes in all)


def parse_shapes(text: str) -> list[str]:
    """A comma list of shape names (``SHAPES``), in order, each once; a ValueError names what is allowed."""
    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    if not names:
        raise ValueError(f"--synthetic is empty; choose from {', '.join(SHAPES)}")
    for name in names:
        if name not in SHAPES:
            raise ValueError(f"unknown --synthetic shape {name!r}; choose from {', '.join(SHAPES)}")
    return list(dict.fromkeys(names))


def synthetic_path(name: str) -> Path:
    """Where the file of shape ``name`` lives: ``<cache>/synthetic/`` (``$SPECDECODE_CACHE`` or
    ``~/.cache/specdecode``), reused while ``FORMAT`` holds."""
    return cache_root() / "synthetic" / f"{name}-random-q4_k_m-v{FORMAT}.gguf"


def synthetic_gguf(name: str, on_progress: Progress | None = None) -> tuple[Path, bool]:
    """The cached file of shape ``name`` (written first if absent) and whether it was written now."""
    path = synthetic_path(name)
    if path.is_file():
        return path, False
    write_synthetic_gguf(path, SHAPES[name], on_progress=on_progress)
    return path, True


def _types(shape: Shape, layer: int) -> dict[str, tuple[int, int, Q]]:
    """(rows, cols, block type) of each matrix of ``layer``: Q4_K_M's pattern, Q6_K on the first and last eighth
    of the layers and every third one between, and llama.cpp's fallbacks for rows that are not K-quant sized."""
    hidden, kv = shape.hidden, shape.kv_heads * (shape.hidden // shape.heads)
    heavy = Q.Q6_K if layer < shape.layers // 8 or layer >= 7 * shape.layers // 8 or layer % 3 == 2 else Q.Q4_K
    mats = {
        "attn_q": (hidden, hidden, Q.Q4_K),
        "attn_k": (kv, hidden, Q.Q4_K),
        "attn_v": (kv, hidden, heavy),
        "attn_output": (hidden, hidden, Q.Q4_K),
        "ffn_gate": (shape.ffn, hidden, Q.Q4_K),
        "ffn_up": (shape.ffn, hidden, Q.Q4_K),
        "ffn_down": (hidden, shape.ffn, heavy),
    }
    return {name: (rows, cols, _fallback(qtype, cols)) for name, (rows, cols, qtype) in mats.items()}


def _fallback(qtype: Q, cols: int) -> Q:
    """``qtype``, or llama.cpp's replacement where a row does not split into 256-weight super-blocks."""
    if cols % 256 == 0 or qtype not in (Q.Q4_K, Q.Q6_K):
        return qtype
    return {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[qtype]


def _blocks(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``qtype`` for a rows x cols matrix, as bytes [rows, cols / per block x block bytes]."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // per
    raw = np.frombuffer(rng.bytes(n * size), dtype=np.uint8).reshape(n, size).copy()
    scale = np.full((n, 1), _SCALES[qtype], dtype=np.float16).view(np.uint8)
    if qtype in (Q.Q5_0, Q.Q8_0):
        raw[:, 0:2] = scale
    elif qtype == Q.Q4_K:
        raw[:, 0:2] = scale  # d
        raw[:, 2:4] = scale  # dmin
    elif qtype == Q.Q6_K:
        raw[:, 192:208] = rng.integers(-32, 32, size=(n, 16), dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = scale
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return raw.reshape(rows, cols // per * size)


def _tensors(shape: Shape, vocab: int) -> list[tuple[str, int, int, Q | None]]:
    """(name, rows, cols, block type or None for float32) of every tensor, in file order."""
    out: list[tuple[str, int, int, Q | None]] = [
        ("token_embd.weight", vocab, shape.hidden, Q.Q8_0 if shape.tied else _fallback(Q.Q4_K, shape.hidden))
    ]
    if not shape.tied:
        out.append(("output.weight", vocab, shape.hidden, _fallback(Q.Q6_K, shape.hidden)))
    out.append(("output_norm.weight", 1, shape.hidden, None))
    for i in range(shape.layers):
        for name, (rows, cols, qtype) in _types(shape, i).items():
            out.append((f"blk.{i}.{name}.weight", rows, cols, qtype))
        out += [(f"blk.{i}.{norm}.weight", 1, shape.hidden, None) for norm in ("attn_norm", "ffn_norm")]
    return out


def _nbytes(rows: int, cols: int, qtype: Q | None) -> int:
    if qtype is None:
        return rows * cols * 4
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    return rows * cols // per * size


def weight_bytes(shape: Shape, vocab: int | None = None) -> int:
    """The bytes of a file's tensors for ``shape`` (``vocab``: the tokenizer's size where the shape has none)."""
    return sum(_nbytes(rows, cols, qtype) for _, rows, cols, qtype in _tensors(shape, shape.vocab or vocab))


def _copy_metadata(reader: gguf.GGUFReader, writer: gguf.GGUFWriter, shape: Shape, vocab: int) -> None:
    """The source's keys (tokenizer, chat template, RoPE) with ``shape``'s dimensions; a per-token array padded
    with unused tokens up to ``vocab``."""
    head_dim = shape.hidden // shape.heads
    values = {
        "llama.embedding_length": shape.hidden,
        "llama.block_count": shape.layers,
        "llama.attention.head_count": shape.heads,
        "llama.attention.head_count_kv": shape.kv_heads,
        "llama.feed_forward_length": shape.ffn,
        "llama.rope.dimension_count": head_dim,
        "llama.vocab_size": vocab,
        "general.file_type": _FILE_TYPE_Q4_K_M,
    }
    tokens = len(reader.fields["tokenizer.ggml.tokens"].contents())
    padding = {
        "tokenizer.ggml.tokens": [f"<|synthetic_unused_{i}|>" for i in range(tokens, vocab)],
        "tokenizer.ggml.token_type": [int(gguf.TokenType.UNUSED)] * (vocab - tokens),
    }
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.name", "general.size_label"):
            continue
        vtype = field.types[0]
        if key in values:
            writer.add_key_value(key, values[key], vtype)
        elif vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents() + padding.get(key, []), vtype, field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    writer.add_name(f"{shape.model} shape, random weights")
    writer.add_size_label(f"{shape.model} (random weights)")


def write_synthetic_gguf(
    path: Path, shape: Shape, source: Path | None = None, on_progress: Progress | None = None, seed: int = 0
) -> Path:
    """Write ``path``: a Llama GGUF of ``shape`` with random blocks (``seed``) and the tokenizer of ``source`` (the
    bundled SmolLM2 by default). Written beside ``path`` and renamed into place, so a file there is whole."""
    if source is None:
        from ..models.loading.bundled import BUNDLED

        source = BUNDLED["smollm2"].gguf_path()
    reader = gguf.GGUFReader(source)
    tokens = len(reader.fields["tokenizer.ggml.tokens"].contents())
    vocab = shape.vocab or tokens
    if vocab < tokens:
        raise ValueError(f"{shape.model}: vocabulary {vocab} is smaller than the tokenizer's {tokens} tokens")
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.partial")
    tensors = _tensors(shape, vocab)
    total, done = weight_bytes(shape, vocab), 0
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(staging), "llama")
    try:
        _copy_metadata(reader, writer, shape, vocab)
        for name, rows, cols, qtype in tensors:
            if qtype is None:
                writer.add_tensor_info(name, (cols,), np.dtype(np.float32), rows * cols * 4)
            else:
                nbytes = _nbytes(rows, cols, qtype)
                writer.add_tensor_info(name, (rows, nbytes // rows), np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for _, rows, cols, qtype in tensors:  # one matrix in memory at a time
            data = np.ones(cols, dtype=np.float32) if qtype is None else _blocks(qtype, rows, cols, rng)
            writer.write_tensor_data(data)
            done += data.nbytes
            if on_progress is not None:
                on_progress(done, total)
        writer.close()
        staging.rename(path)
    except BaseException:
        writer.close()
        staging.unlink(missing_ok=True)
        raise
    return path
