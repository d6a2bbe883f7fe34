"""The put journal's ring: reserve, commit, give up, drain, reclaim, wrap, readers, and
what recovery replays of it after a crash."""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheserver.store.journal import (
    DATA_START,
    MIN_CAPACITY,
    Journal,
    JournalFull,
    Reservation,
    replay,
)
from cacheserver.tiers import Position
from policy.types import ModelTag, StorageKey, TenantId
from tests.support.tmpfs import small_tmpfs as mounted_tmpfs

TAG = ModelTag(bytes(range(16)))


def key(n: int) -> StorageKey:
    return StorageKey(n.to_bytes(32, "big"))


def write_record(
    journal: Journal, n: int, payload: bytes, tenant: str = "alpha", wait_s: float = 0.0
) -> Reservation:
    """One whole record: reserve, copy the payload in, commit."""
    reservation = journal.reserve(key(n), TenantId(tenant), 1, TAG, len(payload), wait_s)
    reservation.view[:] = payload
    journal.commit(reservation)
    return reservation


def append(journal: Journal, n: int, payload: bytes, tenant: str = "alpha") -> None:
    write_record(journal, n, payload, tenant)


def replayed(journal: Journal, after: Position | None = None) -> list[tuple[int, bytes]]:
    return [
        (int.from_bytes(r.key, "big"), r.payload)
        for r in replay(journal.path, after or journal.start)
    ]


def test_committed_records_replay_in_order_with_their_fields(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY, after_seq=41)
    payloads = [os.urandom(size) for size in (1, 4096, 100_000)]
    for n, payload in enumerate(payloads):
        append(journal, n, payload, tenant="beta")
    records = list(replay(journal.path, journal.start))
    assert [r.seq for r in records] == [42, 43, 44]
    assert [r.payload for r in records] == payloads
    assert {(r.tenant, r.epoch, r.model_tag) for r in records} == {("beta", 1, TAG)}
    # from a drained position on, only what follows it
    assert replayed(journal, Position(journal.journal_id, 42, records[0].end)) == [
        (1, payloads[1]),
        (2, payloads[2]),
    ]


