"""Prompt lookup: copy what followed the latest earlier occurrence of the context's last n-gram."""

from __future__ import annotations

import torch

from ..params import SamplingParams
from .base import EMPTY_DRAFT, Draft, common_prefix_length


class PromptLookupProposer:
    """Deterministic guesses (a point mass, ``probs=None``) copied from the prompt and generated text.

    For n from ``max_ngram`` down to ``min_ngram``, the context's last n tokens are looked up among earlier
    n-grams; the most recent match wins and the tokens that followed it are proposed. The n-gram index is
    incremental: ``_latest[n][ngram]`` is the position right after the latest occurrence of ``ngram`` whose
    follower is known, so each new token costs O(max_ngram) and no rescans of the context happen.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self._indexed: list[int] = []
        self._latest: dict[int, dict[tuple[int, ...], int]] = {}

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        self._sync(context)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            start = self._latest[n].get(tuple(context[-n:]))
            if start is not None:
                return Draft(torch.tensor(context[start : start + k], dtype=torch.int64))
        return EMPTY_DRAFT

    def _sync(self, context: list[int]) -> None:
        """Index every n-gram of ``context`` that has a follower inside ``context``."""
        done = len(self._indexed)
        if common_prefix_length(self._indexed, context) < done:
            self._latest = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
            done = 0
        elif not self._latest:
            self._latest = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
        # an n-gram ending at position end-1 has its follower at `end`, known once end < len(context)
        for end in range(max(done, 1), len(context)):
            for n, table in self._latest.items():
                if end >= n:
                    table[tuple(context[end - n : end])] = end
        self._indexed = list(context)
