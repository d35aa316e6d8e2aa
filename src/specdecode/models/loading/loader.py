"""``load_model``: a bundled name, an HF folder, a .gguf file or a built model → a ``LoadedModel``.

Where a source is and what it holds is ``sources``'; what a load will hold, before any weight is read,
``plan``'s; a GGUF file's first-use conversions ``gguf.conversions``'; the loaded model ``models.loaded``'.
"""

from __future__ import annotations

import copy
import functools
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoModelForCausalLM

from ...errors import ModelNotAvailable
from ..formats.blocks import return_freed_memory
from ..gguf.conversions import dense_cache
from ..gguf.file_blocks import read_gguf_tensors
from ..loaded import LoadedModel, resolve_dtype
from ..memory import INITIAL_SLOTS, check_fits
from ..native.architecture import unsupported_reason
from ..native.layers import supports_native
from .checkpoint import Checkpoint
from .plan import checked_context, chosen_quantization, footprint_of
from .quantize import QUANTIZATIONS, Quantization, fill_from_file, quantize_model
from .sources import default_dtype, load_tokenizer, native_skeleton, resolve_source

if TYPE_CHECKING:  # transformers.modeling_utils costs ~2 s at `import specdecode`; loading a model imports it
    from transformers import PreTrainedModel

BACKENDS = ("auto", "native", "transformers")


SLOW_LOAD_SECONDS = 2.0  # a load still running after this says so on stderr


def _announced_when_slow(load: Callable[..., LoadedModel]) -> Callable[..., LoadedModel]:
    """``load`` that prints one line on stderr once it has run ``SLOW_LOAD_SECONDS`` (nothing for a quick load)."""

    @functools.wraps(load)
    def announced(source: Any, *args: Any, **kwargs: Any) -> LoadedModel:
        what = Path(source).name if isinstance(source, str | os.PathLike) else type(source).__name__
        size = Path(source).stat().st_size if isinstance(source, str | os.PathLike) and Path(source).is_file() else 0
        sized = f" ({size / 1e9:.2f} GB)" if size else ""
        notice = threading.Timer(SLOW_LOAD_SECONDS, lambda: print(f"specdecode: loading {what}{sized} ...",
                                                                  file=sys.stderr, flush=True))  # fmt: skip
        notice.daemon = True
        notice.start()
        try:
            return load(source, *args, **kwargs)
        finally:
            notice.cancel()

    return announced


