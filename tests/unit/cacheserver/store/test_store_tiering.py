"""`commit_batch` over `IndexedTiers`, the one commit path of write-through puts and of
the journal replay at start-up: a batch of puts must end where the same puts one by one
would. Real index, memory tier and LMDB in a temporary directory; no store threads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheserver.events import NoEvents
from cacheserver.store.commit import commit_batch
from cacheserver.store.jobs import PutJob
from cacheserver.store.lineup import Lineup
from cacheserver.store.tiering import IndexedTiers
from cacheserver.tiers import Capability
from cacheserver.tiers.index import BlockIndex
from cacheserver.tiers.lmdb.tier import LmdbTier
from cacheserver.tiers.memory import MemoryTier, memory_quotas
from kvcommon.errors import ResourceExhausted
from policy.types import ModelTag, StorageKey, TenantId

KiB, MiB = 1 << 10, 1 << 20
A, B = TenantId("alpha"), TenantId("beta")
TAG = ModelTag(bytes(16))
BLOCK = 64 * KiB


@pytest.fixture
def tiers(tmp_path: Path) -> Iterator[IndexedTiers]:
    quotas = {A: 3 * BLOCK}  # alpha: three blocks; beta: no quota
    disk = LmdbTier(tmp_path / "lmdb", map_bytes=64 * MiB, sync_writes=False)
    t = IndexedTiers(
        BlockIndex(64 * MiB, quotas), Lineup(MemoryTier(4 * MiB, quotas), disk, ()), NoEvents()
    )
    yield t
    t.close()


def jobs(tenant: TenantId, n: int) -> list[PutJob]:
    return [
        PutJob(StorageKey(os.urandom(32)), tenant, 0, bytes([i]) * BLOCK, TAG) for i in range(n)
    ]


def test_a_batch_whose_later_block_evicts_an_earlier_one_stays_within_the_quota(
    tiers: IndexedTiers,
) -> None:
    batch = jobs(A, 5)  # five blocks for a three-block quota, in one commit
    assert commit_batch(tiers, batch) is None
    # Every put succeeded (the first two were stored, then evicted by the call itself).
    assert [job.future.result(0) for job in batch] == [True] * 5
    kept = [job.key for job in batch[2:]]
    assert tiers.index.tenant_blocks(A) == 3
    assert tiers.index.tenant_bytes(A) == 3 * BLOCK
    assert sorted(meta.key for meta in tiers.disk.scan()) == sorted(kept)  # LMDB as well
    assert tiers.disk.read_many(kept) == [job.payload for job in batch[2:]]
    assert all(tiers.memory.get(job.key) is None for job in batch[:2])


def test_a_batch_within_the_quota_stores_every_block_and_other_tenants_are_untouched(
    tiers: IndexedTiers,
) -> None:
    theirs = jobs(B, 2)
    assert commit_batch(tiers, theirs) is None
    mine = jobs(A, 3)  # positive control: exactly the quota, nothing evicted
    assert commit_batch(tiers, mine) is None
    assert [job.future.result(0) for job in mine + theirs] == [True] * 5
    assert len(list(tiers.disk.scan())) == 5
    assert tiers.index.tenant_blocks(B) == 2


def test_a_failed_commit_fails_the_whole_batch_superseded_blocks_included(
    tmp_path: Path,
) -> None:
    """A job evicted by its own batch is reported stored only once the batch commits."""
    quotas = {A: 2 * MiB}  # one block of 2 MiB: the second of the batch evicts the first
    disk = LmdbTier(tmp_path / "lmdb", map_bytes=1 * MiB, sync_writes=False)  # too small
    t = IndexedTiers(
        BlockIndex(64 * MiB, quotas), Lineup(MemoryTier(4 * MiB, quotas), disk, ()), NoEvents()
    )
    try:
        batch = [
            PutJob(StorageKey(os.urandom(32)), A, 0, bytes([i]) * 2 * MiB, TAG) for i in (1, 2)
        ]
        failure = commit_batch(t, batch)
        assert isinstance(failure, ResourceExhausted)
        assert "lmdb_map_bytes" in str(failure)
        for job in batch:
            with pytest.raises(ResourceExhausted):
                job.future.result(0)
        assert t.index.tenant_blocks(A) == 0
    finally:
        t.close()


class ClaimsToBeShared(LmdbTier):
    capabilities = Capability.SHARED  # without SharedTier's methods


def test_the_lineup_refuses_tiers_that_declare_what_they_cannot_be(tmp_path: Path) -> None:
    disk = LmdbTier(tmp_path / "lmdb", map_bytes=MiB, sync_writes=False)
    claims = ClaimsToBeShared(tmp_path / "behind", map_bytes=MiB, sync_writes=False)
    try:
        with pytest.raises(TypeError, match="SHARED"):
            Lineup(MemoryTier(MiB), disk, [claims])
        with pytest.raises(TypeError, match="in process"):
            Lineup(MemoryTier(MiB), disk, [MemoryTier(MiB)])
        lineup = Lineup(MemoryTier(MiB), disk, [])
        assert lineup.all == (lineup.memory, disk) and not lineup.asks_on_miss
    finally:
        claims.close()
        disk.close()


def test_a_read_promotes_a_block_to_memory_unless_its_namespace_keeps_a_fixed_order(
    tmp_path: Path,
) -> None:
    """The public scope's hot blocks must not depend on who read what: a read through
    the disk promotes a tenant's block (control) but never a fixed-order one."""
    fixed = frozenset({B})
    disk = LmdbTier(tmp_path / "lmdb", map_bytes=64 * MiB, sync_writes=False)
    memory = MemoryTier(BLOCK, {}, fixed_order=fixed)  # room for one block at a time
    tiers = IndexedTiers(BlockIndex(64 * MiB, {}, fixed), Lineup(memory, disk, ()), NoEvents())
    try:
        own, public, newest = jobs(A, 1)[0], jobs(B, 1)[0], jobs(A, 1)[0]
        for job in (own, public, newest):  # each put takes memory from the one before
            assert commit_batch(tiers, [job]) is None
        assert tiers.memory.get(own.key) is None and tiers.memory.get(public.key) is None
        for job in (own, public):
            payloads, _ = tiers.read_through(job.tenant, [job.key], BLOCK)
            assert payloads == [job.payload]
        assert tiers.memory.get(own.key) == own.payload  # promoted by the read
        assert tiers.memory.get(public.key) is None  # not promoted
    finally:
        tiers.close()


def test_memory_keeps_a_fixed_order_namespace_whole_quota_up_to_half_the_tier() -> None:
    quotas = {A: 8 * MiB, B: 8 * MiB}
    scaled = memory_quotas(quotas, 4 * MiB, 16 * MiB, frozenset({B}))
    assert scaled == {A: 2 * MiB, B: 2 * MiB}  # B: half the tier, not a quarter of it
    assert memory_quotas({B: MiB}, 4 * MiB, 16 * MiB, frozenset({B})) == {B: MiB}
