"""Block caches: leading-prefix lookups, LRU order, and the contract's reuse cap."""

from __future__ import annotations

import pytest

from kvshare.simulate.caches import (
    LruBlockCache,
    UnboundedBlockCache,
    make_block_cache,
    reused_tokens,
)


def test_leading_hits_stop_at_the_first_missing_block() -> None:
    cache = UnboundedBlockCache()
    cache.insert([1, 2, 3])
    assert cache.leading_hits([1, 2, 3, 4]) == 3
    assert cache.leading_hits([1, 9, 3]) == 1
    assert cache.leading_hits([9, 1, 2]) == 0
    assert cache.leading_hits([]) == 0
    assert len(cache) == 3


def test_lru_evicts_least_recently_inserted_block_first() -> None:
    cache = LruBlockCache(capacity_blocks=3)
    cache.insert([1, 2, 3])
    cache.insert([1])  # refreshes 1: order is now 2, 3, 1
    cache.insert([4])  # evicts 2
    assert cache.leading_hits([1]) == 1
    assert cache.leading_hits([2]) == 0
    assert cache.leading_hits([3, 1, 4]) == 3
    assert len(cache) == 3


def test_lru_inserts_a_request_in_prompt_order_so_its_head_is_evicted_first() -> None:
    # Capacity 2, a 3-block prompt: inserting 1, 2, 3 keeps 2 and 3, and the prefix is
    # gone for the next identical prompt. This is the plain LRU the contract names.
    cache = LruBlockCache(capacity_blocks=2)
    cache.insert([1, 2, 3])
    assert cache.leading_hits([1, 2, 3]) == 0
    assert cache.leading_hits([2, 3]) == 2


def test_leading_hits_do_not_refresh_recency() -> None:
    cache = LruBlockCache(capacity_blocks=2)
    cache.insert([1, 2])
    assert cache.leading_hits([1]) == 1  # a router probing must not protect block 1
    cache.insert([3])
    assert cache.leading_hits([1]) == 0
    assert cache.leading_hits([2, 3]) == 2


def test_make_block_cache_none_is_unbounded() -> None:
    assert isinstance(make_block_cache(None), UnboundedBlockCache)
    lru = make_block_cache(5)
    assert isinstance(lru, LruBlockCache)
    assert lru.capacity_blocks == 5
    with pytest.raises(ValueError, match="at least 1"):
        LruBlockCache(0)


@pytest.mark.parametrize(
    ("blocks", "expected"),
    [(0, 0), (1, 4), (2, 8), (3, 10), (5, 10)],
)
def test_reused_tokens_are_capped_by_the_prompt_length(blocks: int, expected: int) -> None:
    # 10-token prompt in 4-token blocks: the third block is partial (2 tokens).
    assert reused_tokens(blocks, block_tokens=4, input_tokens=10) == expected
