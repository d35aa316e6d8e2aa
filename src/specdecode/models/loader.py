"""``load_model``: a bundled name, an HF folder, a .gguf file or a built model → a ``LoadedModel``."""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import os
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ..cache import cache_root, ensure_entry, lock_of, source_meta, whole_hf_folder
from ..errors import ModelNotAvailable
from ..kernels import ops as kernels_ops
from .architecture import architecture_of, unsupported_reason
from .base import ModelRunner
from .bundled import BUNDLED
from .checkpoint import Checkpoint, checkpoint_of
from .gguf_blocks import read_gguf_tensors
from .gguf_config import complete_config, readable_config
from .hf import HFRunner
from .memory import (
    INITIAL_SLOTS,
    Footprint,
    check_fits,
    dense_footprint,
    file_footprint,
    loaded_footprint,
    rounded_footprint,
)
from .memory import describe as describe_memory
from .native_llama import KERNEL_CACHE_DTYPE, NativeLlamaRunner, supports_native
from .native_llama import uses_kernels as native_uses_kernels
from .quantize import QUANTIZATIONS, Quantization, fill_from_file, quantize_model, tied_head
from .weights import FloatRows, return_freed_memory

if TYPE_CHECKING:  # transformers.modeling_utils costs ~2 s at `import specdecode`; loading a model imports it
    from transformers import PreTrainedModel

BACKENDS = ("auto", "native", "transformers")
_FAMILY_NAMES = {"llama": "Llama", "qwen3": "Qwen 3", "gemma3": "Gemma 3"}
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


