"""What transformers' GGUF reader leaves out of a file's config, put back as llama.cpp reads the file.

transformers maps a fixed list of metadata keys per architecture (``integrations/ggml.py``) and drops the rest:

- RoPE scaling. ``{arch}.rope.scaling.type`` / ``.factor`` (linear: Gemma 3 4B and up, on its global layers) is read
  for gpt-oss only; Llama 3.x's scaling, which llama.cpp keeps as a ``rope_freqs.weight`` tensor of per-frequency
  divisors, not at all. Both are put back as transformers' ``linear`` / ``llama3`` RoPE parameters.
- The head size (``{arch}.attention.key_length``) for Qwen 2 and 3, which keep their classes' defaults.
- Gemma 3's attention scale: llama.cpp scales queries by ``1/sqrt(head_dim)`` (``1/sqrt(hidden/heads)`` for the
  62-layer 27B), transformers by its default ``query_pre_attn_scalar`` (256) whatever the head size; and its
  ``final_logit_softcapping`` key.
- Mistral: transformers makes a llama file named exactly "mistral" a ``MistralConfig`` with that class's default
  4096-token window, which the file does not state. A llama file is Llama unless it states
  ``llama.attention.sliding_window``; then it is Mistral with that window.

What a config cannot say (other scaling types, divisors that are not Llama 3's) refuses the file in one line.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from transformers import LlamaConfig, MistralConfig, PretrainedConfig

from ...errors import ModelNotAvailable
from .index import GGUFIndex

LLAMA3_CONTEXT = 8192  # the original context llama.cpp's converter assumes when it writes a Llama 3 rope_freqs tensor
GEMMA3_27B_LAYERS = 62  # how llama.cpp recognises Gemma 3 27B, whose query scale differs (``_gemma3``)
_TOLERANCE = 1e-5  # relative: transformers' llama3 inverse frequencies against the file's divisors, in float32


def complete_config(config: PretrainedConfig, index: GGUFIndex, name: str) -> PretrainedConfig:
    """``config`` (transformers' reading of the GGUF file ``name``) with what its reader drops put back."""
    config = _llama_or_mistral(config, index)
    head_dim = index.values.get(f"{index.architecture}.attention.key_length")
    if head_dim:  # Qwen 3's reader leaves its class default (128) whatever the file states
        config.head_dim = int(head_dim)
    _rope_scaling(config, index, name)
    _llama3_rope(config, index, name)
    if config.model_type == "gemma3_text":
        _gemma3(config, index)
    return config


def readable_config(config: PretrainedConfig) -> PretrainedConfig:
    """A config transformers' GGUF loader can name the tensors of: Mistral's as Llama's (the same parameters)."""
    if config.model_type != "mistral":
        return config
    fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures", "sliding_window")}
    return LlamaConfig.from_dict(fields)


def _llama_or_mistral(config: PretrainedConfig, index: GGUFIndex) -> PretrainedConfig:
    if index.architecture != "llama":
        return config
    window = index.values.get("llama.attention.sliding_window") or None
    if config.model_type == "mistral" and window is None:  # transformers' name-based guess, not the file's
        return readable_config(config)
    if window is not None:
        fields = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return MistralConfig.from_dict({**fields, "sliding_window": int(window)})
    return config


def _full_attention_rope(config: PretrainedConfig) -> dict:
    """The RoPE parameters scaling applies to: Gemma 3's global layers' (llama.cpp leaves its local ones), else all."""
    params = config.rope_parameters
    return params["full_attention"] if config.model_type == "gemma3_text" else params


def _rope_scaling(config: PretrainedConfig, index: GGUFIndex, name: str) -> None:
    arch = index.architecture
    kind = index.values.get(f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return
    factor = float(index.values.get(f"{arch}.rope.scaling.factor", 1.0))
    if kind != "linear":
        raise ModelNotAvailable(
            f"{name}: RoPE scaling {kind!r} (from its metadata, which transformers' GGUF reader drops) is not read here"
        )
    if factor != 1.0:
        _full_attention_rope(config).update(rope_type="linear", factor=_shortest(factor))


def _llama3_rope(config: PretrainedConfig, index: GGUFIndex, name: str) -> None:
    """A llama file's ``rope_freqs.weight`` (llama.cpp divides inverse frequency i by its element i) as the Llama 3
    parameters that give the same inverse frequencies; checked against transformers' own llama3 computation."""
    divisors = next((t.data for t in index.tensors if t.name == "rope_freqs.weight"), None)
    if divisors is None or index.architecture != "llama":
        return
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    params = config.rope_parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / params["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim)
    if divisors.shape != inv_freq.shape:
        raise ModelNotAvailable(
            f"{name}: rope_freqs.weight has {divisors.size} divisors for {inv_freq.size} frequencies"
        )
    if np.all(divisors == 1.0):
        return
    for candidate in _llama3_candidates(inv_freq, divisors):
        trial = dict(params, rope_type="llama3", **candidate)
        if np.allclose(_llama3_inv_freq(config, trial), inv_freq / divisors, rtol=_TOLERANCE, atol=0):
            params.clear()
            params.update(trial)
            return
    raise ModelNotAvailable(
        f"{name}: its rope_freqs.weight divisors are not Llama 3's RoPE scaling, the only kind a Llama config can say"
    )


def _llama3_candidates(inv_freq: np.ndarray, divisors: np.ndarray) -> list[dict]:
    """Llama 3 parameters that may give ``divisors``: 1 above ``high/L`` cycles per token, ``factor`` below
    ``low/L``, and between them ``1/d = (1 − s)/factor + s`` with ``s`` linear in the frequency. Only the ratios of
    (L, low, high) matter: L is llama.cpp's 8192 and low/high fit the divisors between the bands (rounded first)."""
    factor = _shortest(divisors.max())
    candidates = [dict(factor=factor, low_freq_factor=1.0, high_freq_factor=4.0)]  # Llama 3.1, 3.2, 3.3
    x = LLAMA3_CONTEXT * inv_freq / (2 * math.pi)  # the original context's cycles at each frequency
    middle = (divisors > 1.0) & (divisors < factor)
    if middle.sum() >= 2 and factor > 1.0:
        s = (1.0 / divisors[middle] - 1.0 / factor) / (1.0 - 1.0 / factor)
        slope, intercept = np.polyfit(x[middle], s, 1)
        low, high = -intercept / slope, (1.0 - intercept) / slope
        candidates += [dict(factor=factor, low_freq_factor=round(low, 4), high_freq_factor=round(high, 4)),
                       dict(factor=factor, low_freq_factor=float(low), high_freq_factor=float(high))]  # fmt: skip
    return [dict(c, original_max_position_embeddings=LLAMA3_CONTEXT) for c in candidates]


def _llama3_inv_freq(config: PretrainedConfig, params: dict) -> np.ndarray:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    trial = type(config).from_dict({**config.to_dict(), "rope_parameters": params})
    inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](trial, torch.device("cpu"))
    return inv_freq.double().numpy()


def _gemma3(config: PretrainedConfig, index: GGUFIndex) -> None:
    """llama.cpp's query scale for Gemma 3: 1/sqrt(hidden / heads) for the 27B, which it tells from the other sizes by
    its layer count alone (``LLM_TYPE_27B``: 62 layers), 1/sqrt(head_dim) for every other size."""
    is_27b = config.num_hidden_layers == GEMMA3_27B_LAYERS
    config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads if is_27b else config.head_dim
    softcap = index.values.get("gemma3.final_logit_softcapping")
    if softcap:
        config.final_logit_softcapping = float(softcap)


def _shortest(value: float) -> float:
    """A float32 value as the shortest decimal that rounds to it (8.0, 7.3: what the converter was given)."""
    return float(str(np.float32(value)))
