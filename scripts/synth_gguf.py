#!/usr/bin/env python3
"""Write a GGUF with random weights in the shape of a bigger sibling of the bundled SmolLM2, keeping its
tokenizer and chat template: a stand-in for timing and memory (step time, v(k), load time, RSS) next to
llama.cpp on the same file. The text it writes is noise; acceptance cannot be measured on it.

Usage: .venv/bin/python scripts/synth_gguf.py OUT.gguf SHAPE [SOURCE.gguf]
(SHAPE: 360m | 1.7b | 8b; SOURCE: the bundled SmolLM2 by default, for its tokenizer.) Q4_K matrices, Q6_K
ffn_down and attn_v as llama.cpp's Q4_K_M does, a Q8_0 embedding tied to the head; where a row is not a multiple
of 256 (the 360M shape's 960) llama.cpp's fallbacks: Q5_0 for Q4_K, Q8_0 for Q6_K. Generated, never committed:
scripts/load_cost.py measures load, memory and speed on the result."""

import sys

import gguf
import numpy as np

SHAPES = {  # hidden, layers, heads, kv heads, ffn
    "360m": (960, 32, 15, 5, 2560),
    "1.7b": (2048, 24, 32, 32, 8192),
    "8b": (4096, 32, 32, 8, 14336),
}
ARCH_KEYS = (
    "embedding_length",
    "block_count",
    "attention.head_count",
    "attention.head_count_kv",
    "feed_forward_length",
    "rope.dimension_count",
)
rng = np.random.default_rng(0)
Q = gguf.GGMLQuantizationType


def fp16(value, n):
    return np.full(n, value, dtype=np.float16).view(np.uint8).reshape(n, 2)


def blocks(qtype, rows, cols):
    """Random blocks of ``qtype`` for a rows x cols matrix, with scales that keep activations sane."""
    per, size = gguf.GGML_QUANT_SIZES[qtype]
    n = rows * cols // per
    raw = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    if qtype == Q.Q5_0:
        raw[:, 0:2] = fp16(3e-3, n)
    elif qtype == Q.Q8_0:
        raw[:, 0:2] = fp16(2e-3, n)
    elif qtype == Q.Q4_K:
        raw[:, 0:2] = fp16(3e-4, n)
        raw[:, 2:4] = fp16(3e-4, n)
    elif qtype == Q.Q6_K:
        raw[:, 192:208] = rng.integers(-32, 32, size=(n, 16), dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = fp16(2e-4, n)
    else:
        raise ValueError(qtype)
    return raw.reshape(rows, cols // per * size)


def main(source, out, shape):
    hidden, layers, heads, kv_heads, ffn = SHAPES[shape]
    head_dim = hidden // heads
    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(out, "llama")
    values = {
        "embedding_length": hidden,
        "block_count": layers,
        "attention.head_count": heads,
        "attention.head_count_kv": kv_heads,
        "feed_forward_length": ffn,
        "rope.dimension_count": head_dim,
    }
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        short = key.removeprefix("llama.")
        vtype = field.types[0]
        if short in values:
            writer.add_key_value(key, values[short], vtype)
        elif vtype == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, field.contents(), vtype, field.types[-1])
        else:
            writer.add_key_value(key, field.contents(), vtype)
    writer.add_string("general.size_label", shape.upper() + " (random weights)")
    vocab = reader.fields["llama.vocab_size"].contents()
    writer.add_tensor("token_embd.weight", blocks(Q.Q8_0, vocab, hidden), raw_dtype=Q.Q8_0)
    writer.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        heavy = Q.Q6_K if (i < layers // 8 or i >= 7 * layers // 8 or i % 3 == 2) else Q.Q4_K
        mats = {
            "attn_q": (hidden, hidden, Q.Q4_K),
            "attn_k": (kv_heads * head_dim, hidden, Q.Q4_K),
            "attn_v": (kv_heads * head_dim, hidden, heavy),
            "attn_output": (hidden, hidden, Q.Q4_K),
            "ffn_gate": (ffn, hidden, Q.Q4_K),
            "ffn_up": (ffn, hidden, Q.Q4_K),
            "ffn_down": (hidden, ffn, heavy),
        }
        for name, (rows, cols, qtype) in mats.items():
            if cols % 256:  # K-quant super-blocks span 256 inputs
                qtype = {Q.Q4_K: Q.Q5_0, Q.Q6_K: Q.Q8_0}[qtype]
            writer.add_tensor(f"blk.{i}.{name}.weight", blocks(qtype, rows, cols), raw_dtype=qtype)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4) or sys.argv[2] not in SHAPES:
        sys.exit(__doc__)
    if len(sys.argv) == 4:
        source = sys.argv[3]
    else:
        from specdecode.models.bundled import BUNDLED

        source = str(BUNDLED["smollm2"].gguf_path())
    main(source, sys.argv[1], sys.argv[2])
