"""The server's prefix cache: KV rows of earlier requests in fixed-size blocks, found by their token prefix.

A block holds ``block_tokens`` consecutive tokens at positions ``i * block_tokens ..`` and a payload (the KV
rows of those positions, computed with every earlier token visible). A block is keyed by its parent block and
its own tokens, so a chain of blocks from the root names a whole prefix exactly (the key is the token tuple
itself: no hash collision can hand a request another prefix's rows). ``match`` walks the chain a prompt's
tokens spell; ``insert`` adds the blocks a finished or running request's tokens complete. Only whole blocks
are cached: a hit ends on a block boundary, the rest of the prompt is prefilled.

Eviction is least-recently-used under a byte budget, leaves first (a block's descendants are only reachable
through it, so a parent outlives its children). Payloads are copies: a request that used a block owns its own
rows, so evicting, cancelling or finishing never touches a running request's cache. Pure data structure: the
payload is any object with ``nbytes``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

GIB = 1 << 30
DEFAULT_BLOCK_TOKENS = 32  # a multiple of 16: the kernels' key tiles


@dataclass(eq=False)
class Block:
    """Tokens ``tokens`` at block index ``depth`` after ``parent`` (None: the first block) and their payload."""

    parent: Block | None
    tokens: tuple[int, ...]
    payload: Any
    depth: int
    serial: int = 0  # names the block in its children's keys
    last_used: int = 0
    children: int = 0


class PrefixCache:
    """Blocks of ``block_tokens`` tokens and their payloads, at most ``budget_bytes`` of payload in all."""

    def __init__(self, budget_bytes: int, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> None:
        if budget_bytes < 0:
            raise ValueError(f"the prefix cache's budget must be >= 0 bytes, got {budget_bytes}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.budget_bytes = budget_bytes
        self.block_tokens = block_tokens
        self.bytes = 0
        self.queried_tokens = 0  # tokens looked up (vLLM's prefix_cache_queries)
        self.hit_tokens = 0  # of those, found cached (vLLM's prefix_cache_hits)
        self.evicted_blocks = 0
        self._blocks: dict[tuple, Block] = {}
        self._clock = itertools.count(1)
        self._serials = itertools.count(1)

    def __len__(self) -> int:
        return len(self._blocks)

    def _key(self, parent: Block | None, tokens: tuple[int, ...]) -> tuple:
        return (0 if parent is None else parent.serial, tokens)

    def _chain(self, tokens: Sequence[int], usable: Callable[[Any], bool]) -> list[Block]:
        blocks: list[Block] = []
        size, parent = self.block_tokens, None
        for start in range(0, len(tokens) - size + 1, size):
            block = self._blocks.get(self._key(parent, tuple(tokens[start : start + size])))
            if block is None or not usable(block.payload):
                break
            blocks.append(block)
            parent = block
        return blocks

    def match(self, tokens: Sequence[int], usable: Callable[[Any], bool] = lambda payload: True) -> list[Block]:
        """The longest chain of cached blocks spelling a prefix of ``tokens`` (each ``usable``), marked used;
        counts ``len(tokens)`` queried and the chain's tokens hit."""
        blocks = self._chain(tokens, usable)
        now = next(self._clock)
        for block in blocks:
            block.last_used = now
        self.queried_tokens += len(tokens)
        self.hit_tokens += len(blocks) * self.block_tokens
        return blocks

    def insert(
        self,
        tokens: Sequence[int],
        payload_of: Callable[[int, int], Any],
        replace: Callable[[Any], bool] = lambda payload: False,
    ) -> int:
        """Cache the whole blocks of ``tokens`` not cached yet, the payload of tokens ``start..end-1`` from
        ``payload_of(start, end)`` (also for a cached block whose payload ``replace`` says is lacking); mark
        the chain used, then evict down to the budget. Returns the blocks added or replaced."""
        if self.budget_bytes == 0:
            return 0
        size, parent, changed = self.block_tokens, None, 0
        now = next(self._clock)
        for start in range(0, len(tokens) - size + 1, size):
            own = tuple(tokens[start : start + size])
            key = self._key(parent, own)
            block = self._blocks.get(key)
            if block is None:
                block = Block(parent, own, payload_of(start, start + size), start // size, next(self._serials))
                self._blocks[key] = block
                self.bytes += block.payload.nbytes
                if parent is not None:
                    parent.children += 1
                changed += 1
            elif replace(block.payload):
                self.bytes -= block.payload.nbytes
                block.payload = payload_of(start, start + size)
                self.bytes += block.payload.nbytes
                changed += 1
            block.last_used = now
            parent = block
        self._evict()
        return changed

    def _evict(self) -> None:
        """Drop least-recently-used leaves (deepest first among equals) until the payloads fit the budget."""
        while self.bytes > self.budget_bytes and self._blocks:
            victim = min((b for b in self._blocks.values() if b.children == 0), key=lambda b: (b.last_used, -b.depth))
            del self._blocks[self._key(victim.parent, victim.tokens)]
            self.bytes -= victim.payload.nbytes
            self.evicted_blocks += 1
            if victim.parent is not None:
                victim.parent.children -= 1

    def clear(self) -> None:
        self._blocks.clear()
        self.bytes = 0


@dataclass(frozen=True)
class CachedRows:
    """A block's payload in the server: the runner's KV rows (``KVRows``) and, when the request that cached
    them captured them, the target's features of those positions (an EAGLE head drafts from them)."""

    kv: Any
    hidden: Any = None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.hidden is None else self.hidden.numel() * self.hidden.element_size()
        return self.kv.nbytes + extra


DEFAULT_CAP = 8 * GIB


def default_budget_bytes(available: int | None, reserved: int) -> int:
    """``serve``'s default budget: a quarter of the memory available once the slots' KV caches are set aside
    (``reserved``: ``max_batch`` requests of the full context), at most 8 GiB; 0 (off) where the available
    memory is unknown."""
    if available is None:
        return 0
    return max(0, min((available - reserved) // 4, DEFAULT_CAP))


def build_prefix_cache(gigabytes: float | None, target: Any, max_batch: int) -> PrefixCache | None:
    """The server's cache: ``gigabytes`` of payload (0: none), or by default ``default_budget_bytes``; None for
    a model whose runner cannot copy rows (the transformers backend) or a zero budget."""
    from ...models.memory import available_memory, kv_bytes_per_token, shape_of

    if gigabytes is not None and gigabytes < 0:
        raise ValueError(f"--prefix-cache-gb must be >= 0 (0 turns the prefix cache off), got {gigabytes}")
    if target.backend != "native" or gigabytes == 0:
        return None
    if gigabytes is None:
        found = available_memory()
        per_token = kv_bytes_per_token(shape_of(target.model))
        reserved = max_batch * (target.context_window or 0) * per_token
        budget = default_budget_bytes(None if found is None else found[0], reserved)
    else:
        budget = int(gigabytes * GIB)
    return PrefixCache(budget) if budget > 0 else None
