"""Prompt lookup: copy what followed earlier occurrences of the context's last n-gram (a chain or a tree)."""

from __future__ import annotations

import torch

from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.params import SamplingParams
from .base import Proposer, common_prefix_length

SCANNED_OCCURRENCES = 64  # per n-gram and round, when gathering several continuations for a tree


class PromptLookupProposer(Proposer):
    """Deterministic guesses (a point mass, ``probs=None``) copied from the prompt and generated text.

    For n from ``max_ngram`` down to ``min_ngram``, the context's last n tokens are looked up among earlier
    n-grams; the most recent match wins and the tokens that followed it are proposed. The n-gram index is
    incremental: ``_followers[n][ngram]`` lists the positions right after the occurrences of ``ngram`` whose
    follower is known (ascending), so each new token costs O(max_ngram) and no rescans of the context happen.

    With ``branches`` > 1 the draft is a token tree: the continuations of up to ``branches`` matches (longest
    n-gram first, then the most recent), merged into a trie so that shared prefixes are verified once and
    siblings are distinct. The first branch is the chain's draft; a continuation adding no new node (a prefix
    of one already taken) does not count.
    """

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, branches: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        if branches < 1:
            raise ValueError(f"branches must be >= 1, got {branches}")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.branches = branches
        self._indexed: list[int] = []
        self._followers: dict[int, dict[tuple[int, ...], list[int]]] = {}
        self.last_order = 0  # the n of the n-gram the last draft copied after (0: none matched)

    def fork(self) -> PromptLookupProposer:
        """The same settings for another request stream (the index is per context anyway)."""
        return PromptLookupProposer(self.max_ngram, self.min_ngram, self.branches)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        self.last_order = 0
        if k <= 0:
            return EMPTY_DRAFT
        self._sync(context)
        if self.branches > 1:
            return self._tree(context, k)
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            starts = self._followers[n].get(tuple(context[-n:]))
            if starts:
                self.last_order = n
                return Draft(torch.tensor(context[starts[-1] : starts[-1] + k], dtype=torch.int64))
        return EMPTY_DRAFT

    def _tree(self, context: list[int], k: int) -> Draft:
        """Up to ``branches`` distinct continuations of length ≤ k as a trie (parents precede children)."""
        node_of: dict[tuple[int, int], int] = {}  # (parent node, token) → node
        tokens: list[int] = []
        parents: list[int] = []
        taken = 0
        for n in range(min(self.max_ngram, len(context) - 1), self.min_ngram - 1, -1):
            starts = self._followers[n].get(tuple(context[-n:]), [])
            self.last_order = self.last_order or (n if starts else 0)  # the longest n that matched
            for start in reversed(starts[-SCANNED_OCCURRENCES:]):
                parent, grown = -1, False
                for token in context[start : start + k]:
                    node = node_of.get((parent, token))
                    if node is None:
                        node = node_of[parent, token] = len(tokens)
                        tokens.append(token)
                        parents.append(parent)
                        grown = True
                    parent = node
                taken += grown
                if taken == self.branches:
                    break
            if taken == self.branches:
                break
        if not tokens:
            return EMPTY_DRAFT
        return Draft(torch.tensor(tokens, dtype=torch.int64), None, torch.tensor(parents, dtype=torch.int64))

    def _sync(self, context: list[int]) -> None:
        """Index every n-gram of ``context`` that has a follower inside ``context``."""
        done = len(self._indexed)
        if common_prefix_length(self._indexed, context) < done or not self._followers:
            self._followers = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}
            done = 0
        # an n-gram ending at position end-1 has its follower at `end`, known once end < len(context)
        for end in range(max(done, 1), len(context)):
            for n, table in self._followers.items():
                if end >= n:
                    table.setdefault(tuple(context[end - n : end]), []).append(end)
        self._indexed = list(context)
