"""Errors a user can act on; the CLI prints them as one line."""

from __future__ import annotations


class SpecDecodeError(Exception):
    """Base class for specdecode's own errors."""


class ModelNotAvailable(SpecDecodeError):
    """A model name or path that cannot be loaded here (missing package, file or folder)."""


class VocabularyMismatch(SpecDecodeError, ValueError):
    """Target and draft do not share one vocabulary, so draft probabilities are not comparable to the target's."""
