"""The LMDB tier against a real LMDB in a temporary directory."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from cacheserver.tiers import PendingWrite, Position
from cacheserver.tiers.lmdb.tier import LmdbTier
from kvcommon.errors import ResourceExhausted
from policy.types import ModelTag, StorageKey, TenantId
from tests.support.datafiles import flip_stored_byte

MiB = 1 << 20
A, B = TenantId("alpha"), TenantId("beta")
TAG = ModelTag(bytes(range(16)))


def key(n: int) -> StorageKey:
    return StorageKey(n.to_bytes(32, "big"))


def tier_at(
    path: Path,
    map_bytes: int = 64 * MiB,
    on_integrity_failure: Callable[[TenantId, int], None] | None = None,
) -> LmdbTier:
    return LmdbTier(
        path / "lmdb",
        map_bytes=map_bytes,
        sync_writes=False,
        on_integrity_failure=on_integrity_failure,
    )


def write(n: int, payload: bytes, tenant: TenantId = A, clock: int = 1) -> PendingWrite:
    return PendingWrite(key(n), tenant, 3, clock, payload, TAG)


def test_blocks_and_their_metadata_round_trip_across_a_reopen(tmp_path: Path) -> None:
    payloads = [os.urandom(size) for size in (1, 4096, MiB + 7)]
    tier = tier_at(tmp_path)
    assert tier.write([write(n, p, clock=10 + n) for n, p in enumerate(payloads)], []) == [True] * 3
    tier.close()
    tier = tier_at(tmp_path)
    try:
        assert tier.read_many([key(0), key(1), key(2), key(9)]) == [*payloads, None]
        metas = sorted(tier.scan(), key=lambda m: m.clock)
        assert [(m.key, m.tenant, m.size, m.epoch, m.clock, m.model_tag) for m in metas] == [
            (key(n), A, len(p), 3, 10 + n, TAG) for n, p in enumerate(payloads)
        ]
        assert tier.probe() is None
    finally:
        tier.close()


def test_the_first_writer_wins(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    try:
        assert tier.write([write(0, b"first")], []) == [True]
        # a later write of the key, alone or in a batch with a new one, stores nothing
        assert tier.write([write(0, b"second", tenant=B), write(1, b"new")], []) == [False, True]
        assert tier.read_many([key(0), key(1)]) == [b"first", b"new"]
        assert {m.key: m.tenant for m in tier.scan()}[key(0)] == A
    finally:
        tier.close()


def test_corrupt_bytes_are_never_returned_and_the_block_is_dropped(tmp_path: Path) -> None:
    payloads = [os.urandom(64 << 10) for _ in range(3)]
    tier = tier_at(tmp_path)
    tier.write([write(n, p, tenant=B if n == 1 else A) for n, p in enumerate(payloads)], [])
    tier.close()
    flip_stored_byte(tmp_path / "lmdb" / "data.mdb", payloads[1][:4096], 1000)
    heard: list[tuple[TenantId, int]] = []
    tier = tier_at(tmp_path, on_integrity_failure=lambda t, n: heard.append((t, n)))
    try:
        assert tier.read_many([key(0), key(1), key(2)]) == [payloads[0], None, payloads[2]]
        assert (tier.integrity_failures, heard) == (1, [(B, 1)])
        assert key(1) not in {m.key for m in tier.scan()}  # dropped, not kept corrupt
        assert tier.read_many([key(1)]) == [None]
        assert tier.integrity_failures == 1  # a miss from now on, not counted again
        assert tier.write([write(1, payloads[1])], []) == [True]  # and writable again
        assert tier.read_many([key(1)]) == [payloads[1]]
    finally:
        tier.close()


def test_a_full_map_is_a_clear_error_and_nothing_of_the_commit_is_kept(tmp_path: Path) -> None:
    tier = tier_at(tmp_path, map_bytes=2 * MiB)
    try:
        assert tier.write([write(0, b"kept")], []) == [True]
        with pytest.raises(ResourceExhausted, match=r"lmdb_map_bytes.*disk_budget_bytes"):
            tier.write([write(1, b"a" * MiB), write(2, b"b" * (2 * MiB))], [key(0)])
        assert tier.read_many([key(0), key(1), key(2)]) == [b"kept", None, None]
        assert tier.write([write(3, b"small")], []) == [True]  # the tier still commits
    finally:
        tier.close()


def test_deletes_are_counted_and_written_in_the_same_commit_as_writes(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    try:
        tier.write([write(n, bytes([n]) * 10) for n in range(4)], [])
        assert tier.delete([key(0), key(1), key(9)]) == 2
        assert tier.write([write(5, b"new")], [key(2)]) == [True]  # an eviction with a put
        assert tier.read_many([key(n) for n in range(6)]) == [
            None,
            None,
            None,
            b"\3" * 10,
            None,
            b"new",
        ]
        assert sorted(m.key for m in tier.scan()) == [key(3), key(5)]
    finally:
        tier.close()


def test_the_journal_checkpoint_is_kept_with_the_blocks_it_covers(tmp_path: Path) -> None:
    tier = tier_at(tmp_path)
    assert tier.journal_position() is None
    journal = tmp_path / "j.journal"
    position = Position(os.urandom(16), 41, 8192)
    tier.write([write(0, b"x")], [], drained=(position, journal))
    tier.close()
    tier = tier_at(tmp_path)
    try:
        assert tier.journal_position() == (position, journal)
    finally:
        tier.close()


def test_disk_is_reserved_as_the_store_grows_not_all_at_once(tmp_path: Path) -> None:
    """An empty store holds about a megabyte of disk, however large its map; writes
    reserve more ahead of themselves, in steps that grow with the file."""
    tier = tier_at(tmp_path, map_bytes=1024 * MiB)
    data = tmp_path / "lmdb" / "data.mdb"

    def disk_bytes() -> int:
        return data.stat().st_blocks * 512

    try:
        assert tier.probe() is None
        empty = disk_bytes()
        assert empty <= 4 * MiB
        payload = os.urandom(MiB)
        for n in range(24):
            assert tier.write([write(n, payload)], []) == [True]
        full = disk_bytes()
        assert full >= 24 * MiB  # the blocks themselves are on disk
        assert full <= 24 * MiB + 16 * MiB  # and the reserve ahead is a fraction of them
        assert tier.read_many([key(23)]) == [payload]
    finally:
        tier.close()
