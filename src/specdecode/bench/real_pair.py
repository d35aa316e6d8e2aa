"""The real model pair the speed work is measured on: Qwen2.5-Coder-1.5B-Instruct (target) and its 0.5B sibling
(draft), Q4_K_M GGUF files sharing one tokenizer, fetched once by ``../shared/tools/real_models.py`` (~1.6 GB, pinned
by SHA-256) into ``$SPECDECODE_REAL_MODELS`` (default ``~/.cache/specdecode-real-models``). Nothing here downloads:
benchmarks and slow tests find the files or say how to get them."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# file name → size in bytes, as real_models.py pins them (a file of another size is a partial or another file)
TARGET = ("qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768)
DRAFT = ("qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064)
FETCH = "python ../shared/tools/real_models.py (from the repository root; ~1.6 GB once)"


@dataclass(frozen=True)
class RealPair:
    target: Path
    draft: Path


def real_models_dir() -> Path:
    """Where the real models are looked for: ``$SPECDECODE_REAL_MODELS``, else ``~/.cache/specdecode-real-models``."""
    folder = os.environ.get("SPECDECODE_REAL_MODELS")
    return Path(folder) if folder else Path.home() / ".cache" / "specdecode-real-models"


def find_real_pair() -> RealPair | str:
    """The pair's paths, or why it is not here (a sentence naming the missing file and the command that fetches it)."""
    folder = real_models_dir()
    found = []
    for name, size in (TARGET, DRAFT):
        path = folder / name
        if not path.is_file():
            return f"{path} is missing: fetch the real model pair with {FETCH}"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size:,} bytes, not {size:,}: fetch it again with {FETCH}"
        found.append(path)
    return RealPair(*found)
