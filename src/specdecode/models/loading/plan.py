"""What ``load_model`` will hold, known before any weight is read: the quantization ``"auto"`` picks, the context a
sequence may reach, and the memory footprint of the weights (from a GGUF file's index or an HF folder's safetensors
headers), which the loader checks against the memory available before it reads anything."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...kernels import ops as kernels_ops
from ..loaded import resolve_dtype
from ..memory import Footprint, dense_footprint, file_footprint, rounded_footprint
from ..native.layers import supports_native
from .sources import default_dtype, native_skeleton, resolve_source

if TYPE_CHECKING:  # transformers.modeling_utils costs ~2 s at `import specdecode`; loading a model imports it
    from transformers import PreTrainedModel


def chosen_quantization(
    quantization: str | None, model: PreTrainedModel, gguf_path: Path | None, dtype: torch.dtype, backend: str
) -> str | None:
    """``quantization``, with ``"auto"`` resolved: a GGUF file's own blocks where the native runner runs the model
    in float32, else dense weights (None)."""
    if quantization != "auto":
        return quantization
    native = backend != "transformers" and supports_native(model)
    return "gguf" if gguf_path is not None and native and dtype == torch.float32 else None


def checked_context(model: PreTrainedModel, max_context: int | None) -> int | None:
    """``max_context`` (default: the model's context window, None if its config gives none), refused past that
    window."""
    window = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    if max_context is not None and window is not None and max_context > window:
        raise ValueError(f"max_context {max_context} is past the model's context window of {window} tokens")
    return window if max_context is None else max_context


def planned_footprint(
    source: str,
    dtype: str | torch.dtype | None = None,
    quantization: str | None = "auto",
    group_size: int = 32,
) -> tuple[Footprint, int | None] | None:
    """(footprint, context window) of what ``load_model(source, ...)`` will hold, from a GGUF file's metadata and
    index (or an HF folder's config and safetensors headers) before any weight is read; None for a source that
    ``load_model`` hands to transformers' loader (an HF folder of another architecture, or without safetensors)."""
    located = resolve_source(str(source))
    skeleton = native_skeleton(located)
    if skeleton is None:
        return None
    dtype = None if dtype in (None, "auto") else resolve_dtype(dtype)
    window = getattr(skeleton.config.get_text_config(), "max_position_embeddings", None)
    dtype = dtype or default_dtype(located.stored, quantization)
    found = footprint_of(skeleton, located.gguf_path, dtype, "auto", quantization, group_size, located.stored)
    return found, window


def footprint_of(
    skeleton: PreTrainedModel,
    gguf_path: Path | None,
    dtype: torch.dtype,
    backend: str = "auto",
    quantization: str | None = "auto",
    group_size: int = 32,
    stored: torch.dtype | None = None,
) -> Footprint:
    """What ``load_model`` of ``gguf_path`` (None: an HF folder whose checkpoint holds ``stored`` weights) with these
    settings will hold, from the file's index and ``skeleton`` (on the meta device): a GGUF's own blocks on the
    kernels exactly, dense weights by their bytes per parameter, int8 / int4 as ``quantize_model`` rounds them."""
    native = backend != "transformers" and supports_native(skeleton)
    quantization = chosen_quantization(quantization, skeleton, gguf_path, dtype, backend)
    kernels_run = native and kernels_ops() is not None
    if quantization in ("gguf", "gguf-a8") and kernels_run:
        return file_footprint(gguf_path, skeleton)
    if quantization is None:
        return dense_footprint(skeleton, dtype.itemsize, dtype.itemsize, dtype.itemsize)
    # int8 / int4 (GGUF types the kernels cannot run: about so): an untied embedding stays in its stored dtype
    embed_element = (stored or torch.float32).itemsize if gguf_path is None else 4
    return rounded_footprint(skeleton, "int4" if quantization == "int4" else "int8", group_size, kernels_run,
                             embed_element)  # fmt: skip