@dataclass
class LoadedModel:
    """A causal LM, its tokenizer (optional: without one, prompts are token-id lists) and runner factory."""

    model: PreTrainedModel
    tokenizer: Any | None
    name: str
    vocab_size: int
    eos_token_ids: frozenset[int]
    backend: str = "transformers"
    quantization: str | None = None  # how the weights are stored: None (dense), "gguf", "gguf-a8", "int8", "int4"
    formats: dict[str, int] = field(default_factory=dict)  # matrices per stored format (quantized models)
    max_context: int | None = None  # tokens a sequence may hold (prompt and output): caps each runner's KV cache
    checkpoint_dtype: torch.dtype | None = None  # an HF folder's stored weights' dtype (None: not loaded from one)

    @property
    def context_window(self) -> int | None:
        """The most tokens a sequence may hold: ``max_context`` if set, else the model's context window (None if
        its config gives none)."""
        window = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        if self.max_context is None or window is None:
            return window if self.max_context is None else self.max_context
        return min(window, self.max_context)

    def describe(self) -> str:
        """One line: the runner this model got (and why not the native one), its weights, its KV cache and, on the
        native runner, its memory (weights repacked and mapped, KV cache per token, scratch per row)."""
        if self.backend == "native":
            family = architecture_of(self.model).family
            engine = "compiled kernels" if native_uses_kernels(self.model) else "PyTorch ops"
            runner = f"native runner ({_FAMILY_NAMES[family]} family, {engine})"
        else:
            runner = f"transformers runner (not native: {unsupported_reason(self.model) or 'asked for'})"
        stored = _dtype_name(self.checkpoint_dtype) if self.checkpoint_dtype is not None else None
        if self.formats:
            weights = ", ".join(f"{count} {name}" for name, count in sorted(self.formats.items(), key=lambda i: -i[1]))
            weights += f" (rounded from the checkpoint's {stored})" if stored else ""
            table = getattr(self.model.model.embed_tokens, "table", None)
            weights += f", embedding {_dtype_name(table.weight.dtype)}" if isinstance(table, FloatRows) else ""
        else:
            dense = _dtype_name(next(self.model.parameters()).dtype)
            weights = f"dense {dense}"
            if stored == dense:
                weights += " (the checkpoint's dtype)"
            elif stored:
                weights += f" (the checkpoint holds {stored})"
        kv = str(self.kv_dtype).removeprefix("torch.")
        line = f"{self.name}: {runner}; weights {weights}; KV cache {kv}"
        return line + (f"; memory: {describe_memory(loaded_footprint(self))}" if self.backend == "native" else "")

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype a runner keeps its KV cache in: float16 on the compiled kernels, else the residual stream's
        (the model's dtype; float32 for quantized weights)."""
        if self.backend == "native" and native_uses_kernels(self.model):
            return KERNEL_CACHE_DTYPE
        quantized = self.quantization is not None
        return torch.float32 if quantized else next(self.model.parameters()).dtype

    def new_runner(self) -> ModelRunner:
        """A fresh runner with its own empty KV cache over this model's weights (native or transformers); a native
        one's cache grows on demand up to ``context_window`` slots."""
        if self.backend == "native":
            cap = self.context_window
            first = INITIAL_SLOTS if cap is None else min(INITIAL_SLOTS, cap)
            return NativeLlamaRunner(self.model, self.vocab_size, max_length=first, max_capacity=cap)
        return HFRunner(self.model, self.vocab_size)

    def encode(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt: a string is tokenized as the tokenizer does; a list is checked and kept."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"model '{self.name}' has no tokenizer: pass the prompt as a list of token ids")
            ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        else:
            ids = [int(t) for t in prompt]
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        if not ids:
            raise ValueError("the prompt is empty: give at least one token")
        return ids

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids`` (special tokens skipped); without a tokenizer, the ids space-separated."""
        if self.tokenizer is None:
            return " ".join(map(str, ids))
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def chat_prompt(self, text: str) -> list[int]:
        """Token ids of ``text`` as one user turn in the model's chat template (plain text if it has none)."""
        template = getattr(self.tokenizer, "chat_template", None) if self.tokenizer is not None else None
        if not template:
            return self.encode(text)
        ids = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        if not isinstance(ids, list):
            ids = ids["input_ids"]
        return [int(t) for t in ids]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``torch.float32`` / ``"bfloat16"`` / ``"bf16"`` … → a torch dtype (float32 and bfloat16 only)."""
    if isinstance(dtype, torch.dtype):
        if dtype in (torch.float32, torch.bfloat16):
            return dtype
    elif dtype in DTYPES:
        return DTYPES[dtype]
    raise ValueError(f"dtype must be float32 or bfloat16, got {dtype}")


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
    if max_context is not None and (isinstance(max_context, bool) or not isinstance(max_context, int)
                                    or max_context < 1):  # fmt: skip
        raise ValueError(f"max_context must be a positive number of tokens, got {max_context!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    if quantization not in (None, "auto", *QUANTIZATIONS):
        raise ValueError(f"quantization must be auto, {', '.join(QUANTIZATIONS)} or None, got {quantization!r}")
    if isinstance(source, LoadedModel):
        return source
    gguf_path = stored = checkpoint = None
    if isinstance(source, torch.nn.Module):
        dtype = dtype or torch.float32
        model = source.eval()
        name = getattr(model.config, "name_or_path", "") or type(model).__name__
        if quantization not in (None, "auto"):
            model = copy.deepcopy(model)  # quantizing swaps modules: leave the caller's model as it was
        model = model.to(dtype) if dtype != next(model.parameters()).dtype else model
    elif isinstance(source, str | os.PathLike):
        folder, name, gguf_path = _locate(str(source))
        checkpoint = checkpoint_of(folder) if gguf_path is None else None
        stored = None if gguf_path is not None else _stored_dtype(folder, checkpoint)
        dtype = dtype or _default_dtype(stored, quantization)
        model = _skeleton(folder) if gguf_path is not None or checkpoint is not None else None
        if gguf_path is None and model is not None and not (supports_native(model) and _fills(model, checkpoint)):
            model = None  # transformers' loader: other architectures, renamed or converted tensors
        if model is not None:  # before any weight is read
            context = checked_context(model, max_context)
            found = _footprint_of(model, gguf_path, dtype, backend, quantization, group_size, stored)
            check_fits(name, found, max_context or min(context or INITIAL_SLOTS, INITIAL_SLOTS))
        if model is None or not supports_native(model):  # not native: transformers runs the dense copy
            folder = folder if gguf_path is None else _dense_cache(gguf_path)
            model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            checkpoint = None
        elif gguf_path is None:
            _read_generation_config(model, folder)
        if tokenizer is None:
            tokenizer = load_tokenizer(str(source))
    else:
        raise ValueError(f"cannot load a model from {type(source).__name__}: give a name, a path or a model")
    if quantization == "auto":
        native = backend != "transformers" and supports_native(model)
        quantization = "gguf" if gguf_path is not None and native and dtype == torch.float32 else None
    if quantization is not None:
        spec = Quantization(quantization, group_size)  # validates the group size
        if dtype != torch.float32:
            raise ValueError(
                f"quantization={quantization!r} runs bfloat16 activations over a float32 residual stream: "
                "leave dtype at float32 (or pass quantization=None for dense bfloat16 weights)"
            )
        if spec.reads_gguf and gguf_path is None:
            raise ValueError(
                f"quantization={quantization!r} keeps a GGUF file's blocks: load a .gguf file or a bundled model"
            )
        if not spec.reads_gguf and checkpoint is None:  # int8 / int4 round the dense weights
            _fill_skeleton(model, gguf_path)
        formats = quantize_model(model, spec, gguf_path, checkpoint)
    else:
        formats = {}
    if checkpoint is not None:
        _fill_from_checkpoint(model, checkpoint, folder, dtype)
    _fill_skeleton(model, gguf_path, dtype)
    if gguf_path is not None:
        return_freed_memory()
    loaded = _wrap(model, tokenizer, name, backend)
    loaded.quantization = quantization
    loaded.formats = formats
    loaded.checkpoint_dtype = stored
    if max_context is not None:
        checked_context(model, max_context)
        loaded.max_context = max_context
    return loaded


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
    folder, _, gguf_path = _locate(str(source))
    checkpoint = checkpoint_of(folder) if gguf_path is None else None
    if gguf_path is None and checkpoint is None:
        return None
    skeleton = _skeleton(folder)
    if gguf_path is None and not (supports_native(skeleton) and _fills(skeleton, checkpoint)):
        return None
    stored = None if gguf_path is not None else _stored_dtype(folder, checkpoint)
    dtype = None if dtype in (None, "auto") else resolve_dtype(dtype)
    window = getattr(skeleton.config.get_text_config(), "max_position_embeddings", None)
    found = _footprint_of(skeleton, gguf_path, dtype or _default_dtype(stored, quantization), "auto", quantization,
                          group_size, stored)  # fmt: skip
    return found, window


def _footprint_of(
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
    if quantization == "auto":
        quantization = "gguf" if gguf_path is not None and native and dtype == torch.float32 else None
    kernels_run = native and kernels_ops() is not None
    if quantization in ("gguf", "gguf-a8") and kernels_run:
        return file_footprint(gguf_path, skeleton)
    if quantization is None:
        return dense_footprint(skeleton, dtype.itemsize, dtype.itemsize, dtype.itemsize)
    # int8 / int4 (GGUF types the kernels cannot run: about so): an untied embedding stays in its stored dtype
    embed_element = (stored or torch.float32).itemsize if gguf_path is None else 4
    return rounded_footprint(skeleton, "int4" if quantization == "int4" else "int8", group_size, kernels_run,
                             embed_element)  # fmt: skip


def _skeleton(folder: Path) -> PreTrainedModel:
    """The model of ``folder``'s config with every parameter on the meta device (buffers such as RoPE's inverse
    frequencies are computed): the weights come from the GGUF file afterwards, never through a dense copy."""
    from accelerate import init_empty_weights

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def _stored_dtype(folder: Path, checkpoint: Checkpoint | None) -> torch.dtype | None:
    """The float dtype of a folder's weights: its safetensors', else its config's (None where neither says)."""
    if checkpoint is not None and checkpoint.dtype is not None:
        return checkpoint.dtype
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    named = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, named, None) if isinstance(named, str) else None