def test_a_record_still_receiving_at_the_crash_is_skipped_and_later_ones_kept(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    receiving = journal.reserve(key(0), TenantId("alpha"), 1, TAG, 8192)
    receiving.view[:100] = b"x" * 100  # half-received, never committed (never acknowledged)
    append(journal, 1, b"after")
    assert replayed(journal) == [(1, b"after")]
    receiving.view[:] = b"y" * 8192
    journal.commit(receiving)  # once committed, it is replayed in its place
    assert replayed(journal) == [(0, b"y" * 8192), (1, b"after")]


def test_the_ring_wraps_and_replays_across_its_end(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    size = 3 << 20  # five fit in 16 MiB; the sixth wraps
    for n in range(4):
        append(journal, n, bytes([n]) * size)
    point = journal.drain_point({1, 2, 3, 4})
    assert point is not None
    journal.finish({1, 2, 3, 4}, point)
    assert journal.reclaimable(keep_bytes=0) == 4
    journal.reclaim(4)
    for n in range(4, 7):
        append(journal, n, bytes([n]) * size)
    assert [n for n, _ in replayed(journal, point)] == [4, 5, 6]
    assert all(p == bytes([n]) * size for n, p in replayed(journal, point))


def test_space_is_not_reused_before_it_is_drained(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    append(journal, 0, b"\0" * (10 << 20))
    with pytest.raises(JournalFull, match="journal_bytes"):
        append(journal, 1, b"\0" * (10 << 20))
    journal.finish({1}, journal.drain_point({1}))
    with pytest.raises(JournalFull):  # drained, but not reclaimed: the space is in use
        append(journal, 1, b"\0" * (10 << 20))
    journal.reclaim(1)
    append(journal, 1, b"\0" * (10 << 20))  # room again


def test_a_reader_keeps_released_space_from_being_written(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    append(journal, 0, b"a" * (10 << 20))
    view = journal.reserve(key(1), TenantId("alpha"), 1, TAG, 1).view  # keeps the head
    token = journal.enter_read()  # a reader took views before the release
    journal.finish({1, 2}, journal.drain_point({1, 2}))
    journal.reclaim(2)
    with pytest.raises(JournalFull):  # wrapping over space the reader may still send
        append(journal, 2, b"b" * (10 << 20))
    done = threading.Event()

    def wrap_when_allowed() -> None:
        write_record(journal, 2, b"b" * (10 << 20), wait_s=5)
        done.set()

    waiting = threading.Thread(target=wrap_when_allowed)
    waiting.start()
    assert not done.wait(0.3)  # still waiting for the reader
    journal.exit_read(token)
    assert done.wait(5)
    waiting.join()
    assert bytes(view) == b"\0"  # the reserved, uncommitted record was left alone


def test_a_journal_of_another_id_or_a_missing_one_replays_nothing(tmp_path: Path) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    append(journal, 0, b"x")
    assert list(replay(journal.path, Position(bytes(16), 0, DATA_START))) == []
    assert list(replay(tmp_path / "gone", journal.start)) == []
    assert replayed(journal) == [(0, b"x")]  # positive control


def test_records_of_any_size_are_written_into_pages_made_ahead(tmp_path: Path) -> None:
    """The prefaulter keeps the ring's pages mapped ahead of the records, whatever
    their sizes: a copy into a record then takes no page faults (each costs ~4x the
    copy). Records of odd sizes once left it starting inside a page, which madvise
    refuses, so every later record faulted page by page."""
    import resource

    shm = Path("/dev/shm")
    if not shm.is_dir() or not os.access(shm, os.W_OK):
        pytest.skip("needs a writable /dev/shm")
    journal = Journal(shm / f"kvshare-test-{os.getpid()}.journal", 256 << 20)
    try:
        size = (2 << 20) + 100  # records end inside pages
        payload = os.urandom(size)
        while journal.space.prefault():  # as the store's prefaulter does from the start
            pass
        faults = []
        for n in range(96):  # 192 MiB: well past the first PREFAULT_AHEAD_BYTES
            reservation = journal.reserve(key(n), TenantId("alpha"), 1, TAG, size)
            while journal.space.prefault():
                pass
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
            reservation.view[:] = payload
            faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
            journal.commit(reservation)
        assert sum(faults) < 96 * 4, faults  # a page faulting each time: 96 * 513
        assert [r.payload == payload for r in replay(journal.path, journal.start)] == [True] * 96
    finally:
        journal.close(remove=True)


def test_a_reservation_given_up_is_passed_over_by_drain_and_replay(tmp_path: Path) -> None:
    """An abandoned put (a dropped connection) never commits its record: the writer
    passes it like a drained one, and recovery skips it."""
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    append(journal, 0, b"before")
    given_up = journal.reserve(key(1), TenantId("alpha"), 1, TAG, 4096)
    given_up.view[:10] = b"x" * 10
    append(journal, 2, b"after")
    assert replayed(journal) == [(0, b"before"), (2, b"after")]
    point = journal.drain_point({1, 2, 3})  # the writer's batch: drained, given up, drained
    assert point is not None and point.seq == 3
    journal.finish({1, 2, 3}, point)
    assert journal.drained_seq == journal.last_seq == 3
    assert journal.reclaimable(keep_bytes=0) == 3
    assert replayed(journal, point) == []


def test_replay_of_a_crash_snapshot_keeps_what_was_committed(tmp_path: Path) -> None:
    """The file as `kill -9` leaves it (copied while the ring is in use): committed
    records are replayed in order; one still receiving, and nothing written after the
    crash, is not."""
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    payloads = [os.urandom(70_000) for _ in range(3)]
    for n, payload in enumerate(payloads):
        append(journal, n, payload)
    receiving = journal.reserve(key(3), TenantId("alpha"), 1, TAG, 70_000)
    receiving.view[:1000] = b"r" * 1000
    crashed = tmp_path / "crashed"
    crashed.write_bytes(journal.path.read_bytes())
    crashed.chmod(0o600)
    receiving.view[:] = b"s" * 70_000
    journal.commit(receiving)
    append(journal, 4, b"later")
    records = list(replay(crashed, journal.start))
    assert [(r.seq, int.from_bytes(r.key, "big"), r.payload) for r in records] == [
        (1, 0, payloads[0]),
        (2, 1, payloads[1]),
        (3, 2, payloads[2]),
    ]
    assert [n for n, _ in replayed(journal)] == [0, 1, 2, 3, 4]  # control: the live file


def test_the_drain_point_covers_only_an_unbroken_run_of_finished_records(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    for n in range(4):
        append(journal, n, bytes([n]))
    assert journal.drain_point({2, 3}) is None  # record 1 is not drained yet
    journal.finish({2, 3}, None)
    assert journal.drained_seq == 0
    assert journal.reclaimable(keep_bytes=0) is None  # drained, but not covered
    point = journal.drain_point({1})
    # 1 completes the run: it covers 2 and 3, finished before it (a slow record does
    # not hold back the ones finished behind it)
    assert point is not None and point.seq == 3
    journal.finish({1}, point)
    assert journal.drained_seq == 3
    assert journal.reclaimable(keep_bytes=0) == 3


def test_records_finished_behind_a_reservation_are_covered_once_it_is_given_up(
    tmp_path: Path,
) -> None:
    journal = Journal(tmp_path / "j", MIN_CAPACITY)
    held = journal.reserve(key(0), TenantId("alpha"), 1, TAG, 2)  # its bytes never come
    for n in range(1, 5):
        append(journal, n, b"\0" * (3 << 20))
    journal.finish({2, 3, 4, 5}, journal.drain_point({2, 3, 4, 5}))  # drained in LMDB
    journal.finish({held.seq}, journal.drain_point({held.seq}))  # given up at last
    # The ring is drained up to its last record: everything may be reclaimed, and a
    # delete's barrier (through the last seq) completes.
    assert journal.drained_seq == journal.last_seq


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 24 MiB tmpfs of its own (root only: mount)."""
    with mounted_tmpfs(tmp_path / "tmpfs", 24, "to mount a tmpfs") as where:
        yield where


def test_the_prefaulter_takes_the_space_it_makes_and_stops_where_tmpfs_is_full(
    small_tmpfs: Path,
) -> None:
    """Pages made ahead (madvise, without the file's lock a put's header write needs)
    take tmpfs space as fallocate did: on a tmpfs smaller than the journal the
    prefaulter stops where the space ends, no record is handed out past it, and a put
    beyond is refused (JournalFull), not a SIGBUS."""
    journal = Journal(small_tmpfs / "j", 64 << 20)
    try:
        free_before = shutil.disk_usage(small_tmpfs).free
        assert journal.space.prefault(chunk_bytes=8 << 20)  # made, and counted by tmpfs
        assert free_before - shutil.disk_usage(small_tmpfs).free >= 8 << 20
        while journal.space.prefault(chunk_bytes=8 << 20):
            pass  # until the tmpfs is full (its last chunk cannot be made whole)
        # What the failed chunk made past the records went back to tmpfs (others share
        # /dev/shm), and puts still take it, page by page, as they come.
        assert shutil.disk_usage(small_tmpfs).free >= 4 << 20
        payload = os.urandom(1 << 20)
        stored = 0
        with pytest.raises(JournalFull, match="no space for the put journal"):
            for n in range(64):
                reservation = journal.reserve(key(n), TenantId("alpha"), 1, TAG, len(payload))
                reservation.view[:] = payload
                journal.commit(reservation)
                stored += 1
        assert 16 <= stored < 24  # the positive control: records went in until it was full
        assert [r.payload == payload for r in replay(journal.path, journal.start)] == [
            True
        ] * stored
    finally:
        journal.close(remove=True)
