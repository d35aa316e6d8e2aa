"""Copy where the text repeats, else ask a model: a copier's guesses (suffix decoding, ``eagle+suffix``, or prompt
lookup, ``eagle+lookup``) when the context's last tokens matched at least ``min_order`` tokens of earlier text, the
draft model's (an EAGLE head's) otherwise.

A copied run is accepted far more often than a head's guess where text repeats (a summary quoting its source, a
second turn revising the first, code), and costs little to find; a head guesses anywhere but is accepted ~45% of
the time on chat and costs ~0.12 of a step a guess. So each round drafts one way: the copier's draft, as deep as
its match earns (up to the round's k), when its match is long enough and it offers at least ``min_copied``
tokens (or all k, where k is smaller); else the model's, at most ``model_gamma`` guesses (γ1 pays best for the
shipped head on a CPU). Under ``gamma="auto"`` each side has its own controller (``control.HybridGamma``; the
server keeps per-side books), so a copy's length and whether the head drafts at all are priced apart. With prompt
lookup's 2- and 3-gram matches it is the fastest method here on Spec-Bench and on chat (docs/BENCHMARKS.md).

Exactness: which proposer drafts is a function of the context and the round's k alone (the suffix match; right
after a ``preview``, of the k previewed too), never of a draw, so the round is verified against the chosen
proposer's own law (``probs``; a copied run is a point mass) and every verification rule stays exact; in
reproducible mode the model drafts with the keyed noise, copies are fixed.
"""

from __future__ import annotations

import torch

from ..sampling.draft import Draft
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams
from .base import Proposer, as_proposer
from .prompt_lookup import PromptLookupProposer
from .suffix import SuffixProposer

GREEDY_PREVIEW = SamplingParams(temperature=0.0)  # a copy is the same whatever the sampling settings
DEFAULT_MIN_ORDER = 4  # tokens of matched suffix before a copy is trusted (2 to 8 measured: docs/BENCHMARKS.md)


Copier = SuffixProposer | PromptLookupProposer  # what a hybrid copies with: ``last_order`` and ``fork``


