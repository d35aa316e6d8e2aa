"""What ``load_model`` is given, resolved before any weight is read: a bundled name, a ``.gguf`` file or an HF
folder → where its config and tokenizer are, its checkpoint and stored dtype, and the skeleton (parameters on the
meta device) that the loader fills itself where the native runner runs the architecture."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ...errors import ModelNotAvailable
from ..gguf.conversions import metadata_cache
from ..native.architecture import tied_head
from ..native.layers import supports_native
from .bundled import BUNDLED
from .checkpoint import Checkpoint, checkpoint_of

if TYPE_CHECKING:  # transformers.modeling_utils costs ~2 s at `import specdecode`; loading a model imports it
    from transformers import PreTrainedModel

_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


@dataclass(frozen=True)
class Source:
    """A bundled name, a ``.gguf`` file or an HF folder, located."""

    folder: Path  # a transformers folder: the HF folder itself, or a GGUF file's config and tokenizer (cached)
    name: str  # what the loaded model is called
    gguf_path: Path | None  # the GGUF file (None: an HF folder)
    checkpoint: Checkpoint | None  # an HF folder's safetensors (None: a GGUF file, or a folder without any)
    stored: torch.dtype | None  # an HF folder's weights' dtype (None: a GGUF file, or unknown)


def resolve_source(text: str) -> Source:
    """``text`` located (``locate``), with its checkpoint and stored dtype for an HF folder."""
    folder, name, gguf_path = locate(text)
    checkpoint = checkpoint_of(folder) if gguf_path is None else None
    stored = None if gguf_path is not None else stored_dtype(folder, checkpoint)
    return Source(folder, name, gguf_path, checkpoint, stored)


def native_skeleton(source: Source) -> PreTrainedModel | None:
    """The skeleton ``load_model`` fills itself: a GGUF file's, or an HF folder's whose architecture is native and
    whose checkpoint holds every parameter under its own name; None where transformers' loader reads the folder."""
    if source.gguf_path is None and source.checkpoint is None:
        return None
    model = skeleton(source.folder)
    if source.gguf_path is None and not (supports_native(model) and fills(model, source.checkpoint)):
        return None  # transformers' loader: other architectures, renamed or converted tensors
    return model


def skeleton(folder: Path) -> PreTrainedModel:
    """The model of ``folder``'s config with every parameter on the meta device (buffers such as RoPE's inverse
    frequencies are computed): the weights come from the GGUF file afterwards, never through a dense copy."""
    from accelerate import init_empty_weights

    config = AutoConfig.from_pretrained(folder)
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def stored_dtype(folder: Path, checkpoint: Checkpoint | None) -> torch.dtype | None:
    """The float dtype of a folder's weights: its safetensors', else its config's (None where neither says)."""
    if checkpoint is not None and checkpoint.dtype is not None:
        return checkpoint.dtype
    config = json.loads((folder / "config.json").read_text()) if (folder / "config.json").is_file() else {}
    named = config.get("dtype") or config.get("torch_dtype")
    return getattr(torch, named, None) if isinstance(named, str) else None


def default_dtype(stored: torch.dtype | None, quantization: str | None) -> torch.dtype:
    """``load_model``'s dtype when none is given: float32 under quantized weights (their residual stream), else the
    checkpoint's own where the native runner runs it (float16 → bfloat16: the same bytes, 3 fewer mantissa bits, a
    wider range), else float32."""
    if quantization not in (None, "auto") or stored is None:
        return torch.float32
    return torch.float32 if stored == torch.float32 else torch.bfloat16


def fills(model: PreTrainedModel, checkpoint: Checkpoint) -> bool:
    """Whether ``checkpoint`` holds every parameter of ``model`` under its own name (a tied head: the embedding)."""
    tied = tied_head(model)
    return all(name in checkpoint or (tied and name == "lm_head.weight") for name, _ in model.named_parameters())


def load_tokenizer(source: str) -> Any:
    """The tokenizer ``load_model(source)`` attaches (a bundled name, a .gguf file or a folder), without loading
    the weights; None when the folder has none."""
    folder, _, _ = locate(str(source))
    if not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None  # transformers would build an empty tokenizer of the config's class (Qwen, Gemma: 1-5 tokens)
    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None


def locate(text: str) -> tuple[Path, str, Path | None]:
    """(transformers folder, display name, GGUF file or None) for a bundled name, a .gguf path or a folder."""
    if text in BUNDLED:
        gguf = BUNDLED[text].gguf_path()
        return metadata_cache(gguf), text, gguf
    path = Path(text).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotAvailable(f"GGUF file not found: {path}")
        return metadata_cache(path), path.name, path
    if path.is_dir():
        return path, path.name, None
    known = ", ".join(BUNDLED)
    raise ModelNotAvailable(f"'{text}' is neither a bundled model ({known}), a .gguf file nor a model folder")
