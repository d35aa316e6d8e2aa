"""The first-use conversions of a GGUF file, cached on disk: its config and tokenizer as an HF folder (a few MB,
``metadata_cache``) and, for architectures the native runner does not run, a dense float32 copy
(``dense_cache``). Each entry is keyed by the file's path, size and modification time, built by one process at a
time (a lock beside it) and staged, then renamed into place, so that a reader never sees it half-written."""

from __future__ import annotations

import copy
import hashlib
import sys
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from ...disk_cache import cache_root, ensure_entry, lock_of, source_meta, whole_hf_folder
from ...errors import ModelNotAvailable
from .config import complete_config, readable_config

CONFIG_VERSION = 2  # 2: what transformers' GGUF reader drops put back (``config``); entries of 1 are not read


def _cache_folder(gguf: Path, kind: str) -> Path:
    """Where a cache entry of ``gguf`` lives: keyed by the file's path, size and modification time and by how its
    config is read (``CONFIG_VERSION``)."""
    stat = gguf.stat()
    text = f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}:{CONFIG_VERSION}"
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    return cache_root() / kind / f"{gguf.stem}-{key}"


def dense_folder(gguf: Path) -> Path:
    """Where the dense copy of ``gguf`` lives (architectures the native runner does not run)."""
    return _cache_folder(gguf, "dense")


def _metadata_folder(gguf: Path) -> Path:
    """Where ``gguf``'s config and tokenizer live (a few MB: the weights stay in the file)."""
    return _cache_folder(gguf, "gguf")


def metadata_cache(gguf: Path) -> Path:
    """A HF folder with the GGUF's config and tokenizer, as transformers reads them from its metadata (built once:
    converting a 262,144-token vocabulary takes seconds)."""
    return _built_once(_metadata_folder(gguf), f"reading the metadata of {gguf.name}", _build_metadata, gguf)


def _built_once(folder: Path, what: str, build, gguf: Path) -> Path:
    """``folder``, calling ``build(gguf, staging)`` first unless it holds a whole entry (``cache.ensure_entry``:
    staged, checked, rebuilt if damaged; one builder across processes)."""
    return ensure_entry(folder, what, lambda staging: build(gguf, staging), source_meta(gguf), adopt=whole_hf_folder)


def _build_metadata(gguf: Path, folder: Path) -> None:
    """Write ``folder``: the GGUF's config and tokenizer (staged, then renamed into place)."""
    from .transformers_speedups import faster_transformers_gguf

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
    from .index import gguf_index

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


def build_lock(folder: Path) -> Path:
    """The lock file that its builder holds while ``folder`` is written (next to it: the folder appears whole)."""
    return lock_of(folder)


def dense_cache(gguf: Path) -> Path:
    """A HF folder with the GGUF's weights dequantized once to float32 safetensors (built on first use)."""
    return _built_once(dense_folder(gguf), f"the first-use copy of {gguf.name}", _build_dense_copy, gguf)


def _build_dense_copy(gguf: Path, folder: Path) -> None:
    """Write ``folder``: the GGUF's float32 weights, config and tokenizer (staged, then renamed into place)."""
    from safetensors.torch import save_model
    from transformers import GgufConfig

    from .transformers_speedups import faster_transformers_gguf

    index = _readable_index(gguf)
    config = AutoConfig.from_pretrained(metadata_cache(gguf))  # what transformers' reader drops, put back
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
