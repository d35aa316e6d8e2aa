"""EAGLE: a trained one-layer head drafts over the target's own features, as a chain or a dynamic token tree.

The head (``heads.model``) needs the target's features (last layer, before the final norm) for every context
token but the newest: the engine sets ``capture_hidden`` on its runner for a proposer with
``needs_target_hidden`` and hands it the verified rows' features through ``observe_target``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

import torch

from .. import kernels as compiled
from ..heads.calibrate import TemperatureCalibration
from ..heads.drafting import WEIGHT_BITS, KernelHead, TorchHead, TreeRows, supports_kernel_head
from ..heads.model import TargetParts, lm_head_rows
from ..heads.saved import load_head, shipped_head
from ..models.loaded import LoadedModel
from ..models.loading.loader import load_model
from ..sampling.choices import as_choices
from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.keyed_noise import KeyedNoise
from ..sampling.params import SamplingParams
from ..sampling.probs import probs_from_logits
from .base import Proposer, common_prefix_length

# A node's children, given the head's logits over the drafting vocabulary [V_draft] and the children's depth:
# (their indices in the drafting vocabulary, in sibling order [m]; the law they were drawn from over the whole
# vocabulary [V], or None for deterministic candidates).
Children = Callable[[torch.Tensor, int], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class _Node:
    token: int
    parent: int  # index into the node list, -1 for a child of the root
    depth: int
    score: float  # log draft probability of the path; for sampled siblings capped by earlier siblings' scores
    probs: torch.Tensor | None  # the distribution this node and its siblings were drawn from
    feature: torch.Tensor | None = None  # the head's output at this node's row, once expanded


@dataclass(frozen=True)
class EagleSettings:
    """How an ``EagleProposer`` drafts (each knob explained there): its shape (``tree_nodes`` None = a chain,
    ``depth``, ``branching``), the drafting vocabulary (``draft_vocab``), the head's numerics (``dtype``, ``int8``,
    ``kernels``, ``weight_bits``, ``readout_bits``) and the drafting temperature (``temperature_factor``)."""

    tree_nodes: int | None = None
    depth: int | None = None
    branching: int = 3
    draft_vocab: int | None = None
    dtype: torch.dtype = torch.bfloat16
    int8: bool = True
    kernels: bool | None = None
    weight_bits: int = 8
    readout_bits: int = 8
    temperature_factor: float | None = None

    def __post_init__(self) -> None:
        factor, tree_nodes, depth = self.temperature_factor, self.tree_nodes, self.depth
        if factor is not None and not factor > 0:
            raise ValueError(f"temperature_factor must be positive or None (the head's), got {factor!r}")
        if self.int8 and self.dtype != torch.bfloat16:
            raise ValueError(f"int8 drafting runs on bfloat16 activations: pass int8=False to draft in {self.dtype}")
        if self.weight_bits not in WEIGHT_BITS or self.readout_bits not in WEIGHT_BITS:
            raise ValueError(
                f"weight_bits and readout_bits must be 8 or 4, got {self.weight_bits!r}, {self.readout_bits!r}"
            )
        if tree_nodes is not None and (isinstance(tree_nodes, bool) or tree_nodes < 1):
            raise ValueError(f"tree_nodes must be a positive integer or None (a chain), got {tree_nodes!r}")
        if depth is not None and depth < 1:
            raise ValueError(f"depth must be a positive integer or None (the round's k), got {depth!r}")
        if self.branching < 1:
            raise ValueError(f"branching must be a positive integer, got {self.branching!r}")
        if self.draft_vocab is not None and self.draft_vocab < 1:
            raise ValueError(
                f"draft_vocab must be a positive integer or None (all the head's), got {self.draft_vocab!r}"
            )

    @classmethod
    def from_keywords(cls, knobs: dict[str, object]) -> EagleSettings:
        """Settings from ``EagleProposer``'s keyword knobs; an unknown name is a one-line ValueError."""
        known = [f.name for f in fields(cls)]
        for name in knobs:
            if name not in known:
                raise ValueError(f"EagleProposer has no setting {name!r}; the settings are {', '.join(known)}")
        return cls(**knobs)  # type: ignore[arg-type]


