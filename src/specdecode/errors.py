"""Errors a user can act on; the CLI prints them as one line."""

from __future__ import annotations

import importlib
from types import ModuleType


class SpecDecodeError(Exception):
    """Base class for specdecode's own errors."""


class ModelNotAvailable(SpecDecodeError):
    """A model name or path that cannot be loaded here (missing package, file or folder)."""


class VocabularyMismatch(SpecDecodeError, ValueError):
    """Target and draft do not share one vocabulary, so draft probabilities are not comparable to the target's."""


class MissingExtra(SpecDecodeError, ImportError):
    """An optional dependency is not installed; the message names the extra that brings it."""


def optional_import(module: str, extra: str, feature: str) -> ModuleType:
    """``module``, imported; if it is not installed, ``MissingExtra`` in one line: what needs it and the extra that
    brings it (``pip install 'specdecode[extra]'``)."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        package = module.partition(".")[0]
        raise MissingExtra(f"{feature} needs {package}: pip install 'specdecode[{extra}]'") from None
