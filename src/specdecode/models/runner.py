"""The ModelRunner contract every model backend implements."""

from __future__ import annotations

from collections.abc import Sequence
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

    def retain(self, start: int, slots: Sequence[int]) -> None:
        """Keep the entries at ``slots`` (ascending, in ``start..length-1``) as slots ``start..start+m-1``.

        Token trees: after a pass over a tree, only the accepted branch stays; ``length`` becomes ``start + m``.
        """
        ...

    def reset(self) -> None:
        """Empty the cache."""
        ...


def check_retained_slots(start: int, slots: Sequence[int], length: int) -> torch.Tensor:
    """``slots`` as an int64 tensor after checking ``start <= s_0 < s_1 < ... < length`` (``retain``'s contract)."""
    index = torch.as_tensor(list(slots), dtype=torch.int64)
    if not 0 <= start <= length:
        raise ValueError(f"retain start {start} outside 0..{length}")
    if index.numel() and (int(index[0]) < start or int(index[-1]) >= length or bool((index[1:] <= index[:-1]).any())):
        raise ValueError(f"retained slots must be ascending within {start}..{length - 1}, got {index.tolist()}")
    return index
