"""Model backends: the runner contract, the transformers runner, and loading."""

from .loaded import LoadedModel
from .loading.loader import load_model
from .runner import ModelRunner
from .transformers_runner import HFRunner

__all__ = ["HFRunner", "LoadedModel", "ModelRunner", "load_model"]
