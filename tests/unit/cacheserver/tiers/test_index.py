"""Eviction bookkeeping: budgets, LRU order, per-tenant quotas (no server needed)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheserver.tiers.index import BlockIndex, NoRoom
from policy.types import StorageKey, TenantId

A, B = TenantId("a"), TenantId("b")


def key(i: int) -> StorageKey:
    return StorageKey(i.to_bytes(32, "big"))


def admit(index: BlockIndex, k: StorageKey, tenant: TenantId, size: int) -> list[StorageKey]:
    victims = index.victims_for(tenant, size)
    for victim in victims:
        index.remove(victim)
    index.add(k, tenant, size)
    return victims


def test_global_lru_evicts_least_recently_used_first() -> None:
    index = BlockIndex(300)
    for i in range(3):
        admit(index, key(i), A, 100)
    index.touch(key(0))
    assert admit(index, key(3), B, 100) == [key(1)]
    assert admit(index, key(4), B, 150) == [key(2), key(0)]
    assert index.used_bytes == 250


def test_tenant_over_quota_evicts_its_own_blocks_first() -> None:
    index = BlockIndex(1000, {A: 200, B: 500})
    admit(index, key(0), B, 100)
    admit(index, key(1), A, 100)
    admit(index, key(2), A, 100)
    assert admit(index, key(3), A, 100) == [key(1)]
    assert index.tenant_bytes(A) == 200 and index.tenant_bytes(B) == 100


def test_a_tenant_within_its_quota_is_never_evicted_for_another() -> None:
    index = BlockIndex(400, {A: 200, B: 200})
    admit(index, key(0), A, 200)
    admit(index, key(1), B, 200)
    with pytest.raises(NoRoom):
        index.victims_for(TenantId("c"), 100)  # c has no quota; a and b are within theirs
    assert admit(index, key(2), B, 100) == [key(1)]  # b pays for itself


def test_unquoted_tenants_share_the_rest_in_lru_order() -> None:
    index = BlockIndex(300, {A: 100})
    admit(index, key(0), A, 100)
    admit(index, key(1), B, 100)
    admit(index, key(2), TenantId("c"), 100)
    assert admit(index, key(3), TenantId("c"), 100) == [key(1)]


def test_block_larger_than_budget_or_quota_is_refused() -> None:
    index = BlockIndex(100, {A: 50})
    with pytest.raises(NoRoom):
        index.victims_for(B, 101)
    with pytest.raises(NoRoom):
        index.victims_for(A, 51)


@given(st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 120)), max_size=60))
def test_budget_and_quotas_hold_after_any_sequence(ops: list[tuple[str, int]]) -> None:
    quotas = {"a": 200, "b": 250}
    index = BlockIndex(500, {TenantId(t): q for t, q in quotas.items()})
    for i, (tenant, size) in enumerate(ops):
        try:
            admit(index, key(i), TenantId(tenant), size)
        except NoRoom:
            continue
        assert index.used_bytes <= 500
        for t, quota in quotas.items():
            assert index.tenant_bytes(TenantId(t)) <= quota
