"""The memory tier: a byte-bounded LRU with per-tenant quotas, and the Tier protocol."""

from __future__ import annotations

from cacheserver.events import EvictReason
from cacheserver.tiers import Tier
from cacheserver.tiers.memory import MemoryTier, memory_quotas
from policy.types import StorageKey, TenantId

A, B = TenantId("alpha"), TenantId("beta")


def key(n: int) -> StorageKey:
    return StorageKey(n.to_bytes(32, "big"))


def test_blocks_round_trip_and_the_least_recently_used_goes_first() -> None:
    evicted: list[tuple[EvictReason, int]] = []
    tier = MemoryTier(300, on_evict=lambda reason, nbytes: evicted.append((reason, nbytes)))
    for n in range(3):
        assert tier.admit(key(n), A, bytes([n]) * 100) is True
    assert tier.get(key(0)) == b"\0" * 100  # now the most recently used
    assert tier.admit(key(3), A, b"\3" * 100) is True
    assert tier.get(key(1)) is None  # the least recently used made room
    assert [tier.get(key(n)) for n in (0, 2, 3)] == [b"\0" * 100, b"\2" * 100, b"\3" * 100]
    assert evicted == [("budget", 100)]
    assert (len(tier), tier.used_bytes, tier.budget_bytes) == (3, 300, 300)


def test_a_block_is_admitted_once_and_one_larger_than_the_tier_is_not_kept() -> None:
    tier = MemoryTier(100)
    assert tier.admit(key(0), A, b"x" * 10) is True
    assert tier.admit(key(0), A, b"y" * 10) is False  # already held: kept as it was
    assert tier.get(key(0)) == b"x" * 10
    assert tier.admit(key(1), A, b"z" * 101) is False  # served from disk only
    assert tier.get(key(1)) is None
    assert tier.used_bytes == 10


def test_a_tenant_over_its_quota_evicts_its_own_blocks_not_another_tenants() -> None:
    tier = MemoryTier(1000, {A: 200, B: 200})
    assert tier.admit(key(100), B, b"b" * 150)
    for n in range(5):  # alpha floods: 500 bytes through a 200-byte quota
        assert tier.admit(key(n), A, b"a" * 100)
    assert tier.get(key(100)) == b"b" * 150  # beta, within its quota, kept its block
    assert [tier.get(key(n)) is not None for n in range(5)] == [False, False, False, True, True]


def test_the_tier_protocol_reads_deletes_and_closes() -> None:
    tier: Tier = MemoryTier(1000)
    assert isinstance(tier, MemoryTier)
    tier.admit(key(0), A, b"zero")
    tier.admit(key(1), A, b"one")
    assert tier.read_many([key(0), key(2), key(1)]) == [b"zero", None, b"one"]
    assert tier.delete([key(0), key(2)]) == 1
    assert tier.read_many([key(0), key(1)]) == [None, b"one"]
    assert tier.used_bytes == 3
    tier.close()
    assert (len(tier), tier.used_bytes) == (0, 0)


def test_memory_quotas_scale_with_the_tiers_budgets() -> None:
    quotas = memory_quotas({A: 4000, B: 0, TenantId("tiny"): 1}, 1000, 8000)
    assert quotas == {A: 500, TenantId("tiny"): 1}  # no quota stays none; never 0
    assert memory_quotas({A: 4000}, 1000, 0) == {}
