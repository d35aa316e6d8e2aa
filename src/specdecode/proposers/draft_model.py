"""A separate (smaller) draft model that samples its guesses with the request's warps."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..models.loaded import LoadedModel
from ..models.native.drafting_head import DraftingHead
from ..models.native.runner import NativeRunner
from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams
from ..sampling.probs import greedy_tokens, probs_from_logits, sample
from .base import Proposer, common_prefix_length

# After a round the draft is behind by one token (a rejection: the target's correction) or two (all accepted:
# its own last guess and the bonus). Feeding them in one forward costs about one step, as feeding one does
# (the step is bound by reading the weights); a separate prefill call would cost another step.
CATCH_UP_ROWS = 4
# vocabulary="auto": a head of more than 1.5 × this many rows drafts over this many (and the request's own tokens)
DRAFTING_VOCABULARY = 65536

Pick = Callable[[torch.Tensor, int], tuple[int, torch.Tensor | None]]


class DraftModelProposer(Proposer):
    """Autoregressive guesses from ``model``, with its own runner and KV cache.

    ``vocabulary``: how many token ids the draft's head computes logits for (``DraftingHead``: the first N ids, plus
    the request's own tokens past them and the special tokens; −inf elsewhere, so no guess falls there). ``"auto"``
    cuts a head of more than 1.5 × ``DRAFTING_VOCABULARY`` rows to that many where the draft's head runs on the
    compiled kernels; ``None`` keeps the whole head. Output is the target's either way: a
    sampled guess comes with the distribution it was drawn from.

    Cache invariant: ``self._cached`` lists exactly the tokens in the draft's cache. Each ``propose`` rolls
    the cache back to the longest prefix it shares with the context and feeds the rest (after a fully
    accepted round that is the draft's own last guess and the bonus token) in the same forward as the first
    guess's, when it is a few tokens.
    """

    couples_with_keyed_noise = True

    def __init__(self, model: LoadedModel, vocabulary: int | str | None = "auto") -> None:
        self.model = model
        self.vocabulary = vocabulary
        self._runner = model.new_runner()
        self._cached: list[int] = []
        self.head = drafting_head(model, self._runner, vocabulary)
        if self.head is not None:
            self._runner.capture_hidden = True

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

    def _last_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Feed ``tokens``; the logits after the last one (through the drafting head, when there is one)."""
        if self.head is None:
            return self._runner.forward(tokens)[-1]
        self._runner.prefill(tokens)
        return self.head.logits(self._runner.hidden[-1:])[0]

    def _draft(self, context: list[int], k: int, pick: Pick) -> Draft:
        """Feed the draft up to ``context`` and take ``k`` guesses, each ``pick(logits, i)`` → (token, probs)."""
        if k <= 0:
            return EMPTY_DRAFT
        keep = min(common_prefix_length(self._cached, context), len(context) - 1)
        self._runner.rollback_to(keep)
        new = torch.tensor(context[keep:], dtype=torch.int64)
        if self.head is not None:
            self.head.use(context)
        if len(new) <= CATCH_UP_ROWS:  # one pass: the draft's weights are read once for the few new tokens
            logits = self._last_logits(new)
        else:  # a prompt: prefill without the head's rows, then the last token
            self._runner.prefill(new[:-1])
            logits = self._last_logits(new[-1:])
        tokens = torch.empty(k, dtype=torch.int64)
        rows: list[torch.Tensor | None] = []
        for i in range(k):
            token, probs = pick(logits, i)
            tokens[i] = token
            rows.append(probs)
            if i + 1 < k:
                logits = self._last_logits(tokens[i : i + 1])
        guesses = tokens.tolist()
        self._cached = context + guesses[:-1]
        return Draft(tokens, None if rows[0] is None else torch.stack(rows))


def drafting_head(model: LoadedModel, runner, vocabulary: int | str | None = "auto") -> DraftingHead | None:
    """The head ``vocabulary`` asks for on ``runner`` (see ``DraftModelProposer``), or None for the model's own."""
    if vocabulary is None:
        return None
    auto = vocabulary == "auto"
    if not auto and (isinstance(vocabulary, bool) or not isinstance(vocabulary, int)):
        raise ValueError(f"vocabulary must be a number of tokens, 'auto' or None, got {vocabulary!r}")
    keep = DRAFTING_VOCABULARY if auto else vocabulary
    size = model.vocab_size
    if auto and size <= 1.5 * keep:
        return None
    if not 0 < keep < size:
        if auto:
            return None
        raise ValueError(f"vocabulary must be in 1..{size - 1} for this draft (its vocabulary), got {keep}")
    supported = isinstance(runner, NativeRunner) and DraftingHead.supports(runner.decoder)
    if not supported:
        if auto:
            return None
        raise ValueError("a cut drafting vocabulary needs a draft on the compiled kernels with a quantized head "
                         "(a GGUF file, or quantization int8/int4); use vocabulary=None")  # fmt: skip
    special = set(model.eos_token_ids)
    if model.tokenizer is not None:
        special.update(model.tokenizer.all_special_ids)
    return DraftingHead(runner.decoder, keep, special)
