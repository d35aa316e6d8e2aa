"""A separate (smaller) draft model that samples its guesses with the request's warps."""

from __future__ import annotations

import torch

from ..models.loader import LoadedModel
from ..params import SamplingParams
from ..sampling import probs_from_logits, sample
from .base import EMPTY_DRAFT, Draft, common_prefix_length


class DraftModelProposer:
    """Autoregressive guesses from ``model``, with its own runner and KV cache.

    Cache invariant: ``self._cached`` lists exactly the tokens in the draft's cache. Each ``propose`` rolls
    the cache back to the longest prefix it shares with the context and feeds the rest (after a fully
    accepted round that is the draft's own last guess and the bonus token).
    """

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._runner = model.new_runner()
        self._cached: list[int] = []

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        if k <= 0:
            return EMPTY_DRAFT
        keep = min(common_prefix_length(self._cached, context), len(context) - 1)
        self._runner.rollback_to(keep)
        logits = self._runner.forward(torch.tensor(context[keep:], dtype=torch.int64))[-1]
        tokens = torch.empty(k, dtype=torch.int64)
        probs = None if params.greedy else torch.empty(k, logits.shape[-1])
        for i in range(k):
            if probs is None:
                tokens[i] = logits.argmax()
            else:
                probs[i] = probs_from_logits(logits, params)
                tokens[i] = sample(probs[i], generator)
            if i + 1 < k:
                logits = self._runner.forward(tokens[i : i + 1])[-1]
        guesses = tokens.tolist()
        self._cached = context + guesses[:-1]
        return Draft(tokens, probs)
