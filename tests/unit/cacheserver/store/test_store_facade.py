"""The block store through its public methods, with and without the put journal, and
with a tier behind LMDB (a second real LMDB, in the place the Redis Cluster tier
takes): no server, real LMDB and journal files in a temporary directory."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from cacheserver.blocks import BytesSource
from cacheserver.store import BlockStore
from cacheserver.tiers import Capability, LocalCopies, Tier
from cacheserver.tiers.lmdb.tier import LmdbTier
from kvcommon.errors import ResourceExhausted, Unavailable
from policy.types import StorageKey, TenantId
from tests.support.block_store import OTHER_TAG, TAG, A, B, FillSource, KiB, MiB, keys, storage
from tests.support.datafiles import flip_stored_byte


def open_store(
    tmp_path: Path,
    journaled: bool,
    quotas: dict[TenantId, int] | None = None,
    epochs: dict[TenantId, int] | None = None,
    lower_tiers: Sequence[Tier] = (),
    **overrides: int,
) -> BlockStore:
    return BlockStore(
        tmp_path / "data",
        storage(tmp_path, journaled, **overrides),
        quotas or {},
        epochs or {A: 0, B: 0},
        lower_tiers=lower_tiers,
    )


def get(store: BlockStore, tenant: TenantId, wanted: Sequence[StorageKey]) -> list[bytes]:
    out: list[bytes] = []
    with store.read(tenant, wanted) as reading:
        while (batch := reading.next_batch(64 * MiB)) is not None:
            out += [bytes(p) for p in batch.payloads]
    return out


@pytest.fixture(params=[True, False], ids=["journal", "write-through"])
def journaled(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def store(tmp_path: Path, journaled: bool) -> Iterator[BlockStore]:
    s = open_store(tmp_path, journaled)
    yield s
    s.close()


def test_put_lookup_read_round_trip_and_first_writer_wins(store: BlockStore) -> None:
    ks = keys(4)
    payloads = [os.urandom(size) for size in (1, 4 * KiB, MiB, 3 * MiB + 1)]
    futures = [
        store.put(A, k, TAG, BytesSource(p) if i % 2 else FillSource(p))
        for i, (k, p) in enumerate(zip(ks, payloads, strict=True))
    ]
    assert [f.result(timeout=30) for f in futures] == [True] * 4
    assert store.lookup(A, ks) == 4
    assert get(store, A, ks) == payloads
    again = FillSource(b"other")
    assert store.put(A, ks[0], TAG, again).result(timeout=30) is False
    assert again.skipped  # its bytes were not wanted
    assert get(store, A, ks[:1]) == payloads[:1]
    # reads and lookups stop at the first missing key
    missing = keys(1)
    assert store.lookup(A, [*ks[:2], *missing, *ks[2:]]) == 2
    assert get(store, A, [*ks[:2], *missing, *ks[2:]]) == payloads[:2]
    assert store.lookup(A, [*missing, *ks]) == 0
    assert get(store, A, [*missing, *ks]) == []
    assert store.tenant_usage(A) == (4, sum(map(len, payloads)))


def test_deletes_by_key_and_by_model_namespace(store: BlockStore) -> None:
    ks = keys(6)
    for i, k in enumerate(ks):
        store.put(A, k, OTHER_TAG if i >= 4 else TAG, BytesSource(bytes([i]) * KiB)).result(30)
    assert store.delete([ks[1], *keys(1)]) == 1
    assert store.lookup(A, ks) == 1
    assert get(store, A, ks[2:]) == [bytes([i]) * KiB for i in range(2, 6)]
    assert store.delete([ks[1]]) == 0  # already gone
    assert store.delete_tenant(A, OTHER_TAG) == 2  # one model of the tenant
    assert store.lookup(A, ks[4:]) == 0
    assert store.lookup(A, ks[2:4]) == 2
    assert store.delete_tenant(A) == 3  # the rest of it
    assert store.tenant_usage(A) == (0, 0)
    assert store.undrained_blocks == 0  # the deletes waited for the writer


def test_blocks_survive_a_clean_restart(tmp_path: Path, journaled: bool) -> None:
    ks, payloads = keys(3), [os.urandom(200 * KiB) for _ in range(3)]
    s = open_store(tmp_path, journaled)
    for k, p in zip(ks, payloads, strict=True):
        assert s.put(A, k, TAG, BytesSource(p)).result(30)
    s.close()
    assert not list((tmp_path / "journal").glob("*.journal"))  # drained, then removed
    s = open_store(tmp_path, journaled)
    try:
        assert (s.replayed_at_start, s.reclaimed_at_start) == (0, 0)
        assert get(s, A, ks) == payloads
    finally:
        s.close()


def test_a_tenant_over_its_quota_evicts_its_own_blocks_only(
    tmp_path: Path, journaled: bool
) -> None:
    s = open_store(tmp_path, journaled, quotas={A: 4 * 100 * KiB, B: 4 * 100 * KiB})
    try:
        theirs = keys(2)
        for k in theirs:
            s.put(B, k, TAG, BytesSource(b"b" * 100 * KiB)).result(30)
        mine = keys(8)
        for k in mine:  # twice alpha's quota
            assert s.put(A, k, TAG, BytesSource(b"a" * 100 * KiB)).result(30) is True
        assert s.lookup(A, mine[4:]) == 4  # the most recent four
        assert [s.lookup(A, [k]) for k in mine[:4]] == [0, 0, 0, 0]
        assert s.tenant_usage(A) == (4, 400 * KiB)
        assert s.lookup(B, theirs) == 2  # beta, within its quota, lost nothing
        with pytest.raises(ResourceExhausted, match="quota_bytes"):
            s.put(A, keys(1)[0], TAG, BytesSource(b"x" * 500 * KiB)).result(30)
    finally:
        s.close()


def test_an_epoch_bump_reclaims_the_tenants_blocks_at_start(tmp_path: Path) -> None:
    s = open_store(tmp_path, journaled=True)
    mine, theirs = keys(3), keys(1)
    for k in mine:
        s.put(A, k, TAG, BytesSource(b"a" * KiB)).result(30)
    s.put(B, theirs[0], TAG, BytesSource(b"b" * KiB)).result(30)
    s.close()
    s = open_store(tmp_path, journaled=True, epochs={A: 1, B: 0})
    try:
        assert s.reclaimed_at_start == 3
        assert s.lookup(A, mine) == 0
        assert get(s, B, theirs) == [b"b" * KiB]
    finally:
        s.close()


def test_usage_and_health_figures(store: BlockStore) -> None:
    for k in keys(3):
        store.put(A, k, TAG, BytesSource(b"x" * MiB)).result(30)
    usage = store.tier_usage()
    assert usage["lmdb"] == (3, 3 * MiB, 64 * MiB)
    assert usage["memory"] == (3, 3 * MiB, 4 * MiB)
    assert store.probe() is None
    assert store.integrity_failures == 0


# -- a lower tier behind LMDB --------------------------------------------------------


def behind_at(tmp_path: Path, map_bytes: int = 64 * MiB) -> LmdbTier:
    return LmdbTier(tmp_path / "behind", map_bytes=map_bytes, sync_writes=False)


def test_a_tier_behind_lmdb_gets_every_block_and_every_delete(
    tmp_path: Path, journaled: bool
) -> None:
    ks, payloads = keys(3), [os.urandom(100 * KiB) for _ in range(3)]
    s = open_store(tmp_path, journaled, lower_tiers=[behind_at(tmp_path)])
    for k, p in zip(ks, payloads, strict=True):
        assert s.put(A, k, TAG, BytesSource(p)).result(30)
    s.close()  # the writer finishes its work; the tier behind is closed with the store
    behind = behind_at(tmp_path)
    assert behind.read_many(ks) == payloads  # written behind the local commits
    s = open_store(tmp_path, journaled, lower_tiers=[behind])
    try:
        assert s.delete(ks[:1]) == 1
        assert behind.read_many(ks) == [None, *payloads[1:]]
        assert s.delete_tenant(A) == 2
        assert behind.read_many(ks) == [None, None, None]
    finally:
        s.close()


def test_reads_fall_through_to_the_tier_behind_when_the_local_copy_is_corrupt(
    tmp_path: Path,
) -> None:
    ks, payloads = keys(2), [os.urandom(64 * KiB) for _ in range(2)]
    s = open_store(tmp_path, journaled=False, lower_tiers=[behind_at(tmp_path)])
    for k, p in zip(ks, payloads, strict=True):
        s.put(A, k, TAG, BytesSource(p)).result(30)
    s.close()
    flip_stored_byte(tmp_path / "data" / "lmdb" / "data.mdb", payloads[1][:4096], 100)
    s = open_store(tmp_path, journaled=False, lower_tiers=[behind_at(tmp_path)])
    try:
        assert get(s, A, ks) == payloads  # the corrupt copy was not served; the one behind was
        assert s.integrity_failures == 1
    finally:
        s.close()
    s = open_store(tmp_path, journaled=False)  # control: without the tier behind, a miss
    try:
        assert get(s, A, ks) == payloads[:1]
    finally:
        s.close()


def test_a_failing_tier_behind_fails_no_put(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    ks = keys(2)
    full = behind_at(tmp_path, map_bytes=MiB)  # too small for what is written behind
    s = open_store(tmp_path, journaled=False, lower_tiers=[full])
    with caplog.at_level(logging.ERROR, logger="cacheserver.store"):
        assert [s.put(A, k, TAG, BytesSource(b"z" * MiB)).result(30) for k in ks] == [True] * 2
        assert get(s, A, ks) == [b"z" * MiB] * 2
        s.close()  # the writer has tried to write behind every commit
    assert "writing behind to LmdbTier failed (ResourceExhausted)" in caplog.text
    s = open_store(tmp_path, journaled=False)
    try:
        assert get(s, A, ks) == [b"z" * MiB] * 2  # stored all the same
    finally:
        s.close()


class Unhealthy(LmdbTier):
    def probe(self) -> str | None:
        return "the tier behind is down"


class UnhealthyWithOwnHealth(Unhealthy):
    capabilities = Capability.OWN_HEALTH  # the server serves without it


def test_a_tier_behind_fails_the_store_probe_unless_it_has_a_health_of_its_own(
    tmp_path: Path,
) -> None:
    behind = Unhealthy(tmp_path / "behind", map_bytes=64 * MiB, sync_writes=False)
    s = open_store(tmp_path, journaled=False, lower_tiers=[behind])
    try:
        assert s.probe() == "the tier behind is down"
    finally:
        s.close()
    own = UnhealthyWithOwnHealth(tmp_path / "behind", map_bytes=64 * MiB, sync_writes=False)
    s = open_store(tmp_path, journaled=False, lower_tiers=[own])
    try:
        assert s.probe() is None
        assert s.put(A, keys(1)[0], TAG, BytesSource(b"z" * KiB)).result(30)
    finally:
        s.close()


class HandedCopies(LmdbTier):
    """A tier behind that keeps what the store hands every tier at start."""

    local: LocalCopies | None = None

    def start(self, local: LocalCopies) -> None:
        self.local = local


def test_every_tier_gets_the_stores_local_copies_at_start_and_no_store(
    tmp_path: Path, journaled: bool
) -> None:
    behind = HandedCopies(tmp_path / "behind", map_bytes=64 * MiB, sync_writes=False)
    s = open_store(tmp_path, journaled, lower_tiers=[behind])
    try:
        local = behind.local
        assert local is not None and not isinstance(local, BlockStore)
        ks, payload = keys(3), os.urandom(64 * KiB)
        assert local.keep_copy(A, ks[0], TAG, BytesSource(payload)).result(30)  # as a put
        assert s.put(A, ks[1], OTHER_TAG, BytesSource(payload)).result(30)
        assert sorted(local.local_keys(A)) == sorted([(ks[0], TAG), (ks[1], OTHER_TAG)])
        copy = local.local_copy(ks[1])
        assert isinstance(copy, bytes | bytearray) and copy == payload  # stays valid
        assert local.local_copy(ks[2]) is None
        assert local.forget_local([ks[0], ks[2]]) == 1  # a delete through another server
        assert local.forget_local(namespace=(A, OTHER_TAG)) == 1
        assert s.lookup(A, ks[:2]) == 0 and get(s, A, ks[:2]) == []
    finally:
        s.close()
    s = open_store(tmp_path, journaled)  # forgotten durably: not back after a restart
    try:
        assert s.lookup(A, ks[:2]) == 0
    finally:
        s.close()


def _drained(store: BlockStore) -> None:
    deadline = time.monotonic() + 10
    while store.undrained_blocks:
        assert time.monotonic() < deadline, "the writer never drained"
        time.sleep(0.02)


def _stall_the_writer(store: BlockStore, monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """From now on the writer's next commit waits until the returned event is set."""
    release = threading.Event()
    real_write = store._tiers.disk.write

    def slow_write(*args: Any, **kwargs: Any) -> list[bool]:
        release.wait(10)  # the disk writer is behind
        return real_write(*args, **kwargs)

    monkeypatch.setattr(store._tiers.disk, "write", slow_write)
    return release


