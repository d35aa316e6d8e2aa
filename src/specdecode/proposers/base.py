"""The proposer contract: guess up to k next tokens for a context (a ``sampling.draft.Draft``), plus optional hooks
whose defaults do nothing, so the engine and the server call them directly.

A user's object that only has ``propose`` (duck-typed, as the public API allows) is adapted once where it enters
(``as_proposer``: ``SpeculativeDecoder``, the server's slots, ``HybridProposer``'s model side).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..sampling.draft import Draft
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams

if TYPE_CHECKING:
    from ..models.loaded import LoadedModel


class Proposer:
    """Guesses continuations; resyncs any state of its own (a KV cache) to the context it is given.

    Subclasses implement ``propose``; every other member is an optional hook with a no-op default.
    """

    needs_target_hidden: bool = False  # the engine captures the target's features and hands them to observe_target
    couples_with_keyed_noise: bool = False  # propose_coupled draws with the request's keyed noise (reproducible)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        """At most ``k`` guessed tokens following ``context`` (prompt + generated so far)."""
        raise NotImplementedError(f"{type(self).__name__} must implement propose()")

    def propose_coupled(self, context: list[int], k: int, params: SamplingParams, noise: KeyedNoise) -> Draft:
        """At most ``k`` guesses, guess i drawn with the noise of absolute position ``len(context) + i`` (only where
        ``couples_with_keyed_noise``; otherwise reproducible mode calls ``propose``)."""
        raise TypeError(f"{type(self).__name__} cannot draft with keyed noise (reproducible mode)")

    def vocabulary_model(self) -> LoadedModel | None:
        """The model whose vocabulary must equal the target's (a draft model's), or None."""
        return None

    def bind_target(self, vocabulary: str, costs=None, vocab_size: int | None = None) -> None:
        """The target's vocabulary fingerprint, the decoder's measured ``control.PassCosts`` and vocabulary size."""

    def observe_target(self, hidden: list[torch.Tensor]) -> None:
        """The target's features of the verified positions so far (``needs_target_hidden`` only)."""

    def end_request(self, context: list[int]) -> None:
        """A request ended with ``context`` (prompt + output): a proposer that remembers requests keeps it."""


class DuckTypedProposer(Proposer):
    """A user's object with ``propose`` seen as a ``Proposer``: the hooks it defines (``needs_target_hidden`` with
    ``observe_target``, ``propose_coupled``, ``bind_target``, ``end_request``, a draft ``model``) are its own, the
    rest the base class's no-ops. The only place the hooks are looked up by name."""

    def __init__(self, wrapped: object) -> None:
        self.wrapped = wrapped
        self.needs_target_hidden = bool(getattr(wrapped, "needs_target_hidden", False))
        self.couples_with_keyed_noise = callable(getattr(wrapped, "propose_coupled", None))
        for hook in ("propose_coupled", "bind_target", "observe_target", "end_request"):
            method = getattr(wrapped, hook, None)
            if callable(method):
                setattr(self, hook, method)
        self._model = getattr(wrapped, "model", None)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return self.wrapped.propose(context, k, params, generator)  # type: ignore[attr-defined]

    def vocabulary_model(self) -> LoadedModel | None:
        from ..models.loaded import LoadedModel

        return self._model if isinstance(self._model, LoadedModel) else None


def as_proposer(proposer: object) -> Proposer:
    """``proposer`` itself if it subclasses ``Proposer``, else adapted (``DuckTypedProposer``); a clear error for an
    object without ``propose``."""
    if isinstance(proposer, Proposer):
        return proposer
    if not callable(getattr(proposer, "propose", None)):
        raise ValueError(f"a proposer needs a propose(context, k, params, generator) method; got {proposer!r}")
    return DuckTypedProposer(proposer)


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
