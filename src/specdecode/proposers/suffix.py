"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): guesses copied from what followed the longest earlier
match of the context's suffix, in this request and in a history of earlier requests, as a frequency-scored tree.

Each round the longest m in ``ORDERS`` (1 … 32) for which the context's last m tokens occurred before is found,
in the request's own tokens and in the shared history (the history only where its match is longer: the
request's own wording wins a tie). The newest ``max_matches`` occurrences vote, the i-th newest with weight
``recency``^i; their continuations form a trie whose node probability is the weighted share of occurrences
that reach it. The draft keeps the most probable nodes (a parent is at least as probable as its children, so
the kept set is a tree) while P ≥ ``min_probability``, up to ``tree_nodes`` nodes and ``match_factor`` · m
deep (a short match earns a short draft), and, once the decoder has measured its verify costs, while a node
still raises the expected tokens per unit of verify time, (1 + Σ P) / v(nodes + 1). The tokens are a point
mass (``probs=None``), so every verification rule applies.

Defaults (measured on Spec-Bench and a repetitive workload, docs/BENCHMARKS.md §18): 8 matches with recency
0.5 (voting over 32 equal-weight matches drafted fewer accepted tokens than copying the newest: the newest
occurrence predicts best what a model writes next), ``match_factor`` 8, and a chain (``tree_nodes=0``): where
a verify row costs 0.12–0.25 of a step, as on this project's CPU, trees of 4–8 nodes got fewer tokens per
pass under ``gamma="auto"`` than the chain; ``tree_nodes=8`` is the choice where rows are nearly free.
"""

from __future__ import annotations

import copy
import heapq
import json
import math
import threading
import zlib
from array import array
from pathlib import Path

import numpy as np
import torch

from ..disk_cache import write_file
from ..errors import SpecDecodeError
from ..sampling.draft import EMPTY_DRAFT, Draft
from ..sampling.params import SamplingParams
from .base import Proposer
from .suffix_index import ORDERS, SEPARATOR, SuffixIndex, suffix_hashes

MAGIC = b"specdecode-suffix-cache\n"
FORMAT_VERSION = 1
DEFAULT_MAX_TOKENS = 1_000_000
CHAIN_STEPS_PER_MATCH = 4  # chain entries visited per wanted match (bucket collisions and unusable ones)


class SuffixCacheError(SpecDecodeError, ValueError):
    """A suffix cache file that cannot be used: not one of ours, damaged, or built for another vocabulary."""


class SuffixHistory:
    """Earlier requests' prompts and answers (and any corpus loaded), shared by proposers and threads.

    At most ``max_tokens`` token ids are kept; past that, whole documents are evicted oldest first, down to
    three quarters of the bound (so the re-index that eviction costs is amortised over many requests).
    ``vocabulary`` identifies the tokenizer the ids belong to (``LoadedModel.vocabulary_fingerprint``), None until
    known.
    """

    def __init__(self, max_tokens: int = DEFAULT_MAX_TOKENS, vocabulary: str | None = None) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.max_tokens = max_tokens
        self.vocabulary = vocabulary
        self.index = SuffixIndex()
        self.lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.index)

    @property
    def documents(self) -> int:
        return self.index.documents

    @property
    def nbytes(self) -> int:
        return self.index.nbytes

    def largest_id(self) -> int:
        """The largest token id stored (-1 when empty)."""
        with self.lock:
            stored = np.frombuffer(self.index.tokens, dtype=np.int32)
            largest = int(stored.max()) if len(stored) else -1
            del stored  # no buffer export may outlive the lock (appends resize the array)
        return largest

    def add(self, tokens: list[int]) -> None:
        """Remember one document (a request's prompt and answer, or a corpus entry)."""
        if not tokens:
            return
        with self.lock:
            self.index.append(tokens)
            self.index.close()
            if len(self.index) > self.max_tokens:
                self.index.drop_oldest(self.max_tokens * 3 // 4)

    def save(self, path: str | Path) -> None:
        """Write the history to ``path`` (atomically: a temporary file renamed over it)."""
        path = Path(path)
        with self.lock:
            payload = np.frombuffer(self.index.tokens, dtype=np.int32).astype("<i4").tobytes()
            documents = self.index.documents
        header = {
            "version": FORMAT_VERSION,
            "vocabulary": self.vocabulary,
            "documents": documents,
            "entries": len(payload) // 4,
            "max_tokens": self.max_tokens,
            "crc32": zlib.crc32(payload),
        }
        head = json.dumps(header).encode()
        write_file(path, MAGIC + len(head).to_bytes(4, "little") + head + payload)  # a full disk: one line, no .tmp

    @classmethod
    def load(cls, path: str | Path, max_tokens: int | None = None) -> SuffixHistory:
        """The history saved at ``path``; a damaged or foreign file raises SuffixCacheError."""
        path = Path(path)
        data = path.read_bytes()
        if not data.startswith(MAGIC):
            raise SuffixCacheError(f"{path} is not a specdecode suffix cache (make one with `specdecode index`)")
        offset = len(MAGIC)
        try:
            size = int.from_bytes(data[offset : offset + 4], "little")
            header = json.loads(data[offset + 4 : offset + 4 + size])
            payload = data[offset + 4 + size :]
            version, entries, documents = header["version"], header["entries"], header["documents"]
        except (ValueError, KeyError, TypeError) as exc:
            raise SuffixCacheError(f"{path}: damaged suffix cache header ({exc})") from None
        kinds = {"version": int, "entries": int, "documents": int, "crc32": int, "max_tokens": (int, type(None))}
        if any(not isinstance(header.get(key), kind) for key, kind in kinds.items()) or not isinstance(
            header.get("vocabulary"), (str, type(None))
        ):
            raise SuffixCacheError(f"{path}: damaged suffix cache header (a field of the wrong type)")
        if version != FORMAT_VERSION:
            raise SuffixCacheError(f"{path}: suffix cache format {version}, this specdecode reads {FORMAT_VERSION}")
        if len(payload) != 4 * entries or zlib.crc32(payload) != header.get("crc32"):
            raise SuffixCacheError(f"{path}: damaged suffix cache (truncated or altered; rebuild it)")
        tokens = np.frombuffer(payload, dtype="<i4")
        separators = int((tokens == SEPARATOR).sum())
        if separators != documents or (tokens < SEPARATOR).any() or (len(tokens) and tokens[-1] != SEPARATOR):
            raise SuffixCacheError(f"{path}: damaged suffix cache (inconsistent documents; rebuild it)")
        history = cls(max_tokens or header.get("max_tokens") or DEFAULT_MAX_TOKENS, header.get("vocabulary"))
        history.index.documents = documents
        history.index._rebuild(tokens.tolist(), 0)
        if len(history.index) > history.max_tokens:
            history.index.drop_oldest(history.max_tokens)
        return history


class SuffixProposer(Proposer):
    """Deterministic guesses (a point mass) from the longest suffix match in this request and in ``history``.

    One proposer object remembers every request it sees (prompt and answer, added when the request ends) in
    ``history``; ``fork()`` gives another request stream its own request state over the same history (the
    server's global scope). ``remember=False`` only reads the history (a corpus cache, the server's request
    scope). ``tree_nodes=0`` drafts a chain (the most frequent continuation); see the module docstring.
    """

    def __init__(
        self,
        history: SuffixHistory | None = None,
        *,
        tree_nodes: int = 0,
        min_probability: float = 0.1,
        match_factor: float = 8.0,
        max_matches: int = 8,
        recency: float = 0.5,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        remember: bool = True,
    ) -> None:
        if tree_nodes < 0:
            raise ValueError(f"tree_nodes must be >= 0 (0 = a chain), got {tree_nodes}")
        if not 0.0 < min_probability <= 1.0:
            raise ValueError(f"min_probability must be in (0, 1], got {min_probability}")
        if match_factor <= 0:
            raise ValueError(f"match_factor must be > 0, got {match_factor}")
        if max_matches < 1:
            raise ValueError(f"max_matches must be >= 1, got {max_matches}")
        if not 0.0 < recency <= 1.0:
            raise ValueError(f"recency must be in (0, 1], got {recency}")
        self.history = SuffixHistory(max_tokens) if history is None else history
        self.tree_nodes = tree_nodes
        self.min_probability = min_probability
        self.match_factor = match_factor
        self.max_matches = max_matches
        self.recency = recency
        self.remember = remember
        self.costs = None  # a decoder's control.PassCosts, bound by the decoder; caps trees at measured verify costs
        self._forget_request()

    def _forget_request(self) -> None:
        """Empty the request state: its index (one open document, the context seen so far, never yet in the
        history) and the list it was last synced from."""
        self._request = SuffixIndex()
        self._source: list[int] | None = None
        self.last_order = 0  # the matched suffix's length behind the last draft (0: none)

    # -- sharing and persistence ---------------------------------------------------------------------------

    def fork(self) -> SuffixProposer:
        """A proposer with these settings and this history, and request state of its own."""
        clone = copy.copy(self)  # settings, history and bound costs shared
        clone._forget_request()
        return clone

    def save(self, path: str | Path) -> None:
        """Write the history (every remembered request and loaded corpus) to ``path``."""
        self.history.save(path)

    @classmethod
    def load(cls, path: str | Path, max_tokens: int | None = None, **settings) -> SuffixProposer:
        """A proposer over the history saved at ``path`` (``save`` or ``specdecode index``)."""
        return cls(SuffixHistory.load(path, max_tokens), **settings)

    def bind_target(self, vocabulary: str, costs=None, vocab_size: int | None = None) -> None:
        """Called by a decoder: check (or adopt) the history's vocabulary and that its ids fit the target's
        ``vocab_size``; use the decoder's measured costs."""
        if self.history.vocabulary is None:
            self.history.vocabulary = vocabulary
        elif self.history.vocabulary != vocabulary:
            raise SuffixCacheError(
                "this suffix history was built with another tokenizer (vocabulary fingerprint "
                f"{self.history.vocabulary[:12]}…, the target's is {vocabulary[:12]}…): rebuild it for this target"
            )
        largest = self.history.largest_id()
        if vocab_size is not None and largest >= vocab_size:
            raise SuffixCacheError(
                f"this suffix history holds token id {largest}, outside the target's vocabulary of {vocab_size}"
            )
        if costs is not None:
            self.costs = costs

    def end_request(self, context: list[int]) -> None:
        """The request whose context (prompt + answer) is ``context`` ended: remember it, forget its state."""
        if self.remember and context:
            self.history.add(list(context))
        self._forget_request()

    # -- drafting ------------------------------------------------------------------------------------------

    def propose(self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator) -> Draft:
        self.last_order = 0
        if k <= 0 or not context:
            return EMPTY_DRAFT
        self._sync(context)
        paths = self._continuations(context, k)
        return self._draft(paths, k) if paths else EMPTY_DRAFT

    def _sync(self, context: list[int]) -> None:
        """Index ``context`` in the request state (appending if it extends what was indexed, else anew; a
        request left without ``end_request`` is remembered first). The decoder passes one growing list per
        request, so the same list, grown and ending as before, is taken to extend it without a full compare."""
        seen = self._request.tokens  # the context indexed so far
        done = len(seen)
        grown = context is self._source and len(context) >= done
        grown = grown and (not done or context[done - 1] == seen[-1])
        if not grown and (len(context) < done or array("i", context[:done]) != seen):
            if self.remember and done:
                self.history.add(seen.tolist())
            self._forget_request()
            done = 0
        self._request.append(context[done:])
        self._source = context

    def _continuations(self, context: list[int], k: int) -> list[list[int]]:
        """What followed the newest ``max_matches`` occurrences of the context's last m tokens, for the longest m
        in ORDERS that occurs (the request's own occurrences win a tie with the history's: they follow this
        request's wording), each cut to min(k, ⌈match_factor · m⌉) tokens."""
        hashes = suffix_hashes(context)
        request, history = self._request, self.history
        m, starts = self._longest(request, context, hashes, 0)
        if len(history):
            with history.lock:  # eviction re-indexes: find and read under one hold
                longer, found = self._longest(history.index, context, hashes, m)
                if longer > m:
                    self.last_order = longer
                    depth = self._depth(longer, k)
                    return [history.index.continuation(s, depth) for s in found]
        self.last_order = m
        depth = self._depth(m, k)
        return [request.continuation(s, depth) for s in starts]

    def _depth(self, order: int, k: int) -> int:
        return min(k, max(1, math.ceil(self.match_factor * order)))

    def _longest(
        self, index: SuffixIndex, context: list[int], hashes: dict[int, int], shorter: int
    ) -> tuple[int, list[int]]:
        """(m, starts): the longest order m > ``shorter`` whose last-m-gram occurs in ``index`` (0 if none) and
        its newest ``max_matches`` occurrences. A longer match implies every shorter one, so the orders are
        binary-searched (about 3 probes of one match each, for 10 orders)."""
        steps = self.max_matches * CHAIN_STEPS_PER_MATCH
        orders = [m for m in ORDERS if m > shorter and m in hashes]
        found, missing = -1, len(orders)  # orders[found] occurs (-1: none known), orders[missing] does not
        while missing - found > 1:
            middle = (found + missing) // 2
            m = orders[middle]
            if index.matches(context[-m:], hashes[m], 1, steps):
                found = middle
            else:
                missing = middle
        if found < 0:
            return 0, []
        best = orders[found]
        return best, index.matches(context[-best:], hashes[best], self.max_matches, steps)

    def _draft(self, paths: list[list[int]], k: int) -> Draft:
        """The most probable nodes of the continuations' trie (see the module docstring)."""
        children: list[dict[int, int]] = [{}]  # trie node -> {token: child node}; node 0 is the context
        counts = [0.0]  # weighted occurrences reaching each node: the i-th newest weighs recency^i
        tokens_of = [-1]
        weight = 1.0
        for path in paths:
            node = 0
            counts[0] += weight
            for token in path:
                child = children[node].get(token)
                if child is None:
                    child = children[node][token] = len(counts)
                    children.append({})
                    counts.append(0.0)
                    tokens_of.append(token)
                counts[child] += weight
                node = child
            weight *= self.recency
        total = counts[0]
        capacity = self.tree_nodes or k
        cost = self._verify_cost()
        tokens: list[int] = []
        parents: list[int] = []
        expected = 1.0  # 1 + sum of kept nodes' probabilities: expected tokens of the round
        frontier = [(-counts[c] / total, c, -1) for c in children[0].values()]
        heapq.heapify(frontier)
        while frontier and len(tokens) < capacity:
            negative, node, parent = heapq.heappop(frontier)
            probability = -negative
            if probability < self.min_probability:
                break
            if cost is not None and (expected + probability) / cost(len(tokens) + 2) <= expected / cost(
                len(tokens) + 1
            ):
                break
            expected += probability
            tokens.append(tokens_of[node])
            parents.append(parent)
            me = len(tokens) - 1
            kids = children[node].values()
            if self.tree_nodes == 0:  # a chain: only the most frequent continuation
                kids = [max(kids, key=counts.__getitem__)] if kids else []
                frontier = []
            for child in kids:
                heapq.heappush(frontier, (-counts[child] / total, child, me))
        if not tokens:
            return EMPTY_DRAFT
        ids = torch.tensor(tokens, dtype=torch.int64)
        if all(parent == i - 1 for i, parent in enumerate(parents)):  # one path: a chain
            return Draft(ids)
        return Draft(ids, None, torch.tensor(parents, dtype=torch.int64))

    def _verify_cost(self):
        """v(k) from the bound decoder's measurements, or None until a 1-token step has been timed."""
        costs = self.costs
        if costs is None or costs.step_seconds is None or not costs.seconds.keys() - {1}:
            return None
        return costs.verify_cost
