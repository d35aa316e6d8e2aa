"""A separate (smaller) draft model that samples its guesses with the request's warps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models.loaded import LoadedModel
from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams
from ..sampling.probs import greedy_tokens, probs_from_logits, sample
from .base import Proposer, common_prefix_length

# After a round the draft is behind by one token (a rejection: the target's correction) or two (all accepted:
# its own last guess and the bonus). Feeding them in one forward costs about one step, as feeding one does
# (the step is bound by reading the weights); a separate prefill call would cost another step.
CATCH_UP_ROWS = 4

Pick = Callable[[torch.Tensor, int], tuple[int, torch.Tensor | None]]


class DraftModelProposer(Proposer):
    """Autoregressive guesses from ``model``, with its own runner and KV cache.

    Cache invariant: ``self._cached`` lists exactly the tokens in the draft's cache. Each ``propose`` rolls
    the cache back to the longest prefix it shares with the context and feeds the rest (after a fully
    accepted round that is the draft's own last guess and the bonus token) in the same forward as the first
    guess's, when it is a few tokens.
    """

    couples_with_keyed_noise = True

    def __init__(self, model: LoadedModel) -> None:
        self.model = model
        self._runner = model.new_runner()
        self._cached: list[int] = []

    def vocabulary_model(self) -> LoadedModel:
        return self.model

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        def pick(logits: torch.Tensor, i: int) -> tuple[int, torch.Tensor | None]:
            if params.greedy:
                return int(greedy_tokens(logits.unsqueeze(0))[0]), None
            probs = probs_from_logits(logits, params)
            return int(sample(probs, generator)), probs

        return self._draft(context, k, pick)

    def propose_coupled(self, context: list[int], k: int, params: SamplingParams, noise: KeyedNoise) -> Draft:
        """Guess i = argmax(warp(draft logits) + g(seed, len(context) + i)): the target's own noise.

        Given the noise each guess is a point mass, so ``probs`` is None; the guess equals the target's token
        whenever the two perturbed argmaxes agree, which is likely when the draft's distribution is close.
        """
        start = len(context)
        return self._draft(context, k, lambda logits, i: (noise.token(logits, params, start + i), None))

    def _draft(self, context: list[int], k: int, pick: Pick) -> Draft:
        """Feed the draft up to ``context`` and take ``k`` guesses, each ``pick(logits, i)`` → (token, probs)."""
        if k <= 0:
            return EMPTY_DRAFT
        keep = min(common_prefix_length(self._cached, context), len(context) - 1)
        self._runner.rollback_to(keep)
        new = torch.tensor(context[keep:], dtype=torch.int64)
        if len(new) <= CATCH_UP_ROWS:  # one pass: the draft's weights are read once for the few new tokens
            logits = self._runner.forward(new)[-1]
        else:  # a prompt: prefill without the head's rows, then the last token
            self._runner.prefill(new[:-1])
            logits = self._runner.forward(new[-1:])[-1]
        tokens = torch.empty(k, dtype=torch.int64)
        rows: list[torch.Tensor | None] = []
        for i in range(k):
            token, probs = pick(logits, i)
            tokens[i] = token
            rows.append(probs)
            if i + 1 < k:
                logits = self._runner.forward(tokens[i : i + 1])[-1]
        guesses = tokens.tolist()
        self._cached = context + guesses[:-1]
        return Draft(tokens, None if rows[0] is None else torch.stack(rows))
