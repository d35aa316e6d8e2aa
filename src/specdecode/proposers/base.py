"""The proposer contract: guess up to k next tokens for a context (a ``Draft``, from ``specdecode.draft`` and
re-exported here)."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from ..draft import EMPTY_DRAFT as EMPTY_DRAFT
from ..draft import Draft as Draft
from ..keyed_noise import KeyedNoise
from ..params import SamplingParams


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
