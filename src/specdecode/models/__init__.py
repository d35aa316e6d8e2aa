"""Models: the runner contract (``runner``), the two runners (``native/``: our own, ``transformers_runner``: any
causal LM), a loaded model and its memory (``loaded``, ``memory``), the weight formats (``formats/``), GGUF files
(``gguf/``) and ``load_model`` (``loading/``)."""

from .loaded import LoadedModel
from .loading.loader import load_model
from .native.runner import NativeRunner
from .runner import ModelRunner
from .transformers_runner import TransformersRunner

__all__ = ["LoadedModel", "ModelRunner", "NativeRunner", "TransformersRunner", "load_model"]