def _default_dtype(stored: torch.dtype | None, quantization: str | None) -> torch.dtype:
    """``load_model``'s dtype when none is given: float32 under quantized weights (their residual stream), else the
    checkpoint's own where the native runner runs it (float16 → bfloat16: the same bytes, 3 fewer mantissa bits, a
    wider range), else float32."""
    if quantization not in (None, "auto") or stored is None:
        return torch.float32
    return torch.float32 if stored == torch.float32 else torch.bfloat16


def _fills(skeleton: PreTrainedModel, checkpoint: Checkpoint) -> bool:
    """Whether ``checkpoint`` holds every parameter of ``skeleton`` under its own name (a tied head: the embedding)."""
    tied = tied_head(skeleton)
    return all(name in checkpoint or (tied and name == "lm_head.weight") for name, _ in skeleton.named_parameters())


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


def load_tokenizer(source: str) -> Any:
    """The tokenizer ``load_model(source)`` attaches (a bundled name, a .gguf file or a folder), without loading
    the weights; None when the folder has none."""
    folder, _, _ = _locate(str(source))
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None  # transformers would build an empty tokenizer of the config's class (Qwen, Gemma: 1-5 tokens)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None


def _locate(text: str) -> tuple[Path, str, Path | None]:
    """(transformers folder, display name, GGUF file or None) for a bundled name, a .gguf path or a folder."""
    if text in BUNDLED:
        gguf = BUNDLED[text].gguf_path()
        return _metadata_cache(gguf), text, gguf
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotAvailable(f"GGUF file not found: {path}")
        return _metadata_cache(path), path.name, path
    if path.is_dir():
        return path, path.name, None
    known = ", ".join(BUNDLED)
    raise ModelNotAvailable(f"'{text}' is neither a bundled model ({known}), a .gguf file nor a model folder")


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


CONFIG_VERSION = 2  # 2: what transformers' GGUF reader drops put back (gguf_config.py); entries of 1 are not read


