"""A token store with hash-chain indexes of its n-grams, for suffix matching (the suffix proposer's memory).

Documents are stored back to back in one int32 array, each followed by ``SEPARATOR``. For every n-gram order
m in ``ORDERS``, ``head[m][b]`` is the newest position where an m-gram hashing to bucket b ends and
``chain[m][i]`` the next older such position (-1 ends a chain); an m-gram never spans a separator. A bucket
collision only costs a comparison: every match is checked token by token. Appending costs O(MAX_ORDER) per
token; the bucket tables double (one rebuild, amortised O(1) per token) when the store outgrows them.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import numpy as np

ORDERS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
MAX_ORDER = ORDERS[-1]
SEPARATOR = -1
MIN_BITS = 10
BULK = 48  # appends longer than this are hashed with numpy, shorter ones in Python (the same buckets)
_MASK = (1 << 64) - 1
_BASE = 0x100000001B3  # h = sum_j (token[i - j] + 1) * BASE^j mod 2^64 over the m-gram ending at i
_MIX = 0x9E3779B97F4A7C15  # bucket = (h * MIX mod 2^64) >> (64 - bits)
_POWERS = [pow(_BASE, j, 1 << 64) for j in range(MAX_ORDER)]


def suffix_hashes(tokens: Sequence[int]) -> dict[int, int]:
    """The hash of the last m tokens of ``tokens`` for each order m ≤ len(tokens) (no separators inside)."""
    hashes: dict[int, int] = {}
    h = 0
    for j in range(min(MAX_ORDER, len(tokens))):
        h = (h + (tokens[-1 - j] + 1) * _POWERS[j]) & _MASK
        if j + 1 in _ORDER_SET:
            hashes[j + 1] = h
    return hashes


_ORDER_SET = frozenset(ORDERS)


def bucket_of(h: int, bits: int) -> int:
    return ((h * _MIX) & _MASK) >> (64 - bits)


class SuffixIndex:
    """Documents of token ids, each m-gram's occurrences findable newest first (see the module docstring).

    The last document may be open (``append`` extends it); ``close`` ends it. ``tokens`` includes the separators.
    """

    def __init__(self) -> None:
        self.tokens = array("i")
        self.documents = 0  # closed documents
        self._run = 0  # tokens of the open document so far
        self._reset_tables(MIN_BITS)

    def __len__(self) -> int:
        """Token ids stored (separators not counted)."""
        return len(self.tokens) - self.documents

    @property
    def nbytes(self) -> int:
        """Bytes held by the store and its tables."""
        tables = sum(t.itemsize * len(t) for t in (*self.head.values(), *self.chain.values()))
        return self.tokens.itemsize * len(self.tokens) + tables

    def append(self, tokens: Sequence[int]) -> None:
        """Extend the open document (a new one if none is open) by ``tokens`` (ids >= 0)."""
        if not tokens:
            return
        if len(self.tokens) + len(tokens) > (1 << self.bits):
            self._rebuild(list(self.tokens) + list(tokens), self._run + len(tokens))
            return
        if len(tokens) > BULK:
            start = len(self.tokens)
            self.tokens.extend(tokens)
            self._run += len(tokens)
            self._link_bulk(start)
            return
        for token in tokens:
            self._append_one(token)

    def close(self) -> None:
        """End the open document (nothing happens if none is open)."""
        if self._run == 0:
            return
        self.tokens.append(SEPARATOR)
        for chain in self.chain.values():
            chain.append(-1)
        self.documents += 1
        self._run = 0

    def drop_oldest(self, keep: int) -> None:
        """Evict whole documents, oldest first, until at most ``keep`` token ids remain (an open document is kept
        whole; a closed one longer than ``keep`` goes entirely)."""
        if len(self) <= keep:
            return
        ends = (np.flatnonzero(np.frombuffer(self.tokens, dtype=np.int32) == SEPARATOR) + 1).tolist()
        stored = len(self)
        cut, dropped_docs = 0, 0
        for end in ends:
            if stored <= keep:
                break
            stored -= end - cut - 1
            cut, dropped_docs = end, dropped_docs + 1
        rest = list(self.tokens[cut:])
        run = self._run
        self.documents -= dropped_docs
        self._rebuild(rest, run)

    def matches(self, gram: Sequence[int], h: int, limit: int, max_steps: int) -> list[int]:
        """Positions right after the newest ≤ ``limit`` occurrences of ``gram`` (hash ``h``) that have a follower
        token, newest first; at most ``max_steps`` chain entries are visited."""
        m = len(gram)
        tokens, chain = self.tokens, self.chain[m]
        end = len(tokens)
        want = array("i", gram)
        found: list[int] = []
        j = self.head[m][bucket_of(h, self.bits)]
        steps = 0
        while j >= 0 and steps < max_steps:
            steps += 1
            if j + 1 < end and tokens[j + 1] != SEPARATOR and tokens[j - m + 1 : j + 1] == want:
                found.append(j + 1)
                if len(found) == limit:
                    break
            j = chain[j]
        return found

    def continuation(self, start: int, length: int) -> list[int]:
        """Up to ``length`` tokens from position ``start``, stopping at the end of its document."""
        piece = self.tokens[start : start + length].tolist()
        try:
            return piece[: piece.index(SEPARATOR)]
        except ValueError:
            return piece

    # -- building ------------------------------------------------------------------------------------------

    def _reset_tables(self, bits: int) -> None:
        self.bits = bits
        self.head = {m: array("i", [-1]) * (1 << bits) for m in ORDERS}
        self.chain = {m: array("i") for m in ORDERS}
        self._tables = [(m, self.head[m], self.chain[m]) for m in ORDERS]

    def _append_one(self, token: int) -> None:
        tokens = self.tokens
        tokens.append(token)
        self._run += 1
        i = len(tokens) - 1
        span = min(MAX_ORDER, self._run)
        shift = 64 - self.bits
        h = j = 0
        for m, head, chain in self._tables:
            if m > span:
                chain.append(-1)
                continue
            while j < m:  # h: the hash of the m-gram ending at i, grown from the (m-1)-gram's
                h = (h + (tokens[i - j] + 1) * _POWERS[j]) & _MASK
                j += 1
            b = ((h * _MIX) & _MASK) >> shift
            chain.append(head[b])
            head[b] = i

    def _rebuild(self, tokens: list[int], run: int) -> None:
        """Re-index ``tokens`` (whose last ``run`` ids form the open document) with tables sized for them."""
        bits = MIN_BITS
        while (1 << bits) < len(tokens):
            bits += 1
        self.tokens = array("i", tokens)
        self._run = run
        self._reset_tables(bits)
        self._link_bulk(0)

    def _link_bulk(self, start: int) -> None:
        """Chain positions ``start:`` (already in ``tokens``, chain entries not yet) with numpy."""
        stored = np.frombuffer(self.tokens, dtype=np.int32)
        first = max(0, start - MAX_ORDER + 1)
        window = stored[first:].astype(np.int64)
        del stored  # no buffer export may outlive this call (the array grows later)
        n = len(window)
        separators = window == SEPARATOR
        # offset of each position within its document: positions since the last separator (or the window start)
        index = np.arange(n)
        last_sep = np.maximum.accumulate(np.where(separators, index, -1))
        run_before = max(0, first - (len(self.tokens) - self._run))  # open-document tokens before `first`
        offset = np.where(last_sep >= 0, index - last_sep - 1, index + run_before)
        values = (window + 1).astype(np.uint64)
        h = np.zeros(n, dtype=np.uint64)
        new = slice(start - first, n)
        positions = np.arange(start, start + n - (start - first), dtype=np.int64)
        with np.errstate(over="ignore"):
            for j in range(MAX_ORDER):
                if j < n:
                    h[j:] += values[: n - j] * np.uint64(_POWERS[j])
                m = j + 1
                if m not in _ORDER_SET:
                    continue
                valid = (offset[new] >= m - 1) & ~separators[new]
                buckets = ((h[new] * np.uint64(_MIX)) >> np.uint64(64 - self.bits)).astype(np.int64)
                self._link_order(m, positions, buckets, valid)

    def _link_order(self, m: int, positions: np.ndarray, buckets: np.ndarray, valid: np.ndarray) -> None:
        """chain[m] for ``positions`` (ascending, appended now) and the new heads, as the one-by-one appends would
        leave them: each valid position points at the previous one in its bucket (or the old head)."""
        head = np.frombuffer(self.head[m], dtype=np.int32)
        links = np.full(len(positions), -1, dtype=np.int64)
        pos, bkt = positions[valid], buckets[valid]
        if len(pos):
            order = np.argsort(bkt, kind="stable")
            pos, bkt = pos[order], bkt[order]
            same = np.concatenate([[False], bkt[1:] == bkt[:-1]])
            previous = np.where(same, np.concatenate([[-1], pos[:-1]]), head[bkt])
            links[np.flatnonzero(valid)[order]] = previous
            last = np.concatenate([bkt[1:] != bkt[:-1], [True]])
            head[bkt[last]] = pos[last]
        del head
        self.chain[m].frombytes(links.astype(np.int32).tobytes())
