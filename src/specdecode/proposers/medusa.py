"""Medusa: K trained heads read the target's newest feature and guess the next K tokens at once, as a chain or a
fixed token tree of the heads' top choices (Medusa's ``medusa_choices``).

The engine sets ``capture_hidden`` on its runner for a proposer with ``needs_target_hidden`` and hands it the
verified rows' features through ``observe_target``; the newest of them, f_{n-2} (n = len(context)), is all the
heads read: head i guesses the token at position n+i, the draft's depth i+1 (positions: ``heads.medusa``).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..heads.medusa import load_heads, shipped_heads
from ..heads.model import TargetParts
from ..models.loaded import LoadedModel
from ..models.loading.loader import load_model
from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams
from .base import Proposer

Choice = tuple[int, ...]  # a tree node: its choice rank at each depth, (0,) = head 0's top token
# Each head's candidates in choice order, given its logits over the drafting vocabulary [depth, V_draft] and how
# many are needed: drafting-vocabulary indices [depth, width].
Ranking = Callable[[torch.Tensor, int], torch.Tensor]


def best_paths(rank_accuracy: Sequence[Sequence[float]], n: int) -> list[Choice]:
    """The ``n`` paths most likely to be accepted whole, each scored Π_d rank_accuracy[d][path[d]] (head d's
    held-out rate of being right with its path[d]-th choice; Medusa's independence estimate), best first. A
    path never scores above its prefix, so the result is prefix-closed: a valid tree."""
    depth, ranks = len(rank_accuracy), len(rank_accuracy[0])
    heap = [(-float(rank_accuracy[0][r]), (r,)) for r in range(ranks)]
    heapq.heapify(heap)
    chosen: list[Choice] = []
    while heap and len(chosen) < n:
        negative, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < depth:
            for r in range(ranks):
                heapq.heappush(heap, (negative * float(rank_accuracy[len(path)][r]), (*path, r)))
    return chosen


def chain(depth: int) -> list[Choice]:
    """The chain of each head's top choice: (0,), (0, 0), ..."""
    return [(0,) * d for d in range(1, depth + 1)]


class MedusaProposer(Proposer):
    """Guesses from Medusa heads: a token tree given by ``choices`` (paths of choice ranks, e.g. ``[(0,), (1,),
    (0, 0)]``: head 0's top two tokens, and head 1's top token after the first), by default the ``tree_nodes``
    paths the heads' held-out accuracies rate likeliest (``best_paths``); ``tree_nodes=None``: a chain of every
    head's top token.

    The default, 1 node (head 0's top token), was measured best on this project's CPU, where every verify row
    costs a large share of a step (docs/BENCHMARKS.md: 1, 2, 3 nodes and the 3-deep chain, in that order); trees
    of tens of nodes are Medusa's choice where verify cost is flat (GPUs).

    Every candidate is a deterministic function of the context (a point mass, ``probs=None``), so the tree is exact
    at any temperature. Reproducible mode (``propose_coupled``): each head's first choice is the token the
    target's keyed noise would pick from that head's logits at its position. The round's k bounds the depth.
    ``draft_vocab=N`` reads out only the first N ids of the heads' saved ranking. ``int8`` (default): the heads'
    blocks and the read-out rows run through the int8 weight-only kernel on bfloat16 activations, as
    ``EagleProposer``'s; ``int8=False`` with ``dtype``: the read-out in that dtype, the blocks in float32 (drafting
    numerics change which tokens are guessed, never the output)."""

    needs_target_hidden = True
    couples_with_keyed_noise = True

    def __init__(
        self,
        target: LoadedModel,
        heads: str | Path | None = None,
        tree_nodes: int | None = 1,
        choices: Sequence[Sequence[int]] | None = None,
        draft_vocab: int | None = None,
        dtype: torch.dtype = torch.bfloat16,
        int8: bool = True,
    ) -> None:
        if int8 and dtype != torch.bfloat16:
            raise ValueError(f"int8 read-out runs on bfloat16 activations: pass int8=False to draft in {dtype}")
        if tree_nodes is not None and (isinstance(tree_nodes, bool) or tree_nodes < 1):
            raise ValueError(f"tree_nodes must be a positive integer or None (a chain), got {tree_nodes!r}")
        if draft_vocab is not None and draft_vocab < 1:
            raise ValueError(f"draft_vocab must be a positive integer or None (all the heads'), got {draft_vocab!r}")
        self.target = load_model(target)
        folder = shipped_heads(self.target) if heads is None else Path(heads)
        self.heads, ranked, self.config = load_heads(folder, self.target)
        if int8:
            self.heads.to_int8()
        ranked = ranked[:draft_vocab]
        self.parts = TargetParts(self.target.model, self.target.vocab_size, ranked, dtype, int8)
        self._index = torch.full((self.parts.vocab_size,), -1, dtype=torch.int64)  # token id -> drafting index
        self._index[ranked] = torch.arange(ranked.numel())
        if choices is None:
            choices = chain(self.heads.num_heads) if tree_nodes is None else self._likeliest(tree_nodes, ranked.numel())
        self.choices = self._check(choices, ranked.numel())
        self._source: list[torch.Tensor] | None = None

    def _likeliest(self, tree_nodes: int, vocab: int) -> list[Choice]:
        figures = self.config.get("training", {}).get("held_out_by_draft_vocab", {})
        if not figures:
            raise ValueError("these Medusa heads record no held-out accuracies: pass choices=[...] explicitly")
        sizes = sorted(int(n) for n in figures)
        size = min((n for n in sizes if n >= vocab), default=sizes[-1])
        return best_paths(figures[str(size)]["rank_accuracy"], tree_nodes)

    def _check(self, choices: Sequence[Sequence[int]], vocab: int) -> list[Choice]:
        """``choices`` as a tree in node order (parents first, siblings by rank), each path checked."""
        paths = [tuple(int(r) for r in c) for c in choices]
        if not paths or len(set(paths)) != len(paths):
            raise ValueError("Medusa choices must be a non-empty list of distinct paths")
        present = set(paths)
        for path in paths:
            if not 1 <= len(path) <= self.heads.num_heads:
                raise ValueError(f"choice {path}: paths have 1 to {self.heads.num_heads} ranks (one per head)")
            if min(path) < 0 or max(path) >= vocab:
                raise ValueError(f"choice {path}: ranks must be in 0..{vocab - 1} (the drafting vocabulary)")
            if len(path) > 1 and path[:-1] not in present:
                raise ValueError(f"choice {path} needs its prefix {path[:-1]} among the choices")
        return sorted(paths, key=lambda p: (len(p), p))

    def observe_target(self, hidden: list[torch.Tensor]) -> None:
        """The request's verified target features so far: chunks [n_i, H] in position order (only the newest row
        is read)."""
        self._source = hidden

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        return self._draft(context, k, lambda logits, width: logits.topk(width, dim=-1).indices)

    def propose_coupled(self, context: list[int], k: int, params: SamplingParams, noise: KeyedNoise) -> Draft:
        """Head i's first choice: the keyed-noise token of its logits at position len(context) + i (the token plain
        sampling picks there if the laws agree); further choices: its most probable others."""
        start = len(context)

        def ranking(logits: torch.Tensor, width: int) -> torch.Tensor:
            rows = []
            for d, row in enumerate(logits):
                full = torch.full((self.parts.vocab_size,), float("-inf"))
                full[self.parts.draft_vocab] = row
                first = self._index[noise.token(full, params, start + d)]
                others = row.topk(width).indices
                rows.append(torch.cat([first[None], others[others != first]])[:width])
            return torch.stack(rows)

        return self._draft(context, k, ranking)

    @torch.inference_mode()
    def _draft(self, context: list[int], k: int, ranking: Ranking) -> Draft:
        if k <= 0 or len(context) < 2:
            return EMPTY_DRAFT
        feature = self._newest_feature(len(context))
        paths = [p for p in self.choices if len(p) <= k]
        depth = len(paths[-1])
        width = max(max(p) for p in paths) + 1
        logits = self.parts.logits(self.heads(feature[None].float(), depth)[0])  # one read-out pass, [depth, V]
        ranked = self.parts.to_vocab(ranking(logits, width))  # [depth, width] token ids
        tokens = torch.stack([ranked[len(p) - 1, p[-1]] for p in paths])
        if paths == chain(depth):
            return Draft(tokens)
        node = {p: i for i, p in enumerate(paths)}
        parents = torch.tensor([node[p[:-1]] if len(p) > 1 else -1 for p in paths], dtype=torch.int64)
        return Draft(tokens, None, parents)

    def _newest_feature(self, length: int) -> torch.Tensor:
        """f_{length-2}: the last verified row, checked to be that position's."""
        hidden = self._source or []
        rows = sum(h.shape[0] for h in hidden)
        if rows != length - 1:
            raise RuntimeError(
                f"MedusaProposer has the target's features for {rows} of {length - 1} context positions: run it "
                "through SpeculativeDecoder, which hands them over (observe_target)"
            )
        return next(h[-1] for h in reversed(hidden) if h.shape[0])
