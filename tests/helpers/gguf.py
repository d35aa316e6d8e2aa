"""Tiny GGUF files written in-process the way llama.cpp's converter writes them: random blocks of every type in
the layouts the loading tests read (no tokenizer)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 96
FIELDS = {  # bytes per block, offsets of the f16 fields, weights per block
    "Q4_0": (18, (0,), 32), "Q4_1": (20, (0, 2), 32), "Q5_0": (22, (0,), 32), "Q5_1": (24, (0, 2), 32),
    "Q4_K": (144, (0, 2), 256), "Q5_K": (176, (0, 2), 256), "Q6_K": (210, (208,), 256), "Q8_0": (34, (0,), 32),
}  # fmt: skip

LAYOUTS = {  # per layer: q, k, v, o, gate, up, down — every block type the kernels take
    "q4-q5": ("Q4_0", "Q4_0", "Q4_0", "Q4_1", "Q5_0", "Q5_0", "Q5_1"),
    "k-quants": ("Q4_K", "Q4_K", "Q4_K", "Q5_K", "Q6_K", "Q6_K", "Q8_0"),
    "mixed": ("Q5_0", "Q5_0", "Q6_K", "Q8_0", "Q4_K", "Q4_K", "Q6_K"),  # mixed within q/k/v, as Q4_K_M files are
    "five-bit": ("Q5_0", "Q5_0", "Q5_1", "Q5_K", "Q5_1", "Q5_1", "Q5_K"),  # every 5-bit type: nibbles + high bits
}

MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")


def random_blocks(kind: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Random blocks of ``kind`` for a [rows, cols] matrix, their f16 scale fields small enough for sane logits."""
    size, halves, per_block = FIELDS[kind]
    raw = rng.integers(0, 256, size=(rows, cols // per_block, size), dtype=np.uint8)
    scale = 0.002 if kind in ("Q8_0", "Q6_K") else 0.02
    for at in halves:
        raw[..., at : at + 2] = (
            rng.uniform(-scale, scale, (rows, cols // per_block, 1)).astype(np.float16).view(np.uint8)
        )
    return raw.reshape(rows, -1)


def write_gguf(
    path: Path, kinds: tuple[str, ...], head: str | None = None, architecture: str = "llama", embedding: str = "Q8_0"
) -> Path:
    """A tiny Llama-architecture GGUF (no tokenizer): random blocks of ``kinds`` per layer, an ``embedding``-typed
    embedding, tied to the head unless ``head`` names the type of a separate ``output.weight``."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), architecture)
    arch = architecture
    writer.add_uint32(f"{arch}.context_length", 512)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.block_count", LAYERS)
    writer.add_uint32(f"{arch}.feed_forward_length", FFN)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_uint32(f"{arch}.rope.dimension_count", HIDDEN // HEADS)
    writer.add_uint32(f"{arch}.vocab_size", VOCAB)
    writer.add_float32(f"{arch}.rope.freq_base", 10000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    embed_type = gguf.GGMLQuantizationType[embedding]
    writer.add_tensor("token_embd.weight", random_blocks(embedding, VOCAB, HIDDEN, rng), raw_dtype=embed_type)
    if head is not None:
        kind = gguf.GGMLQuantizationType[head]
        writer.add_tensor("output.weight", random_blocks(head, VOCAB, HIDDEN, rng), raw_dtype=kind)
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    kv = KV_HEADS * HIDDEN // HEADS
    shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
              "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
              "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    for i in range(LAYERS):
        for name, kind in zip(MATRICES, kinds, strict=True):
            rows, cols = shapes[name]
            writer.add_tensor(f"blk.{i}.{name}.weight", random_blocks(kind, rows, cols, rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
