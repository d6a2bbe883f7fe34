"""The store with its put journal: what the memory tier may hold of journal records."""

from __future__ import annotations

import os
from pathlib import Path

from cacheserver.config import StorageConfig
from cacheserver.store import BlockStore
from cacheserver.writing import BytesSource
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