class HybridProposer(Proposer):
    """Drafts each round with ``copier`` (suffix decoding by default, or prompt lookup) or ``model`` (EAGLE, Medusa,
    a draft model).

    A fixed ``gamma`` caps a copied run; the model drafts at most ``model_gamma`` guesses a round. Under
    ``gamma="auto"`` each side has its own controller (``control.HybridGamma`` in the decoder,
    per-side books in the server): ``preview`` says which side would draft and how far, and that side's acceptance
    and drafting price choose the round's length, 0 (a plain round) included.
    """

    couples_with_keyed_noise = True  # copies are fixed; the model side must couple (else a TypeError)

    def __init__(
        self,
        model: Proposer,
        copier: Copier | None = None,
        *,
        min_order: int = DEFAULT_MIN_ORDER,
        min_copied: int = 2,
        model_gamma: int = 1,
    ) -> None:
        if min_order < 1:
            raise ValueError(f"min_order must be >= 1, got {min_order}")
        if min_copied < 1:
            raise ValueError(f"min_copied must be >= 1, got {min_copied}")
        if model_gamma < 1:
            raise ValueError(f"model_gamma must be >= 1, got {model_gamma}")
        self.model = as_proposer(model)
        self.copier: Copier = SuffixProposer() if copier is None else copier
        self.min_order = min_order
        self.min_copied = min_copied
        self.model_gamma = model_gamma
        self.needs_target_hidden = self.model.needs_target_hidden
        self.copied_rounds = 0  # rounds drafted by each side, for reports and tests
        self.model_rounds = 0
        self.last_side: str | None = None  # "copy" or "model": who drafted the last round (the server's books)
        self._previewed: tuple[list[int], int, int, Draft | None] | None = None  # context, its length, k, the copy

    @property
    def copier_sizes_its_drafts(self) -> bool:
        """Whether a copied run is as long as the copier finds it pays (suffix decoding: its match's depth and the
        measured v(k)) rather than as long as asked (prompt lookup copies k tokens): γ auto then takes a copy as
        offered and prices only whether the model drafts."""
        return isinstance(self.copier, SuffixProposer)

    def fork(self) -> HybridProposer:
        """A proposer for another request stream: the copier's request state its own (the history shared), the
        model shared (it resyncs to the context it is given)."""
        return HybridProposer(
            self.model,
            self.copier.fork(),
            min_order=self.min_order,
            min_copied=self.min_copied,
            model_gamma=self.model_gamma,
        )

    def save(self, path) -> None:
        """Write the copier's history (``SuffixProposer.save``): ``generate --suffix-cache`` keeps it for next time."""
        if not isinstance(self.copier, SuffixProposer):
            raise TypeError(f"{type(self.copier).__name__} keeps no history to save (only suffix decoding does)")
        self.copier.save(path)

    # -- what the decoder hands over -----------------------------------------------------------------------

    def observe_target(self, hidden: list[torch.Tensor]) -> None:
        """An EAGLE head's features: kept by the model on copied rounds too, so it can catch up when it next drafts."""
        self.model.observe_target(hidden)

    def vocabulary_model(self):
        return self.model.vocabulary_model()

    def bind_target(self, vocabulary: str, costs=None, vocab_size: int | None = None) -> None:
        for side in (self.copier, self.model):
            side.bind_target(vocabulary, costs, vocab_size)

    def end_request(self, context: list[int]) -> None:
        for side in (self.copier, self.model):
            side.end_request(context)

    # -- drafting ------------------------------------------------------------------------------------------

    def preview(self, context: list[int], k: int) -> tuple[str, int]:
        """Which side would draft a round of at most ``k`` after ``context``, and how many tokens: ("copy", the
        copied run's length) or ("model", its guesses). A function of (context, k) alone; the server plans each
        round's length with the chosen side's acceptance (``serving.batching.scheduler``). The next ``propose`` on the
        same context with k' ≤ k drafts with the previewed side (``_copy``), so the side priced is the side that drafts
        (searched afresh, a round whose plan cut k below ``min_copied`` could copy instead), and takes a chained
        copy's first k' tokens instead of searching again (~0.06 ms of a ~5 ms round)."""
        self._previewed = None
        copied = self._copy(context, k, GREEDY_PREVIEW, torch.Generator(), count=False)
        self._previewed = (context, len(context), k, copied)
        if copied is not None:
            return "copy", len(copied)
        return "model", min(k, self.model_gamma)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        copied = self._copy(context, k, params, generator)
        if copied is not None:
            return copied
        self._count_model_round(k)
        return self.model.propose(context, min(k, self.model_gamma), params, generator)

    def propose_coupled(self, context: list[int], k: int, params: SamplingParams, noise: KeyedNoise) -> Draft:
        copied = self._copy(context, k, params, torch.Generator())  # a copy draws nothing
        if copied is not None:
            return copied
        self._count_model_round(k)
        return self.model.propose_coupled(context, min(k, self.model_gamma), params, noise)

    def _count_model_round(self, k: int) -> None:
        """k 0 is a plain step (the server's policy, a spent budget): the model is still called, to catch up."""
        if k > 0:
            self.model_rounds += 1
            self.last_side = "model"

    def _copy(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator, count: bool = True
    ) -> Draft | None:
        """The copier's draft if its match is at least ``min_order`` tokens and it offers ``min_copied`` tokens
        (or all k, where k is smaller); after a ``preview`` of this context at k or more, the previewed choice: the
        copier's chain at k is the first k tokens of its chain at a larger k (prompt lookup: the same occurrence's
        continuation; suffix decoding: the same matches, each continuation cut shorter, the same most frequent child
        at every depth; a tree is searched again)."""
        previewed, self._previewed = self._previewed, None
        if k <= 0:
            return None
        if previewed is not None and previewed[0] is context and previewed[1] == len(context) and k <= previewed[2]:
            draft = previewed[3]
            if draft is None or not draft.is_tree:
                if draft is not None and count:
                    self.copied_rounds += 1
                    self.last_side = "copy"
                return None if draft is None else draft.truncated(k)
        draft = self.copier.propose(context, k, params, generator)
        if self.copier.last_order < self.min_order or len(draft) < min(self.min_copied, k):
            return None
        if count:
            self.copied_rounds += 1
            self.last_side = "copy"
        return draft
