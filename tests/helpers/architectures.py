"""The architectures people download, each as a tiny GGUF file written the way llama.cpp's converter writes it
(random blocks, no tokenizer), and the transformers config each file means: Llama 3.2 (its RoPE scaling), Qwen 2.5,
Qwen 3, a llama file transformers takes for Mistral, Gemma 3."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import gguf
import numpy as np
import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from helpers.gguf import LAYOUTS, MATRICES, random_blocks

HIDDEN, FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB, CONTEXT = 256, 512, 4, 2, 64, 96, 131072
WINDOW = 8  # every test sequence is longer
LLAMA3 = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)
SIZES = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_attention_heads=HEADS,
             num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=CONTEXT, rms_norm_eps=1e-6,
             tie_word_embeddings=True)  # fmt: skip


@dataclass(frozen=True)
class Spec:
    """A GGUF file to write and the transformers model it means."""

    arch: str
    layers: int
    kinds: tuple[str, ...]  # q, k, v, o, gate, up, down
    base: float
    name: str = "tiny"
    metadata: dict = field(default_factory=dict)  # extra keys: str, float or uint32 values
    rope_freqs: np.ndarray | None = None
    qk_norm: bool = False
    biases: bool = False
    sandwich: bool = False


def llama3_divisors(base: float, dim: int, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """``rope_freqs.weight`` as llama.cpp's converter computes it from a Llama 3 config (float32)."""
    divisors = []
    for freq in 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < context / high:
            divisors.append(1.0)
        elif wavelen > context / low:
            divisors.append(factor)
        else:
            smooth = (context / wavelen - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(divisors, dtype=torch.float32).numpy()


LLAMA3_DIVISORS = llama3_divisors(500000.0, HEAD_DIM, 8.0, 1.0, 4.0, 8192)
SPECS = {
    "llama3": Spec("llama", 2, LAYOUTS["k-quants"], 500000.0, "Llama 3.2 1B Instruct", rope_freqs=LLAMA3_DIVISORS),
    "qwen2.5": Spec("qwen2", 2, LAYOUTS["q4-q5"], 1e6, "Qwen2.5 0.5B Instruct", biases=True),
    "qwen3": Spec("qwen3", 2, LAYOUTS["mixed"], 1e6, "Qwen3 0.6B", qk_norm=True),
    "mistral": Spec("llama", 2, LAYOUTS["mixed"], 1e6, "mistral"),  # transformers' guess: Mistral, 4096 window
    "gemma3": Spec("gemma3", 6, ("Q8_0", "Q8_0", "Q8_0", "Q4_K", "Q4_0", "Q4_0", "Q6_K"), 1e6, "Gemma 3 4B",
                   qk_norm=True, sandwich=True, metadata={"gemma3.attention.sliding_window": WINDOW,
                   "gemma3.rope.scaling.type": "linear", "gemma3.rope.scaling.factor": 8.0}),
}  # fmt: skip


def expected_config(key: str, spec: Spec):
    """The transformers config the file means, written out by hand (not read from the file)."""
    rope = {"rope_type": "default", "rope_theta": spec.base}
    if key == "llama3":
        return LlamaConfig(**SIZES, num_hidden_layers=spec.layers, rope_parameters={**rope, "rope_type": "llama3",
                           **LLAMA3})  # fmt: skip
    if key == "mistral":  # llama.cpp runs a llama file as Llama: no window unless the file states one
        return LlamaConfig(**SIZES, num_hidden_layers=spec.layers, rope_parameters=rope)
    if key == "qwen2.5":
        return Qwen2Config(**SIZES, num_hidden_layers=spec.layers, rope_parameters=rope)
    if key == "qwen3":
        return Qwen3Config(**SIZES, num_hidden_layers=spec.layers, rope_parameters=rope)
    rope_parameters = {"full_attention": {**rope, "rope_type": "linear", "factor": 8.0},
                       "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}  # fmt: skip
    scalar = HEAD_DIM  # llama.cpp scales by 1/sqrt(head_dim) below the 27B
    return Gemma3TextConfig(**SIZES, num_hidden_layers=spec.layers, sliding_window=WINDOW,
                            rope_parameters=rope_parameters, query_pre_attn_scalar=scalar)  # fmt: skip


MODEL_CLASSES = {LlamaConfig: LlamaForCausalLM, MistralConfig: MistralForCausalLM, Qwen2Config: Qwen2ForCausalLM,
                 Qwen3Config: Qwen3ForCausalLM, Gemma3TextConfig: Gemma3ForCausalLM}  # fmt: skip


def write(path: Path, spec: Spec) -> Path:
    """``spec`` as a GGUF file: the keys and tensor names llama.cpp's converter writes for its architecture."""
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(str(path), spec.arch)
    a = spec.arch
    writer.add_name(spec.name)
    for key, value in {"context_length": CONTEXT, "embedding_length": HIDDEN, "block_count": spec.layers,
                       "feed_forward_length": FFN, "attention.head_count": HEADS, "vocab_size": VOCAB,
                       "attention.head_count_kv": KV_HEADS, "rope.dimension_count": HEAD_DIM,
                       "attention.key_length": HEAD_DIM, "attention.value_length": HEAD_DIM}.items():  # fmt: skip
        writer.add_uint32(f"{a}.{key}", value)
    writer.add_float32(f"{a}.rope.freq_base", spec.base)
    writer.add_float32(f"{a}.attention.layer_norm_rms_epsilon", 1e-6)
    for key, value in spec.metadata.items():
        {str: writer.add_string, float: writer.add_float32, int: writer.add_uint32}[type(value)](key, value)
    writer.add_tensor(
        "token_embd.weight", random_blocks("Q8_0", VOCAB, HIDDEN, rng), raw_dtype=gguf.GGMLQuantizationType.Q8_0
    )
    writer.add_tensor("output_norm.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
    if spec.rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", spec.rope_freqs)
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    shapes = dict(zip(MATRICES, ((q, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, q), (FFN, HIDDEN), (FFN, HIDDEN),
                                 (HIDDEN, FFN)), strict=True))  # fmt: skip
    norms = ("attn_norm", "ffn_norm") + (("post_attention_norm", "post_ffw_norm") if spec.sandwich else ())
    for i in range(spec.layers):
        for name, kind in zip(MATRICES, spec.kinds, strict=True):
            writer.add_tensor(f"blk.{i}.{name}.weight", random_blocks(kind, *shapes[name], rng),
                              raw_dtype=gguf.GGMLQuantizationType[kind])  # fmt: skip
        for norm in norms:
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HIDDEN).astype(np.float32))
        for norm in ("attn_q_norm", "attn_k_norm") if spec.qk_norm else ():
            writer.add_tensor(f"blk.{i}.{norm}.weight", rng.uniform(0.5, 1.5, HEAD_DIM).astype(np.float32))
        for name in ("attn_q", "attn_k", "attn_v") if spec.biases else ():
            writer.add_tensor(f"blk.{i}.{name}.bias", rng.uniform(-0.5, 0.5, shapes[name][0]).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
