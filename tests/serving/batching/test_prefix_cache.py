"""``PrefixCache``: blocks found by their whole token prefix, least-recently-used leaves evicted under a budget."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from specdecode.serving.batching.prefix_cache import GIB, PrefixCache, default_budget_bytes


@dataclass(frozen=True)
class Rows:
    start: int
    end: int
    nbytes: int = 10
    tag: str = ""


def _rows(start: int, end: int) -> Rows:
    return Rows(start, end)


def test_a_hit_covers_the_whole_blocks_of_the_shared_prefix_only():
    cache = PrefixCache(budget_bytes=1000, block_tokens=4)
    assert cache.insert(list(range(11)), _rows) == 2  # 0..3, 4..7; the partial block 8..10 is not cached
    assert [(b.payload.start, b.payload.end) for b in cache.match(list(range(11)))] == [(0, 4), (4, 8)]
    assert len(cache.match([0, 1, 2, 3, 4, 5, 9, 9, 9])) == 1  # the hit ends mid-block: only block 0 counts
    assert cache.match([9, 1, 2, 3, 4, 5, 6, 7]) == []  # a miss: the first block differs
    assert cache.match([0, 1, 2]) == []  # shorter than a block
    assert cache.queried_tokens == 11 + 9 + 8 + 3 and cache.hit_tokens == 8 + 4
    assert cache.bytes == 20 and len(cache) == 2


def test_a_block_is_named_by_its_whole_prefix_not_its_own_tokens():
    cache = PrefixCache(budget_bytes=1000, block_tokens=2)
    cache.insert([1, 2, 5, 6], _rows)
    assert len(cache.match([3, 4, 5, 6])) == 0  # same second block, other first block: not the same rows
    cache.insert([3, 4, 5, 6], lambda s, e: Rows(s, e, tag="other"))
    assert [b.payload.tag for b in cache.match([3, 4, 5, 6])] == ["other", "other"]
    assert [b.payload.tag for b in cache.match([1, 2, 5, 6])] == ["", ""]
    assert cache.insert([1, 2, 5, 6], _rows) == 0  # cached already: nothing computed again


def test_eviction_drops_least_recently_used_leaves_until_the_budget_fits():
    cache = PrefixCache(budget_bytes=40, block_tokens=2)
    cache.insert([1, 1, 2, 2], _rows)  # a chain of 2 blocks
    cache.insert([7, 7, 8, 8], _rows)  # another: 40 bytes, full
    cache.match([1, 1, 2, 2])  # the first chain is now the more recent
    cache.insert([9, 9], _rows)  # 50 > 40: the least recently used leaf, [7 7][8 8]'s second block, goes
    assert cache.bytes == 40 and cache.evicted_blocks == 1
    assert len(cache.match([7, 7, 8, 8])) == 1 and len(cache.match([1, 1, 2, 2])) == 2
    cache.insert([5, 5], _rows)  # [9 9] is now the oldest leaf ([7 7] was matched after it)
    assert cache.match([9, 9]) == [] and len(cache.match([7, 7])) == 1
    cache.insert([4, 4, 4, 4, 4, 4], _rows)  # 3 blocks: the older chains' leaves go first, parents after children
    assert cache.bytes <= 40
    for blocks in (cache.match(t) for t in ([1, 1, 2, 2], [7, 7], [5, 5], [4, 4, 4, 4, 4, 4])):
        for parent, child in zip(blocks, blocks[1:], strict=False):
            assert child.parent is parent  # no orphan: a kept block's parents are kept


def test_replace_upgrades_a_cached_payload_in_place():
    cache = PrefixCache(budget_bytes=1000, block_tokens=2)
    cache.insert([1, 2, 3, 4], _rows)
    changed = cache.insert([1, 2, 3, 4], lambda s, e: Rows(s, e, nbytes=15, tag="with features"),
                           replace=lambda payload: payload.tag == "")  # fmt: skip
    assert changed == 2 and cache.bytes == 30
    assert [b.payload.tag for b in cache.match([1, 2, 3, 4], lambda p: p.tag != "")] == ["with features"] * 2


def test_a_zero_budget_caches_nothing_and_bad_settings_are_refused():
    cache = PrefixCache(budget_bytes=0, block_tokens=2)
    assert cache.insert([1, 2, 3, 4], _rows) == 0 and cache.match([1, 2, 3, 4]) == []
    with pytest.raises(ValueError, match="budget"):
        PrefixCache(budget_bytes=-1)
    with pytest.raises(ValueError, match="block_tokens"):
        PrefixCache(budget_bytes=1, block_tokens=0)


def test_the_default_budget_is_a_quarter_of_what_the_slots_leave_at_most_8_gib():
    assert default_budget_bytes(10 * GIB, 2 * GIB) == 2 * GIB
    assert default_budget_bytes(100 * GIB, 0) == 8 * GIB
    assert default_budget_bytes(GIB, 2 * GIB) == 0
    assert default_budget_bytes(None, 0) == 0
