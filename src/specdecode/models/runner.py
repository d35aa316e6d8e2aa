"""The ModelRunner contract every model backend implements: what each runner provides, with a default for each
capability a runner may lack, so callers use every member directly (no probing)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(frozen=True)
class KVRows:
    """Cache entries ``start..start+tokens-1`` copied out of a runner, in its own layout (``export_rows``), to append
    to a runner over the same weights (``append_rows``)."""

    keys: torch.Tensor
    values: torch.Tensor
    tokens: int

    @property
    def nbytes(self) -> int:
        return self.keys.numel() * self.keys.element_size() + self.values.numel() * self.values.element_size()


@runtime_checkable
class ModelRunner(Protocol):
    """A causal LM with a KV cache that can grow by k tokens in one pass and shrink back.

    Invariant: ``length`` tokens are in the cache, at positions ``0 .. length-1``; ``forward`` places its
    ``k`` tokens at positions ``length .. length+k-1`` and returns their logits, sliced to the real
    vocabulary (``vocab_size`` columns: padded embedding rows never reach sampling).

    Runners subclass this class: the members without a body are what every runner provides; the others are
    defaults for a capability a runner may lack (a batched pass over several caches, reusing a prefix across
    requests, copying cache rows between runners).
    """

    vocab_size: int
    capture_hidden: bool = False  # set by the engine: each pass keeps ``hidden`` (an EAGLE or Medusa head reads it)
    hidden: torch.Tensor | None = None  # the last pass's final decoder-layer rows, before the final norm (float32)
    # A prefill stores exactly what one-token steps store, so a kept prefix plus a prefill of the rest is bitwise a
    # full prefill: a cache may be reused across requests (the engine's chat reuse, the server's prefix cache).
    exact_prefix_reuse: bool = False

    @property
    def length(self) -> int:
        """Number of tokens held in the KV cache."""
        ...

    def forward(
        self, tokens: torch.Tensor, positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Append ``tokens`` (int64 ``[k]``) to the cache; return float32 logits ``[k, vocab_size]``. A token tree
        gives each token's RoPE position (``positions`` int64 ``[k]``) and what it attends to (``attn_mask`` bool
        ``[k, length + k]``, True = may attend); by default token i sits at ``length + i`` and sees every slot
        before it and itself."""
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

    def forward_batch(self, runners: Sequence[ModelRunner], tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Append ``tokens[i]`` (int64 ``[k_i]``, a chain) to ``runners[i]`` (runners over this runner's model, each
        with its own cache); return each one's logits ``[k_i, vocab_size]``, bitwise its own ``forward``'s (row
        invariance: a request's output does not depend on which requests share the pass). By default one
        ``forward`` each; the native runner runs every row in one pass through the weights."""
        check_batch(runners, tokens)
        return [runner.forward(chunk) for runner, chunk in zip(runners, tokens, strict=True)]

    def export_rows(self, start: int, end: int) -> KVRows:
        """A copy of the cache entries at slots ``start..end-1`` (runners with ``exact_prefix_reuse`` only)."""
        raise NotImplementedError(f"{type(self).__name__} cannot copy its cache rows out (exact_prefix_reuse)")

    def append_rows(self, rows: KVRows) -> None:
        """Append entries ``export_rows`` copied from a runner over the same weights (``exact_prefix_reuse`` only)."""
        raise NotImplementedError(f"{type(self).__name__} cannot take cache rows in (exact_prefix_reuse)")


def check_batch(runners: Sequence[ModelRunner], tokens: Sequence[torch.Tensor]) -> None:
    """``forward_batch``'s arguments: a chunk of tokens per runner."""
    if len(runners) != len(tokens):
        raise ValueError(f"forward_batch got {len(runners)} runners but {len(tokens)} token chunks")


def check_retained_slots(start: int, slots: Sequence[int], length: int) -> torch.Tensor:
    """``slots`` as an int64 tensor after checking ``start <= s_0 < s_1 < ... < length`` (``retain``'s contract)."""
    index = torch.as_tensor(list(slots), dtype=torch.int64)
    if not 0 <= start <= length:
        raise ValueError(f"retain start {start} outside 0..{length}")
    if index.numel() and (int(index[0]) < start or int(index[-1]) >= length or bool((index[1:] <= index[:-1]).any())):
        raise ValueError(f"retained slots must be ascending within {start}..{length - 1}, got {index.tolist()}")
    return index