@_announced_when_slow
def load_model(
    source: Any,
    tokenizer: Any = None,
    dtype: str | torch.dtype | None = None,
    backend: str = "auto",
    quantization: str | None = "auto",
    group_size: int = 32,
    max_context: int | None = None,
) -> LoadedModel:
    """Load a bundled name (``smollm2``, ``gemma3-270m``), a local HF folder, a ``.gguf`` file, or wrap a model.

    ``backend``: ``native`` (our Llama-family runner: static cache, fused weights), ``transformers`` (any
    causal LM), or ``auto`` = native where it reproduces the model exactly, else transformers.
    ``dtype``: dense weights' dtype, float32 or bfloat16; by default (None or ``"auto"``) an HF folder's own (a float16
    checkpoint runs in bfloat16: the native runner's dtypes), float32 for a GGUF file or a model object.
    ``quantization``: ``None`` = dense weights in ``dtype``; ``"gguf"`` = the GGUF file's own blocks (``"gguf-a8"``:
    with int8 activations, llama.cpp's numerics);
    ``"int8"`` / ``"int4"`` (groups of ``group_size``) = dense weights rounded; ``"auto"`` (default) = ``"gguf"``
    for a GGUF file the native runner supports (unless ``dtype`` asks for dense bfloat16), else dense.
    Quantized weights run with a float32 residual stream (on the compiled kernels, int16 activations; without
    them, bfloat16 ones): they need ``dtype`` float32 (or unset). An HF folder's safetensors are read tensor by
    tensor into a skeleton (native architectures): never a float32 copy of all weights unless ``dtype`` asks for it;
    ``int8`` / ``int4`` round each matrix from its own float32 copy, freed before the next is read.
    ``max_context``: the most tokens a sequence may hold (prompt and output; default: the model's context window):
    each runner's KV cache stops there and a longer request is refused. A GGUF file is refused
    (``ModelNotAvailable``, one line) before its weights are read when they and one sequence of ``max_context``
    tokens (default: a runner's first allocation) do not fit the memory available (``memory.available_memory``);
    an HF folder too, when its architecture is native.
    """
    dtype = None if dtype in (None, "auto") else resolve_dtype(dtype)
    _check_arguments(backend, quantization, max_context)
    if isinstance(source, LoadedModel):
        return source
    if isinstance(source, torch.nn.Module):
        found = _from_module(source, dtype, quantization)
    elif isinstance(source, str | os.PathLike):
        found = _from_path(str(source), dtype, backend, quantization, group_size, max_context)
        tokenizer = load_tokenizer(str(source)) if tokenizer is None else tokenizer
    else:
        raise ValueError(f"cannot load a model from {type(source).__name__}: give a name, a path or a model")
    quantization = chosen_quantization(quantization, found.model, found.gguf_path, found.dtype, backend)
    formats = _quantized(found, quantization, group_size) if quantization is not None else {}
    if found.checkpoint is not None:
        _fill_from_checkpoint(found.model, found.checkpoint, found.folder, found.dtype)
    _fill_skeleton(found.model, found.gguf_path, found.dtype)
    if found.gguf_path is not None:
        return_freed_memory()
    loaded = _wrap(found.model, tokenizer, found.name, backend)
    loaded.quantization = quantization
    loaded.formats = formats
    loaded.checkpoint_dtype = found.stored
    if max_context is not None:
        checked_context(found.model, max_context)
        loaded.max_context = max_context
    return loaded


@dataclass(frozen=True)
class _Found:
    """A model built (or a skeleton to fill) from ``load_model``'s source, and where its weights are."""

    model: PreTrainedModel
    name: str
    dtype: torch.dtype  # the dense weights' dtype
    folder: Path | None = None  # the HF folder a checkpoint is read from
    gguf_path: Path | None = None  # the GGUF file whose weights fill the skeleton
    checkpoint: Checkpoint | None = None  # the checkpoint whose tensors fill the skeleton (native HF folders)
    stored: torch.dtype | None = None  # an HF folder's weights' dtype


