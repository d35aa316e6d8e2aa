"""The proposer contract: guess up to k next tokens for a context."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from ..keyed_noise import KeyedNoise
from ..params import SamplingParams


@dataclass(frozen=True)
class Draft:
    """Guessed tokens ``[n]`` (int64), the distributions they were drawn from ``[n, V]``, and their tree.

    ``probs`` is None for a deterministic proposer: a point mass on each token (q_i(x_i) = 1).
    ``parents`` is None for a chain (node i follows node i-1). For a token tree it is int64 ``[n]`` with
    ``parents[i] < i`` (topological order) and -1 for a child of the context's newest token. Siblings share
    one draft distribution: ``probs[i]`` is the distribution node i and its siblings were drawn from, without
    replacement, in index order.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None = None
    parents: torch.Tensor | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def is_tree(self) -> bool:
        """True when some node branches (a chain given with explicit parents is still a chain)."""
        if self.parents is None:
            return False
        return bool((self.parents != torch.arange(-1, len(self) - 1)).any())

    def truncated(self, k: int) -> Draft:
        """The first ``k`` guesses (for a tree: the first ``k`` nodes, still a tree since parents precede)."""
        return Draft(
            self.tokens[:k],
            None if self.probs is None else self.probs[:k],
            None if self.parents is None else self.parents[:k],
        )


EMPTY_DRAFT = Draft(torch.zeros(0, dtype=torch.int64))


@runtime_checkable
class Proposer(Protocol):
    """Guesses continuations; resyncs any state of its own (a KV cache) to the context it is given."""

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """At most ``k`` guessed tokens following ``context`` (prompt + generated so far)."""
        ...


@runtime_checkable
class CoupledProposer(Protocol):
    """A proposer that can draw its guesses with the request's keyed noise (reproducible mode's coupling)."""

    def propose_coupled(self, context: list[int], k: int, params: SamplingParams, noise: KeyedNoise) -> Draft:
        """At most ``k`` guesses, guess i drawn with the noise of absolute position ``len(context) + i``."""
        ...


def common_prefix_length(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo] and a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo
