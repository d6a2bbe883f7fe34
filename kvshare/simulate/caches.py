"""Block caches over prefix-block ids: one per replica (local) and one shared store.

A block id stands for the KV of one prompt block *at its position in a prefix chain*
(Mooncake `hash_ids` already encode prefix identity), so a request's reusable prefix
is the run of its leading ids that the cache holds. Invariants:

- `leading_hits` is read-only: routers probe every replica's cache without touching
  its recency order; only `insert` (after a request is served) refreshes recency.
- `insert` adds a request's blocks in prompt order, so within one request the first
  block is the least recently used (the contract's plain "LRU over blocks").
- Both operations are O(1) per block; eviction pops the least recently used block.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Sequence
from typing import Protocol


class BlockCache(Protocol):
    """What the engine and the routers need from a cache of prefix blocks."""

    def leading_hits(self, block_ids: Sequence[int]) -> int:
        """Number of leading `block_ids` present (stops at the first miss)."""
        ...

    def insert(self, block_ids: Sequence[int]) -> None:
        """Add or refresh every block, in order, evicting the LRU blocks if over capacity."""
        ...

    def __len__(self) -> int: ...


def count_leading(blocks: Container[int], block_ids: Sequence[int]) -> int:
    """How many of `block_ids`, from the first, are in `blocks` (prefix semantics)."""
    hits = 0
    for block_id in block_ids:
        if block_id not in blocks:
            break
        hits += 1
    return hits


class UnboundedBlockCache:
    """A cache that never evicts: a set, since recency order cannot matter."""

    def __init__(self) -> None:
        self._blocks: set[int] = set()

    def leading_hits(self, block_ids: Sequence[int]) -> int:
        return count_leading(self._blocks, block_ids)

    def insert(self, block_ids: Sequence[int]) -> None:
        self._blocks.update(block_ids)

    def __len__(self) -> int:
        return len(self._blocks)


class LruBlockCache:
    """At most `capacity_blocks` blocks; inserting past that evicts the least recently used."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be at least 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def leading_hits(self, block_ids: Sequence[int]) -> int:
        return count_leading(self._blocks, block_ids)

    def insert(self, block_ids: Sequence[int]) -> None:
        blocks = self._blocks
        for block_id in block_ids:
            if block_id in blocks:
                blocks.move_to_end(block_id)
            else:
                blocks[block_id] = None
                if len(blocks) > self.capacity_blocks:
                    blocks.popitem(last=False)

    def __len__(self) -> int:
        return len(self._blocks)


def make_block_cache(capacity_blocks: int | None) -> BlockCache:
    """An LRU cache of `capacity_blocks`, or an unbounded one for None."""
    if capacity_blocks is None:
        return UnboundedBlockCache()
    return LruBlockCache(capacity_blocks)


def reused_tokens(leading_blocks: int, block_tokens: int, input_tokens: int) -> int:
    """Contract: a request reusing k leading blocks reuses min(k * block_tokens, input) tokens.

    The cap matters for the last block, which may be partial.
    """
    return min(leading_blocks * block_tokens, input_tokens)