def test_a_delete_that_failed_on_the_writer_is_finished_by_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A delete once lost its keys: they left the index before the writer's barrier;
    when the barrier timed out the LMDB delete was skipped, the retry found nothing
    ("deleted 0") and a restart served the blocks again. A reported success must be
    durable."""
    import cacheserver.store.writer as writer_module

    monkeypatch.setattr(writer_module, "BARRIER_TIMEOUT_S", 0.3)
    store = open_store(tmp_path, journaled=True, drain_idle_ms=10)
    ks = keys(3)
    for key in ks:
        assert store.put(A, key, TAG, FillSource(os.urandom(4 * KiB))).result()
    _drained(store)  # in LMDB
    release = _stall_the_writer(store, monkeypatch)
    assert store.put(A, keys(1)[0], TAG, FillSource(b"x" * 100)).result()  # its drain waits
    with pytest.raises(Unavailable, match="retry the delete"):
        store.delete(ks[:2])
    release.set()
    assert store.delete(ks[:2]) == 2  # the retry deletes what LMDB holds
    assert store.delete(ks[:2]) == 0  # and only once
    store.close()
    reopened = open_store(tmp_path, journaled=True)
    try:
        assert reopened.lookup(A, ks[:2]) == 0  # gone for good
        assert reopened.lookup(A, ks[2:]) == 1  # positive control: the rest is kept
    finally:
        reopened.close()


def test_a_tenant_delete_that_failed_is_finished_by_its_retry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same for whole-tenant deletes: the retry sweeps LMDB for what the index lost."""
    import cacheserver.store.writer as writer_module

    monkeypatch.setattr(writer_module, "BARRIER_TIMEOUT_S", 0.3)
    store = open_store(tmp_path, journaled=True, drain_idle_ms=10)
    ks = keys(2)
    store.put(A, ks[0], TAG, FillSource(b"a" * 100)).result()
    store.put(B, ks[1], TAG, FillSource(b"b" * 100)).result()
    _drained(store)
    release = _stall_the_writer(store, monkeypatch)
    store.put(B, keys(1)[0], TAG, FillSource(b"c" * 100)).result()
    with pytest.raises(Unavailable):
        store.delete_tenant(A)
    release.set()
    assert store.delete_tenant(A) == 1
    store.close()
    reopened = open_store(tmp_path, journaled=True)
    try:
        assert reopened.lookup(A, ks[:1]) == 0
        assert reopened.lookup(B, ks[1:]) == 1  # positive control: another tenant's stays
    finally:
        reopened.close()