def _cache_folder(gguf: Path, kind: str) -> Path:
    """Where a cache entry of ``gguf`` lives: keyed by the file's path, size and modification time and by how its
    config is read (``CONFIG_VERSION``)."""
    stat = gguf.stat()
    text = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:{CONFIG_VERSION}"
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    return cache_root() / kind / f"{gguf.stem}-{key}"


def _dense_folder(gguf: Path) -> Path:
    """Where the dense copy of ``gguf`` lives (architectures the native runner does not run)."""
    return _cache_folder(gguf, "dense")


def _metadata_folder(gguf: Path) -> Path:
    """Where ``gguf``'s config and tokenizer live (a few MB: the weights stay in the file)."""
    return _cache_folder(gguf, "gguf")


def _metadata_cache(gguf: Path) -> Path:
    """A HF folder with the GGUF's config and tokenizer, as transformers reads them from its metadata (built once:
    converting a 262,144-token vocabulary takes seconds)."""
    return _built_once(_metadata_folder(gguf), f"reading the metadata of {gguf.name}", _build_metadata, gguf)


def _built_once(folder: Path, what: str, build, gguf: Path) -> Path:
    """``folder``, calling ``build(gguf, staging)`` first unless it holds a whole entry (``cache.ensure_entry``:
    staged, checked, rebuilt if damaged; one builder across processes)."""
    return ensure_entry(folder, what, lambda staging: build(gguf, staging), source_meta(gguf), adopt=whole_hf_folder)


def _build_metadata(gguf: Path, folder: Path) -> None:
    """Write ``folder``: the GGUF's config and tokenizer (staged, then renamed into place)."""
    from .gguf_speedups import faster_transformers_gguf

    index = _readable_index(gguf)
    print(f"specdecode: reading the config and tokenizer of {gguf.name} for its first use (once, into "
          f"{folder.parent}) ...", file=sys.stderr, flush=True)  # fmt: skip
    with faster_transformers_gguf():
        config = complete_config(AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name), index, gguf.name)
        tokenizer = _file_tokenizer(gguf, index)

    def write(staging: Path) -> None:
        config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)

    _write_staged(folder, write)


def _readable_index(gguf: Path):
    """The file's index; a cut-short or malformed file is named here, not deep in transformers."""
    from .gguf_index import gguf_index

    try:
        return gguf_index(gguf)
    except ValueError as error:
        raise ModelNotAvailable(f"not a readable GGUF file: {error}") from None


def _file_tokenizer(gguf: Path, index) -> Any:
    """The tokenizer transformers builds from the file's metadata, or None when the file describes none."""
    if "tokenizer.ggml.model" not in index.keys:
        return None
    return AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _write_staged(folder: Path, write) -> None:
    """Call ``write(folder)``: ``folder`` is the staging folder of a cache entry (``_built_once``)."""
    write(folder)


def _build_lock(folder: Path) -> Path:
    """The lock file that its builder holds while ``folder`` is written (next to it: the folder appears whole)."""
    return lock_of(folder)


def _dense_cache(gguf: Path) -> Path:
    """A HF folder with the GGUF's weights dequantized once to float32 safetensors (built on first use)."""
    return _built_once(_dense_folder(gguf), f"the first-use copy of {gguf.name}", _build_dense_copy, gguf)


def _build_dense_copy(gguf: Path, folder: Path) -> None:
    """Write ``folder``: the GGUF's float32 weights, config and tokenizer (staged, then renamed into place)."""
    from safetensors.torch import save_model
    from transformers import GgufConfig

    from .gguf_speedups import faster_transformers_gguf

    index = _readable_index(gguf)
    config = AutoConfig.from_pretrained(_metadata_cache(gguf))  # what transformers' reader drops, put back
    print(f"specdecode: reading {gguf.name} for its first use (its tokenizer and a float32 copy, once, into "
          f"{folder.parent}) ...", file=sys.stderr, flush=True)  # fmt: skip
    with faster_transformers_gguf():  # the same reads, the file parsed once (Gemma 3: 82 -> 27 s, Zen 3)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent,
            gguf_file=gguf.name,
            config=readable_config(copy.deepcopy(config)),  # transformers adds its quantization_config
            dtype=torch.float32,
            quantization_config=GgufConfig(gguf_file=gguf.name, dequantize=True),
        )
        tokenizer = _file_tokenizer(gguf, index)

    def write(staging: Path) -> None:
        config.save_pretrained(staging)  # the weights are named alike in a readable_config's model
        model.generation_config.save_pretrained(staging)
        save_model(model, str(staging / "model.safetensors"))
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)

    _write_staged(folder, write)
