"""The store with its put journal: what the memory tier may hold of journal records."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cacheserver.blocks import BytesSource
from cacheserver.config import StorageConfig
from cacheserver.store import BlockStore
from policy.types import ModelTag, StorageKey, TenantId

MiB = 1 << 20
TENANT = TenantId("alpha")
TAG = ModelTag(bytes(16))


def store(tmp_path: Path) -> BlockStore:
    storage = StorageConfig(
        memory_budget_bytes=1 * MiB,
        disk_budget_bytes=64 * MiB,
        journal_bytes=16 * MiB,
        journal_dir=str(tmp_path / "journal"),
        drain_idle_ms=600_000,  # nothing drains unless asked
    )
    return BlockStore(tmp_path / "data", storage, {}, {TENANT: 0})


def test_a_block_served_from_its_journal_record_is_not_promoted_to_memory(
    tmp_path: Path,
) -> None:
    """The memory tier may hold a view of a journal record only while the store tracks
    it for reclaiming; a view handed to a reader of a not-yet-drained block must not be
    kept, or it would outlive the record's space."""
    s = store(tmp_path)
    try:
        keys = [StorageKey(os.urandom(32)) for _ in range(3)]
        payloads = [os.urandom(512 << 10) for _ in keys]
        for key, payload in zip(keys, payloads, strict=True):
            assert s.put(TENANT, key, TAG, BytesSource(payload)).result() is True
        unpin = s.pin()
        try:
            # positive control: new blocks are held in memory (as views) at once; the
            # first was pushed out of the 1 MiB memory tier by the other two
            held, _ = s.read_from_memory(keys[1:], 64 * MiB)
            assert [bytes(p) for p in held] == payloads[1:]
            assert s.read_from_memory(keys[:1], 64 * MiB) == ([], True)
            assert s.undrained_blocks == 3
            served, _ = s.read_through(TENANT, keys[:1], 64 * MiB)  # from its record
            assert [bytes(p) for p in served] == payloads[:1]
            assert s.read_from_memory(keys[:1], 64 * MiB) == ([], True)  # and not promoted
        finally:
            unpin()
    finally:
        s.close()


def test_a_put_waiting_for_backlog_room_makes_the_writer_drain_at_once(tmp_path: Path) -> None:
    """A put waiting for room in the writer's backlog (its tenant's share, or the
    total) had the writer wait for an idle store (`drain_idle_ms`) as if nothing were
    needed, while requests kept coming: the put waited for room that nothing made and
    was refused after the journal's wait. With the store never idle (drain_idle_ms of
    10 minutes here) the writer must drain because a put waits."""
    storage = StorageConfig(
        memory_budget_bytes=1 * MiB,
        disk_budget_bytes=64 * MiB,
        journal_bytes=32 * MiB,  # half of it is far more than the backlog: no pressure
        journal_dir=str(tmp_path / "journal"),
        drain_idle_ms=600_000,
        max_pending_write_bytes=4 * MiB,
    )
    s = BlockStore(tmp_path / "data", storage, {}, {TENANT: 0})
    try:
        keys = [StorageKey(os.urandom(32)) for _ in range(12)]
        for key in keys:  # 12 MiB through a 4 MiB backlog: 8 MiB must be drained
            assert s.put(TENANT, key, TAG, BytesSource(os.urandom(MiB))).result() is True
        assert s.undrained_blocks <= 4
    finally:
        s.close()


def test_the_drain_keeps_the_checksum_made_when_the_put_was_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal hashes a record's bytes once, at commit; the drain stores that
    checksum in LMDB instead of hashing the bytes a second time. So bytes that change in
    the ring after the acknowledgement are caught by the next read from LMDB (a miss),
    where a checksum made at drain time would have vouched for them."""
    from cacheserver.tiers.lmdb import records

    hashed: list[int] = []

    def counting(payload: bytes | memoryview) -> bytes:
        hashed.append(len(payload))
        return records.checksum(payload)

    monkeypatch.setattr("cacheserver.tiers.lmdb.tier.checksum", counting)
    storage = StorageConfig(
        memory_budget_bytes=8 * MiB,
        disk_budget_bytes=64 * MiB,
        journal_bytes=16 * MiB,
        journal_dir=str(tmp_path / "journal"),
        drain_idle_ms=600_000,  # drains when closed
    )
    keys = [StorageKey(os.urandom(32)) for _ in range(2)]
    payloads = [os.urandom(256 << 10) for _ in keys]
    s = BlockStore(tmp_path / "data", storage, {}, {TENANT: 0})
    try:
        for key, payload in zip(keys, payloads, strict=True):
            assert s.put(TENANT, key, TAG, BytesSource(payload)).result() is True
        held, _ = s.read_from_memory(keys[1:], 64 * MiB)  # a view of its journal record
        record = memoryview(held[0]).cast("B")
        assert not record.readonly
        record[:4] = bytes(4) if payloads[1][:4] != bytes(4) else b"\xff" * 4  # rot after the ack
    finally:
        s.close()  # drains both into LMDB
    assert hashed == []  # no second hash at drain time
    reopened = BlockStore(tmp_path / "data", storage, {}, {TENANT: 0})
    try:
        first, _ = reopened.read_through(TENANT, keys[:1], 64 * MiB)
        assert [bytes(p) for p in first] == payloads[:1]  # positive control: read from LMDB
        assert reopened.read_through(TENANT, keys[1:], 64 * MiB)[0] == []  # caught: a miss
    finally:
        reopened.close()
