"""Model backends: the runner contract, the transformers runner, and loading."""

from .base import ModelRunner
from .hf import HFRunner
from .loader import LoadedModel, load_model

__all__ = ["HFRunner", "LoadedModel", "ModelRunner", "load_model"]
