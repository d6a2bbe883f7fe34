"""Memory and LMDB keep the tier contract (tests/support/tier_contract.py); the Redis
Cluster tier runs the same check in tests/cluster/test_cluster_tier_contract.py."""

from __future__ import annotations

from pathlib import Path

from cacheserver.tiers import Capability
from cacheserver.tiers.lmdb.tier import LmdbTier
from cacheserver.tiers.memory import MemoryTier
from policy.types import StorageKey
from tests.support.tier_contract import check_tier_contract, pending_write

MiB = 1 << 20


def test_the_memory_tier_keeps_the_tier_contract() -> None:
    tier = MemoryTier(MiB)
    assert tier.capabilities == Capability.IN_PROCESS
    check_tier_contract(tier)


def test_the_lmdb_tier_keeps_the_tier_contract(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path / "lmdb", map_bytes=64 * MiB, sync_writes=False)
    assert tier.capabilities == Capability.NONE
    check_tier_contract(tier)


def test_a_memory_tier_write_too_big_to_keep_says_it_stored_nothing() -> None:
    tier = MemoryTier(1024)  # a cache tier may decline a write: it says so
    key = StorageKey(b"k" * 32)
    assert tier.write([pending_write(key, b"x" * 2048)], ()) == [False]
    assert tier.read_many([key]) == [None]