class EagleProposer(Proposer):
    """Guesses from an EAGLE head: a chain (``tree_nodes=None``) or an EAGLE-2 dynamic tree.

    The default is a chain: with the head drafting on the compiled kernels (~0.13 of a target step a round in
    generation: the kernel step ~0.1 ms with its weights in cache, ~0.23 ms right after a target pass, plus ~0.1 ms
    of Python) and the shipped head's ~41% first-guess acceptance on unseen chat, a chain of 1 runs at 1.14-1.23x
    plain decoding on this project's CPU, and the trees measured so far ran slower (each node is a verify row,
    and a verify row costs 0.15-0.2 of a step here; docs/BENCHMARKS.md). Trees accept more per pass and pay where
    v(k) is flat (GPUs) or the head is better.

    ``draft_vocab=N`` drafts from the N ids the target most often predicted in training (the head's saved
    ranking; default: all it was trained on): a cheaper read-out, at the cost of never guessing the rest.
    ``kernels`` (default: wherever they built, the target runs on the CPU and ``int8`` is on): each head step is
    one call into the compiled kernels (``heads.drafting.KernelHead``), fc's and the layer's matrices in integer
    blocks of 32 of ``weight_bits`` (8 or 4), the read-out rows of ``readout_bits`` (8 by default: 4 halves the
    read-out's bytes but loses 2-2.5 points of first-guess acceptance), int8 activations. Otherwise torch ops run
    the head: ``dtype`` its weights and activations (bfloat16, as it was trained under autocast, reads half the
    bytes; the norm before the read-out runs in float32); ``int8`` (default) its matrices and the read-out rows
    through torch's int8 weight-only kernel on those bfloat16 activations. Drafting numerics never affect the output,
    only how often guesses are accepted.

    Sampled guesses (and reproducible mode's keyed-noise guess) are drawn at temperature ``T * factor``
    (``temperature_factor``; default: the factor the head's config stores for T, measured after training as the
    one whose law overlaps the target's most on held-out chats, ``heads.calibrate``; 1 for heads without one). Like
    every drafting choice it changes how often guesses are accepted, never what is emitted.

    Tree mode grows the tree level by level: the ``branching`` best-scored nodes of a level (score = log of
    the path's draft probability) each get their ``branching`` most probable children (point masses at any
    temperature: a shape chosen by scores that read the drafted tokens is exact only for deterministic
    children), up to ``depth`` levels (default: the round's k); the best ``tree_nodes`` nodes are kept (a
    node's ancestors and earlier siblings always score at least as high).

    The head keeps a KV cache of its own: entry t is computed from the target's true feature f_t and token
    t+1. Each ``propose`` keeps the entries whose inputs are unchanged, recomputes the rest from the target's
    verified features, drafts past them, then drops the drafted entries.
    """

    needs_target_hidden = True
    couples_with_keyed_noise = True

    def __init__(
        self,
        target: LoadedModel,
        head: str | Path | None = None,
        settings: EagleSettings | None = None,
        **knobs: object,
    ) -> None:
        """``settings``, or the same knobs as keywords (``EagleProposer(target, tree_nodes=8)``), not both."""
        if settings is not None and knobs:
            raise ValueError("pass EagleProposer either settings=EagleSettings(...) or keyword knobs, not both")
        self.settings = EagleSettings.from_keywords(knobs) if settings is None else settings
        settings = self.settings
        self.target = load_model(target)
        folder = shipped_head(self.target) if head is None else Path(head)
        self.head, ranked, self.config = load_head(folder, self.target)
        self.calibration = (
            TemperatureCalibration.from_config(self.config)
            if settings.temperature_factor is None
            else TemperatureCalibration((1.0,), (settings.temperature_factor,))
        )
        int8, dtype = settings.int8, settings.dtype
        ops = compiled.ops() if settings.kernels is not False and _on_cpu(self.target) else None
        on_kernels = ops is not None and int8 and supports_kernel_head(self.head, ops)
        if settings.kernels and not on_kernels:
            why = "they draft with integer weights (int8=True)" if not int8 else "not available for this head or device"
            raise ValueError(f"kernels=True: the compiled kernels are {why}")
        model, vocab, ranked = self.target.model, self.target.vocab_size, ranked[: settings.draft_vocab]
        self.drafter: KernelHead | TorchHead
        if on_kernels:
            self.parts = TargetParts(model, vocab, ranked, torch.float32, readout=False)
            rows = lm_head_rows(model)[self.parts.draft_vocab]
            self.drafter = KernelHead(self.head, self.parts, rows, ops, settings.weight_bits, settings.readout_bits)
            dtype = torch.float32
        else:
            self.head.to_int8() if int8 else self.head.to(dtype)
            self.parts = TargetParts(model, vocab, ranked, dtype, int8)
            self.drafter = TorchHead(self.head, self.parts, dtype)
        shape = self.head.shape
        self._index = torch.full((self.parts.vocab_size,), -1, dtype=torch.int64)  # token id -> drafting index
        self._index[self.parts.draft_vocab] = torch.arange(self.parts.draft_vocab.numel())
        self._vocab_ids: list[int] = self.parts.draft_vocab.tolist()  # drafting index -> token id
        self._feature_rows = torch.zeros(256, shape.hidden_size, dtype=dtype)  # room for the target's f_t ...
        self._known = 0  # ... of positions 0..known-1
        self._entry_tokens: list[int] = []  # token t+1 of each entry t (the drafter's cache entry t: f_t, token t+1)
        self._source: list[torch.Tensor] | None = None  # the request's feature chunks (observe_target)
        self._seen = 0

    def observe_target(self, hidden: list[torch.Tensor]) -> None:
        """The request's verified target features so far: chunks [n_i, H] in position order, appended to as
        the request goes on (a new list: a new request). Read when the head next drafts (plain rounds of
        ``gamma="auto"`` cost nothing here)."""
        if hidden is not self._source:
            self._source, self._seen, self._known = hidden, 0, 0
            self._truncate_entries(0)

    def _read_features(self) -> None:
        """Append the chunks of the request's features not read yet (into a buffer that doubles when full)."""
        hidden = self._source
        if hidden is None:
            return
        for chunk in hidden[self._seen :]:
            end = self._known + chunk.shape[0]
            if end > self._feature_rows.shape[0]:
                grown = self._feature_rows.new_empty(max(end, 2 * self._feature_rows.shape[0]), chunk.shape[1])
                grown[: self._known] = self._feature_rows[: self._known]
                self._feature_rows = grown
            self._feature_rows[self._known : end] = chunk
            self._known = end
        self._seen = len(hidden)

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        drafting = self._drafting_params(params)

        def children(logits: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            # A tree keeps its best-scored nodes, and a score reads the node's own token: a sampled sibling's
            # existence would depend on its own draw, which biases recursive rejection sampling. Deterministic
            # top-k candidates (point masses) are exact for any tree shape; a chain samples with its law.
            if params.greedy or self.settings.tree_nodes is not None:
                return self._top(logits, self._width()), None
            probs = probs_from_logits(logits, drafting)
            width = self._width()
            width = width if width == 1 else min(width, int((probs > 0).sum()))  # a chain: one child, never 0 mass
            # without replacement, in draw order (each draw from the renormalised rest)
            return as_choices(generator).draw_distinct(probs, width), self._full(probs)

        return self._draft(context, k, children)

    def propose_coupled(self, context: list[int], k: int, params: SamplingParams, noise: KeyedNoise) -> Draft:
        """First child: the token the target's keyed noise would pick from the head's logits at that position
        (the guess plain sampling makes if the laws agree); further children: the most probable others."""
        start = len(context)
        drafting = self._drafting_params(params)

        def children(logits: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor | None]:
            full = torch.full((self.parts.vocab_size,), float("-inf"))
            full[self.parts.draft_vocab] = logits
            first = self._index[noise.token(full, drafting, start + depth - 1)]
            others = self._top(logits, self._width() + 1)
            others = others[others != first][: self._width() - 1]
            return torch.cat([first[None], others]), None

        return self._draft(context, k, children)

    def _drafting_params(self, params: SamplingParams) -> SamplingParams:
        """The request's warps at the head's temperature, T * the calibration's factor at T (greedy stays greedy)."""
        factor = self.calibration.factor(params.temperature)
        return params if params.greedy or factor == 1.0 else replace(params, temperature=params.temperature * factor)

    def _width(self) -> int:
        return 1 if self.settings.tree_nodes is None else self.settings.branching

    @staticmethod
    def _top(logits: torch.Tensor, n: int) -> torch.Tensor:
        return logits.topk(min(n, logits.shape[0])).indices

    def _full(self, probs: torch.Tensor) -> torch.Tensor:
        full = torch.zeros(self.parts.vocab_size)
        full[self.parts.draft_vocab] = probs
        return full

    def _truncate_entries(self, length: int) -> None:
        """Keep the head's first ``length`` cache entries (drafted entries sit past the true ones)."""
        self._entry_tokens = self._entry_tokens[:length]
        self.drafter.truncate(length)

    @torch.inference_mode()
    def _draft(self, context: list[int], k: int, children: Children) -> Draft:
        if k <= 0 or len(context) < 2:
            return EMPTY_DRAFT
        self._read_features()
        true_entries = len(context) - 1
        if self._known < true_entries:
            raise RuntimeError(
                f"EagleProposer has the target's features for {self._known} of {true_entries} context "
                "positions: run it through SpeculativeDecoder, which hands them over (observe_target)"
            )
        feature, logits = self._sync(context)  # the head's guess of f at the newest token's position, read out
        depth = min(k, self.settings.depth or k)
        if self.settings.tree_nodes is None:
            return self._chain(feature, logits, len(context) - 1, depth, children)
        return self._tree(feature, logits, len(context) - 1, depth, children)

    def _sync(self, context: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the head's cache to one entry per context token but the newest; return the last entry's output
        (the predicted feature of the newest token) and its logits, recomputing at least that entry."""
        true_entries = len(context) - 1
        keep = min(common_prefix_length(self._entry_tokens, context[1:]), true_entries - 1)
        self._truncate_entries(keep)
        positions = list(range(keep, true_entries))
        tokens = context[keep + 1 :]
        features = self._feature_rows[keep:true_entries]
        out, logits = self.drafter.step(features, tokens, positions, None, read_from=len(tokens) - 1)  # causal
        self._entry_tokens = list(context[1:])
        return out[-1], logits[-1]

    def _chain(self, feature: torch.Tensor, logits: torch.Tensor, newest: int, depth: int, children: Children) -> Draft:
        tokens, rows = [], []
        for d in range(1, depth + 1):
            picked, probs = children(logits, d)
            token = self._vocab_ids[int(picked[0])]
            tokens.append(token)
            rows.append(probs)
            if d < depth:
                out, logits = self.drafter.step(feature[None], [token], [newest + d - 1], None)
                feature, logits = out[0], logits[0]
        self._truncate_entries(newest)
        return Draft(torch.tensor(tokens, dtype=torch.int64), None if rows[0] is None else torch.stack(rows))

    def _tree(self, feature: torch.Tensor, logits: torch.Tensor, newest: int, depth: int, children: Children) -> Draft:
        nodes: list[_Node] = []
        slot_of: dict[int, int] = {}  # node index -> its row's slot in the head's cache
        level = self._add_children(nodes, -1, 0.0, logits, torch.log_softmax(logits, -1), 1, children)
        for d in range(2, depth + 1):
            expand = heapq.nlargest(self.settings.branching, level, key=lambda i: (nodes[i].score, -i))
            if not expand:
                break
            expand.sort()
            cached = self.drafter.length
            extras = []  # besides slots 0..newest-1, each row sees its ancestors' slots and its own
            for row, i in enumerate(expand):
                ancestors, ancestor = [], i
                while ancestor >= 0:
                    if ancestor in slot_of:
                        ancestors.append(slot_of[ancestor])
                    ancestor = nodes[ancestor].parent
                extras.append([*reversed(ancestors), cached + row])
            parent_features = torch.stack([self._node_feature(i, feature, nodes) for i in expand])
            tokens = [nodes[i].token for i in expand]
            positions = [newest + d - 2] * len(expand)
            level_rows = TreeRows(newest, extras)
            outputs, logits = self.drafter.step(parent_features, tokens, positions, level_rows)  # one pass
            log_q = torch.log_softmax(logits, -1)
            level = []
            for row, i in enumerate(expand):
                slot_of[i] = cached + row
                nodes[i].feature = outputs[row]
                level += self._add_children(nodes, i, nodes[i].score, logits[row], log_q[row], d, children)
        self._truncate_entries(newest)
        return self._select(nodes)

    @staticmethod
    def _node_feature(i: int, root_feature: torch.Tensor, nodes: list[_Node]) -> torch.Tensor:
        """The predicted feature a node's row reads: its parent's row output (the root's for depth 1)."""
        parent = nodes[i].parent
        return root_feature if parent < 0 else nodes[parent].feature

    def _add_children(
        self,
        nodes: list[_Node],
        parent: int,
        score: float,
        logits: torch.Tensor,
        log_q: torch.Tensor,
        depth: int,
        children: Children,
    ) -> list[int]:
        """Append a node's children (score: the path's log draft probability, capped by earlier siblings');
        ``log_q``: the log-softmax of its ``logits``."""
        picked, probs = children(logits, depth)
        log_q = log_q[picked].tolist()
        tokens = [self._vocab_ids[i] for i in picked.tolist()]
        added = []
        cap = score
        for token, lq in zip(tokens, log_q, strict=True):
            cap = min(cap, score + lq)
            nodes.append(_Node(token, parent, depth, cap, probs))
            added.append(len(nodes) - 1)
        return added

    def _select(self, nodes: list[_Node]) -> Draft:
        """The best ``tree_nodes`` nodes, in creation order (parents first, siblings in draw order)."""
        best = heapq.nlargest(self.settings.tree_nodes, range(len(nodes)), key=lambda i: (nodes[i].score, -i))
        kept = sorted(best)
        renumber = {old: new for new, old in enumerate(kept)}
        parents = torch.tensor([renumber[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in kept])
        tokens = torch.tensor([nodes[i].token for i in kept], dtype=torch.int64)
        probs = None if nodes[0].probs is None else torch.stack([nodes[i].probs for i in kept])
        return Draft(tokens, probs, parents.to(torch.int64))


def _on_cpu(target: LoadedModel) -> bool:
    return next(target.model.parameters()).device.type == "cpu"