def _check_arguments(backend: str, quantization: str | None, max_context: int | None) -> None:
    """``load_model``'s arguments refused in one line before anything is read."""
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < 1):  # fmt: skip
        raise ValueError(f"max_context must be a positive number of tokens, got {max_context!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if quantization not in (None, "auto", *QUANTIZATIONS):
        raise ValueError(f"quantization must be auto, {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")


def _from_module(source: torch.nn.Module, dtype: torch.dtype | None, quantization: str | None) -> _Found:
    """A built model in ``dtype`` (default float32), copied first when quantizing would swap the caller's modules."""
    dtype = dtype or torch.float32
    model = source.eval()
    name = getattr(model.config, "name_or_path", "") or type(model).__name__
    if quantization not in (None, "auto"):
        model = copy.deepcopy(model)  # quantizing swaps modules: leave the caller's model as it was
    model = model.to(dtype) if dtype != next(model.parameters()).dtype else model
    return _Found(model, name, dtype)


def _from_path(
    text: str,
    dtype: torch.dtype | None,
    backend: str,
    quantization: str | None,
    group_size: int,
    max_context: int | None,
) -> _Found:
    """A skeleton to fill (a native architecture: refused first, in one line, if it would not fit the memory) or a
    model built by transformers' loader (the dense copy of a GGUF file it does not run natively)."""
    source = resolve_source(text)
    dtype = dtype or default_dtype(source.stored, quantization)
    model = native_skeleton(source)
    if model is not None:  # before any weight is read
        context = checked_context(model, max_context)
        footprint = footprint_of(model, source.gguf_path, dtype, backend, quantization, group_size, source.stored)
        check_fits(source.name, footprint, max_context or min(context or INITIAL_SLOTS, INITIAL_SLOTS))
    if model is None or not supports_native(model):  # not native: transformers runs the dense copy
        folder = source.folder if source.gguf_path is None else dense_cache(source.gguf_path)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        return _Found(model, source.name, dtype, folder, source.gguf_path, None, source.stored)
    if source.gguf_path is None:
        _read_generation_config(model, source.folder)
    return _Found(model, source.name, dtype, source.folder, source.gguf_path, source.checkpoint, source.stored)


def _quantized(found: _Found, quantization: str, group_size: int) -> dict[str, int]:
    """Swap ``found.model``'s matrices for ``quantization``'s format; the matrices per stored format."""
    spec = Quantization(quantization, group_size)  # validates the group size
    if found.dtype != torch.float32:
        raise ValueError(
            f"quantization={quantization!r} runs bfloat16 activations over a float32 residual stream: "
            "leave dtype at float32 (or pass quantization=None for dense bfloat16 weights)"
        )
    if spec.reads_gguf and found.gguf_path is None:
        raise ValueError(
            f"quantization={quantization!r} keeps a GGUF file's blocks: load a .gguf file or a bundled model"
        )
    if not spec.reads_gguf and found.checkpoint is None:  # int8 / int4 round the dense weights
        _fill_skeleton(found.model, found.gguf_path)
    return quantize_model(found.model, spec, found.gguf_path, found.checkpoint)


def _fill_from_checkpoint(model: PreTrainedModel, checkpoint: Checkpoint, folder: Path, dtype: torch.dtype) -> None:
    """Read into ``model`` (a skeleton) the checkpoint's tensors for parameters still on the meta device, one at a
    time, in ``dtype``; refuse a model left with a parameter the checkpoint lacks."""
    fill_from_file(model, checkpoint, dtype)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotAvailable(f"{folder.name} has no tensor for {missing[0]} ({len(missing)} missing)")


def _read_generation_config(model: PreTrainedModel, folder: Path) -> None:
    """The folder's generation config (its EOS ids), as ``from_pretrained`` reads it, on a skeleton."""
    from transformers import GenerationConfig

    if (folder / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(folder)


def _fill_skeleton(model: PreTrainedModel, gguf_path: Path | None, dtype: torch.dtype = torch.float32) -> None:
    """Dequantize into ``model`` the file's tensors for parameters still on the meta device (dense weights in
    memory, as transformers' loader makes them); refuse a model left with a parameter the file lacks."""
    if not any(p.is_meta for p in model.parameters()):
        return
    fill_from_file(model, read_gguf_tensors(gguf_path, model), dtype)
    missing = [name for name, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelNotAvailable(f"{gguf_path.name} has no tensor for {missing[0]} ({len(missing)} missing)")


def _wrap(model: PreTrainedModel, tokenizer: Any, name: str, backend: str) -> LoadedModel:
    vocab_size = len(tokenizer) if tokenizer is not None else model.config.get_text_config().vocab_size
    vocab_size = min(vocab_size, model.get_output_embeddings().out_features)
    reason = unsupported_reason(model)
    native = reason is None
    if backend == "native" and not native:
        raise ValueError(
            f"the native runner does not support {type(model).__name__} ({reason}); use backend='transformers'"
        )
    chosen = "native" if backend == "native" or (backend == "auto" and native) else "transformers"
    return LoadedModel(model, tokenizer, name, vocab_size, _eos_ids(model, tokenizer), chosen)


def _eos_ids(model: PreTrainedModel, tokenizer: Any) -> frozenset[int]:
    """Every id that ends generation: the tokenizer's EOS and the model's (generation) config EOS ids."""
    found: set[int] = set()
    sources = [model.config.get_text_config(), getattr(model, "generation_config", None)]
    for config in sources:
        value = getattr(config, "eos_token_id", None) if config is not None else None
        found.update([value] if isinstance(value, int) else (value or []))
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        found.add(int(tokenizer.eos_token_id))
    return frozenset(found)
