"""The ModelRunner contract every model backend implements."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class ModelRunner(Protocol):
    """A causal LM with a KV cache that can grow by k tokens in one pass and shrink back.

    Invariant: ``length`` tokens are in the cache, at positions ``0 .. length-1``; ``forward`` places its
    ``k`` tokens at positions ``length .. length+k-1`` and returns their logits, sliced to the real
    vocabulary (``vocab_size`` columns: padded embedding rows never reach sampling).
    """

    vocab_size: int

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        ...

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append ``tokens`` (int64 ``[k]``) to the cache; return float32 logits ``[k, vocab_size]``."""
        ...

    def prefill(self, tokens: torch.Tensor) -> None:
        """Append ``tokens`` to the cache; their logits are not needed (the prompt's head)."""
        ...

    def rollback_to(self, length: int) -> None:
        """Drop cache entries past ``length`` (``0 <= length <= self.length``)."""
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...
