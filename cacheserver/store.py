"""The block store: a memory tier over an LMDB tier, with one writer thread.

Invariants:
- A block is visible (to lookup and get) only once a crash of the server can no longer
  lose it: after its LMDB commit, or, with the put journal, after its journal record
  is written (`cacheserver.journal`). That is also when its put is acknowledged.
- First writer wins: a key already stored is never overwritten.
- The index is the authority on what exists; the memory tier only ever holds a
  subset of it. A journaled block not yet in LMDB is in `_pending` until the writer
  has committed it, and reads fall back to it there.
- LMDB never gets back a block the index dropped: the writer skips journaled blocks
  that were evicted or deleted before it reached them, and deletes wait for the
  writer to pass their journal records (`_barrier`), so a replay after a crash cannot
  bring them back either.
- All index and memory-tier state is touched under `_lock`; LMDB I/O happens outside
  it (reads on executor threads, writes on the writer thread).

Writes go through one writer thread that groups every queued block into one LMDB
transaction (group commit): with `sync_writes`, one fsync acknowledges many puts.
With the journal (the default unless `sync_writes`), the writer drains behind the
acknowledgements, at whatever pace the disk allows.

Everything countable (hits, misses, blocks and bytes per tier, evictions, refusals,
integrity failures) is reported to a `StoreEvents` as it happens; the server's
telemetry turns those into metrics. The events carry tenants and sizes, never keys.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import heapq
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cacheserver.config import StorageConfig
from cacheserver.events import NoEvents, StoreEvents
from cacheserver.index import BlockIndex, Entry, EvictReason, NoRoom
from cacheserver.journal import (
    Journal,
    JournalFull,
    Reservation,
    default_journal_path,
    remove_orphans,
    replay,
)
from cacheserver.lmdb_tier import LmdbTier
from cacheserver.memory_tier import MemoryTier
from cacheserver.reading import Reading
from cacheserver.tiers import Payload, PendingWrite, Position
from cacheserver.writing import BlockSource
from kvcommon.errors import ConfigError, KvshareError, ResourceExhausted, Unavailable
from policy.types import ModelTag, StorageKey, TenantId

log = logging.getLogger(__name__)
MAX_BATCH_BYTES = 256 << 20  # bound one commit's size so a burst cannot stall reads long
# Journaled blocks drain in smaller commits: journal space is reclaimed after each, and
# a put waiting for room should not wait for a quarter of a gigabyte to reach the disk.
MAX_DRAIN_BYTES = 32 << 20
MAX_BATCH_BLOCKS = 4096
RETRY_DRAIN_S = 1.0  # a failed drain of journaled puts is retried after this long
JOURNAL_WAIT_S = 5.0  # a put waits this long for journal room before it is refused
BARRIER_TIMEOUT_S = 60.0  # a delete waits at most this long for the writer


@dataclass
class _PutJob:
    key: StorageKey
    tenant: TenantId
    epoch: int
    payload: Payload
    model_tag: ModelTag
    clock: int = 0
    future: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)
    # Journaled puts only: the record (its view is `payload`), the blocks its admission
    # evicted (deleted from LMDB by the commit that drains this job), and whether the
    # put was given up (refused or broken off): the writer then only passes its record.
    record: Reservation | None = None
    evicted: tuple[StorageKey, ...] = ()
    void: bool = False


@dataclass
class _Reclaim:
    """Asks the writer to reuse drained journal space now (a put waits for room)."""


@dataclass
class _Barrier:
    """Completes once every journal record reserved before it is drained or given up."""

    through_seq: int
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


def _lower_this_threads_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19, Linux: per thread).

    Used by the writer when puts are journaled (they are acknowledged already, so moving
    them into LMDB should take only CPU time that serving connections leaves; when the
    journal fills, puts wait, and the CPU is the writer's) and by the periodic fsync."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def _nothing() -> None:
    pass


def _done(stored: bool) -> concurrent.futures.Future[bool]:
    future: concurrent.futures.Future[bool] = concurrent.futures.Future()
    future.set_result(stored)
    return future


def _stored(job: _PutJob) -> bool:
    return job.future.done() and job.future.exception() is None and job.future.result()


def memory_quotas(
    quotas_bytes: Mapping[TenantId, int], memory_budget_bytes: int, disk_budget_bytes: int
) -> dict[TenantId, int]:
    """Each tenant's quota scaled to the memory tier, so the hot tier follows the same
    rule as the disk tier: a flooding tenant evicts its own hot blocks, not others'."""
    if disk_budget_bytes <= 0:
        return {}
    return {
        tenant: max(1, quota * memory_budget_bytes // disk_budget_bytes)
        for tenant, quota in quotas_bytes.items()
        if quota
    }


class BlockStore:
    def __init__(
        self,
        data_dir: Path,
        storage: StorageConfig,
        quotas_bytes: Mapping[TenantId, int],
        epochs: Mapping[TenantId, int],
        *,
        on_integrity_failure: Callable[[TenantId, int], None] | None = None,
        events: StoreEvents | None = None,
    ) -> None:
        self.events: StoreEvents = events or NoEvents()
        self._on_integrity_failure = on_integrity_failure
        self._disk = LmdbTier(
            data_dir / "lmdb",
            map_bytes=storage.effective_map_bytes(),
            sync_writes=storage.sync_writes,
            on_integrity_failure=self._integrity_failed,
        )
        self._index = BlockIndex(storage.disk_budget_bytes, quotas_bytes)
        self._memory = MemoryTier(
            storage.memory_budget_bytes,
            memory_quotas(quotas_bytes, storage.memory_budget_bytes, storage.disk_budget_bytes),
            on_evict=lambda reason, nbytes: self.events.evicted("memory", reason, nbytes),
        )
        # Why the last commit failed, until the health probe has seen it (see probe()).
        self._commit_failure: str | None = None
        self.reclaimed_at_start = 0  # blocks of retired epochs or removed tenants
        self._epochs = dict(epochs)
        self._lock = threading.Lock()
        self._queue: queue.Queue[_PutJob | _Barrier | _Reclaim | None] = queue.Queue()
        self._reclaim_asked = threading.Event()
        self._pending_bytes = 0  # payload bytes queued for, or inside, the writer
        self._pending_lock = threading.Lock()
        self._pending_room = threading.Condition(self._pending_lock)
        self._max_pending_bytes = storage.max_pending_write_bytes
        self._pending: dict[StorageKey, _PutJob] = {}  # journaled, not yet in LMDB
        # Journaled blocks held by the memory tier as views of their records, by seq:
        # dropped from memory before the record's space is released.
        self._views_in_memory: dict[int, tuple[StorageKey, memoryview]] = {}
        self._view_seqs: list[int] = []  # a heap of the seqs in _views_in_memory
        # time.monotonic() of the last request the store served (lookup, get, put): the
        # writer drains the journal when requests pause (see _wait_for_quiet)
        self._last_activity = 0.0
        self._drain_now = threading.Event()  # wakes a writer waiting for a quiet moment
        # Journaled puts move into LMDB once puts pause this long ([storage] drain_idle_ms)
        self._drain_idle_s = storage.drain_idle_ms / 1000
        self._barriers = 0  # deletes waiting for the writer
        self._closing = threading.Event()
        self._rebuild_index()
        recorded = self._disk.journal_position()
        self.replayed_at_start = self._replay_journal(recorded)
        self._journal: Journal | None = None
        self._journal_path: Path | None = None
        if storage.journal_bytes and not storage.sync_writes:
            self._open_journal(data_dir, storage, recorded)
        self._writer = threading.Thread(target=self._write_loop, name="kvshare-writer", daemon=True)
        self._writer.start()
        self._syncer: threading.Thread | None = None
        if not storage.sync_writes and storage.sync_interval_ms:
            self._syncer = threading.Thread(
                target=self._sync_loop,
                name="kvshare-fsync",
                args=(storage.sync_interval_ms / 1000,),
                daemon=True,
            )
            self._syncer.start()

    def _integrity_failed(self, tenant: TenantId, blocks: int) -> None:
        self.events.integrity_failure(tenant, blocks)
        if self._on_integrity_failure is not None:
            self._on_integrity_failure(tenant, blocks)

    def probe(self) -> str | None:
        """Why the store cannot take writes (for the health check), or None. Blocking.

        A real commit that failed since the last probe counts once even if the probe's
        own write works, so a failure between probes is seen; health then recovers by
        itself as soon as the tier commits again."""
        with self._lock:
            failure, self._commit_failure = self._commit_failure, None
        return self._disk.probe() or failure

    def _sync_loop(self, interval_s: float) -> None:
        """Bound what a power loss can take when commits are not fsynced one by one.
        Background work like draining: the lowest CPU priority."""
        _lower_this_threads_priority()
        while not self._closing.wait(interval_s):
            try:
                self._disk.sync()
            except Exception:  # a failing disk shows in the next commit; keep trying
                log.exception("periodic fsync failed")

    # -- start-up -------------------------------------------------------------------

    def _rebuild_index(self) -> None:
        """Load the disk index; reclaim blocks of retired epochs or removed tenants."""
        stale: list[StorageKey] = []
        live = []
        for meta in self._disk.scan():
            if meta.tenant in self._epochs and meta.epoch == self._epochs[meta.tenant]:
                live.append(meta)
            else:
                stale.append(meta.key)
        for meta in sorted(live, key=lambda m: m.clock):
            self._index.add(meta.key, meta.tenant, meta.size, clock=meta.clock, tag=meta.model_tag)
        if stale:
            self.reclaimed_at_start = self._disk.delete(stale)
            log.info("reclaimed %d blocks of retired epochs or removed tenants", len(stale))
        if self._index.used_bytes > self._index.budget_bytes:  # the budget was lowered
            victims = []
            excess = self._index.used_bytes - self._index.budget_bytes
            for key, entry in self._index.oldest_first():
                if excess <= 0:
                    break
                victims.append(key)
                excess -= entry.size
                self.events.evicted("lmdb", "budget", entry.size)
            self._remove_everywhere(victims)
            self._disk.delete(victims)

    def _replay_journal(self, recorded: tuple[Position, Path] | None) -> int:
        """Commit to LMDB the journaled puts a crash left out of it; returns how many.

        Runs after the index is rebuilt, so replayed blocks are admitted (quotas,
        budget, first writer wins) like new puts. Blocks of retired epochs or removed
        tenants are skipped, as start-up reclamation would drop them anyway."""
        if recorded is None:
            return 0
        position, path = recorded
        batch: list[_PutJob] = []
        size = replayed = 0
        last = position

        def commit() -> int:
            self._commit(batch, drained=(last, path))
            return sum(1 for job in batch if _stored(job))

        for record in replay(path, position):
            last = Position(position.journal_id, record.seq, record.end)
            if self._epochs.get(record.tenant) != record.epoch:
                continue
            batch.append(
                _PutJob(record.key, record.tenant, record.epoch, record.payload, record.model_tag)
            )
            size += len(record.payload)
            if size >= MAX_BATCH_BYTES:
                replayed += commit()
                batch, size = [], 0
        if batch or last != position:
            replayed += commit()
        if last != position:
            log.info("replayed %d journaled puts into LMDB after an unclean stop", replayed)
        return replayed

    def _open_journal(
        self, data_dir: Path, storage: StorageConfig, recorded: tuple[Position, Path] | None
    ) -> None:
        """Start a fresh journal; `recorded` is the one replayed at start-up, if any."""
        path = default_journal_path(data_dir, storage.journal_dir)
        if path is None:
            log.info(
                "no tmpfs for the put journal (set [storage] journal_dir): puts are "
                "acknowledged after their LMDB commit"
            )
            return
        if storage.journal_dir:
            try:
                path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            except OSError as error:
                raise ConfigError(
                    f"cannot create journal_dir {path.parent}: {error.strerror}"
                ) from None
        if recorded is not None and recorded[1] != path:
            recorded[1].unlink(missing_ok=True)  # replayed above; the journal moved
        journal = Journal(
            path, storage.journal_bytes, recorded[0].seq if recorded else 0, owner=data_dir
        )
        for orphan in remove_orphans(path.parent, keep=path):
            log.info("removed %s: the put journal of a data dir that no longer exists", orphan)
        journal.on_full = self._journal_full
        # From here on a replay follows the new journal's chain, which starts empty.
        self._disk.write([], [], drained=(journal.start, path))
        self._journal, self._journal_path = journal, path
        threading.Thread(target=self._prefault, name="kvshare-prefault", daemon=True).start()

    def _prefault(self) -> None:
        """Keep the journal's pages made ahead of its use (Journal.prefault), with the
        CPU that serving leaves (a put that overtakes it makes its own pages)."""
        _lower_this_threads_priority()
        journal = self._journal
        while journal is not None and not self._closing.is_set():
            if not journal.prefault():
                journal.prefault_wanted.wait()
                journal.prefault_wanted.clear()

    # -- reads ------------------------------------------------------------------------

    def lookup(self, tenant: TenantId, keys: Sequence[StorageKey]) -> int:
        with self._lock:
            self._last_activity = time.monotonic()
            present = 0
            for key in keys:
                if not self._index.touch(key):
                    break
                present += 1
        self.events.looked_up(tenant, len(keys), present)
        return present

    def read(self, tenant: TenantId, keys: Sequence[StorageKey]) -> Reading:
        """The leading present blocks of `keys`, batch by batch (cacheserver.reading)."""
        return Reading(self, tenant, keys)

    def pin(self) -> Callable[[], None]:
        """Keep views of journal records valid until the returned function is called:
        a record's space is not written again while a reader that entered before it
        was released is still using it."""
        journal = self._journal
        if journal is None:
            return _nothing
        token = journal.enter_read()
        return lambda: journal.exit_read(token)

    def read_from_memory(self, keys: Sequence[StorageKey]) -> tuple[list[Payload], bool]:
        """Leading payloads held in memory, and whether the key after them is stored
        (fast; safe to call on the event loop)."""
        out: list[Payload] = []
        with self._lock:
            self._last_activity = time.monotonic()
            for key in keys:
                payload = self._memory.get(key)
                if payload is None or not self._index.touch(key):
                    break
                out.append(payload)
            more = len(out) < len(keys) and keys[len(out)] in self._index
        return out, more

    def read_through(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads (about `max_bytes` of them, at least one) read through from
        LMDB and promoted to memory, and whether the key after them is stored.
        Blocking: run it off the event loop."""
        with self._lock:
            wanted: list[StorageKey] = []
            total = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is None or (wanted and total + entry.size > max_bytes):
                    break
                wanted.append(key)
                total += entry.size
            journaled = {key: self._pending[key].payload for key in wanted if key in self._pending}
        on_disk = [key for key in wanted if key not in journaled]
        read = dict(zip(on_disk, self._disk.read_many(on_disk) if on_disk else [], strict=True))
        payloads = [journaled[key] if key in journaled else read[key] for key in wanted]
        out: list[Payload] = []
        with self._lock:
            for key, payload in zip(wanted, payloads, strict=True):
                if payload is None:
                    if key not in self._pending:  # not put again meanwhile
                        self._remove_everywhere([key])  # corrupt or gone: a miss from now on
                    return out, False
                # A view of a journal record is not promoted: the record may have been
                # drained and its space reclaimed since it was taken above, and the
                # memory tier must never keep such a view past the reclaim.
                touched = self._index.touch(key)
                if touched and key not in journaled and self._memory.admit(key, tenant, payload):
                    self.events.stored(tenant, "memory", len(payload))
                out.append(payload)
            more = len(out) < len(keys) and keys[len(out)] in self._index
        return out, more

    # -- writes -----------------------------------------------------------------------

    def put(
        self, tenant: TenantId, key: StorageKey, model_tag: ModelTag, source: BlockSource
    ) -> concurrent.futures.Future[bool]:
        """Store a block whose bytes `source` supplies; the future is True (stored) or
        False (already present). Refusals (quota, journal or writer backlog full) raise
        ResourceExhausted before any byte is taken.

        With the journal, the bytes go straight into their record and the future is
        done on return: the put is acknowledged. Without, they go into a buffer the
        memory tier keeps, and the future completes once the writer has committed the
        block to LMDB (callers wait for all of a request's futures together, so one
        commit acknowledges them all)."""
        if self._journal is not None:
            job = self._begin_put(tenant, key, source.size, model_tag)
            if job is None:
                source.skip()
                return _done(False)
            try:
                source.fill(memoryview(job.payload))
            except BaseException:
                self._abandon_put(job)
                raise
            return _done(self._finish_put(job))
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                self.events.put_outcome(tenant, "already_present", source.size)
                source.skip()
                return _done(False)
        payload = source.payload()
        if payload is None:
            buffer = bytearray(source.size)
            source.fill(memoryview(buffer))  # kept as filled: no further copy
            payload = buffer
        return self._submit_put(tenant, key, payload, model_tag)

    def _submit_put(
        self, tenant: TenantId, key: StorageKey, payload: Payload, model_tag: ModelTag
    ) -> concurrent.futures.Future[bool]:
        """Write-through (no journal): queue the block for the writer's next commit."""
        job = _PutJob(key, tenant, self._epochs.get(tenant, 0), payload, model_tag)
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                job.future.set_result(False)
                self.events.put_outcome(tenant, "already_present", len(payload))
                return job.future
        nbytes = len(payload)
        try:
            self._reserve_pending(tenant, nbytes)
        except ResourceExhausted as error:
            job.future.set_exception(error)
            return job.future
        job.future.add_done_callback(lambda _: self._release_pending(nbytes))
        self._queue.put(job)
        return job.future

    def _begin_put(
        self, tenant: TenantId, key: StorageKey, size: int, model_tag: ModelTag
    ) -> _PutJob | None:
        """Journal only: reserve a record for a block of `size` bytes. Write the block
        into the job's `payload` (a view of the record), then call `_finish_put`, or
        `_abandon_put` if it cannot be had. None: the block is already stored.

        Raises ResourceExhausted when the tenant's quota or the journal has no room."""
        journal = self._journal
        assert journal is not None
        job = _PutJob(key, tenant, self._epochs.get(tenant, 0), b"", model_tag)
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                self.events.put_outcome(tenant, "already_present", size)
                return None
            try:  # refuse before journaling what cannot be admitted
                self._index.victims_with_reasons(tenant, size)
            except NoRoom as error:
                raise self._no_room(tenant, size, error) from None
        self._reserve_pending(tenant, size)
        try:
            job.record = journal.reserve(key, tenant, job.epoch, model_tag, size, JOURNAL_WAIT_S)
        except JournalFull:
            self._release_pending(size)
            self.events.put_outcome(tenant, "rejected", size)
            raise
        except OSError as error:
            self._release_pending(size)
            self.events.put_outcome(tenant, "failed", size)
            log.error("put journal write failed: %s", error.strerror)
            raise Unavailable(
                "the put journal could not be written; check free space on "
                "[storage] journal_dir (default /dev/shm)"
            ) from None
        job.payload = job.record.view
        return job

    def _finish_put(self, job: _PutJob) -> bool:
        """The job's block is complete: commit its record and make it visible. Returns
        whether it was stored (False: another put of the same key came first).

        Raises ResourceExhausted if the block lost its room meanwhile (quota)."""
        journal, record = self._journal, job.record
        assert journal is not None and record is not None
        journal.commit(record)
        with self._lock:
            admitted, evicted = self._plan([job])
            job.evicted = tuple(key for key, _, _ in evicted)
            for key, entry, reason in evicted:
                self._memory.drop(key)
                self._pending.pop(key, None)  # the writer will pass over it
                self.events.evicted("lmdb", reason, entry.size)
            if admitted:
                self._pending[job.key] = job
                self._note_stored(job)
                if self._memory.get(job.key) is job.payload:
                    self._views_in_memory[record.seq] = (job.key, record.view)
                    heapq.heappush(self._view_seqs, record.seq)
            else:
                job.void = True
            self._last_activity = time.monotonic()
        self._queue.put(job)
        failure = job.future.exception() if job.future.done() else None
        if failure is not None:
            raise failure
        return bool(admitted)

    def _abandon_put(self, job: _PutJob) -> None:
        """The block of a `_begin_put` will not come (a dropped connection, a refused
        payload): its record is passed over."""
        job.void = True
        self._queue.put(job)

    def _reserve_pending(self, tenant: TenantId, nbytes: int) -> None:
        """Count `nbytes` against max_pending_write_bytes, or refuse the put."""
        deadline = time.monotonic() + (JOURNAL_WAIT_S if self._journal is not None else 0.0)
        with self._pending_room:
            # With the journal the writer drains on demand: wait for it, as for journal room.
            while (
                self._pending_bytes + nbytes > self._max_pending_bytes
                and nbytes <= self._max_pending_bytes
                and time.monotonic() < deadline
            ):
                self._drain_now.set()
                self._pending_room.wait(max(0.0, deadline - time.monotonic()))
            if self._pending_bytes + nbytes > self._max_pending_bytes:
                # Refuse rather than queue without bound: writers faster than the disk
                # must not grow the server's memory (the client retries or drops).
                self.events.put_outcome(tenant, "rejected", nbytes)
                raise ResourceExhausted(
                    f"{self._pending_bytes} bytes already wait for the disk writer; "
                    f"max_pending_write_bytes is {self._max_pending_bytes}: retry later, "
                    "or raise it in [storage]"
                )
            self._pending_bytes += nbytes

    def _note_stored(self, job: _PutJob) -> None:
        """A new block is stored (under `_lock`): count it and keep it hot."""
        self.events.put_outcome(job.tenant, "stored", len(job.payload))
        if self._memory.admit(job.key, job.tenant, job.payload):
            self.events.stored(job.tenant, "memory", len(job.payload))

    def _no_room(self, tenant: TenantId, size: int, error: NoRoom) -> ResourceExhausted:
        self.events.quota_rejected(tenant)
        self.events.put_outcome(tenant, "rejected", size)
        return ResourceExhausted(
            f"no room for a {size}-byte block: {error.reason}; raise the "
            "tenant's quota_bytes or [storage] disk_budget_bytes"
        )

    def _release_pending(self, nbytes: int) -> None:
        # Futures may complete while the writer holds _lock: count under a lock of its own.
        with self._pending_room:
            self._pending_bytes -= nbytes
            self._pending_room.notify_all()

    def _write_loop(self) -> None:
        if self._journal is not None:
            _lower_this_threads_priority()
        waiting: list[_Barrier] = []
        while True:
            job = self._queue.get()
            if job is None:
                return
            if isinstance(job, _PutJob) and job.record is not None:
                self._wait_for_quiet()
            batch = [job]
            size = len(job.payload) if isinstance(job, _PutJob) else 0
            limit = MAX_DRAIN_BYTES if self._journal is not None else MAX_BATCH_BYTES
            while size < limit and len(batch) < MAX_BATCH_BLOCKS:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
                if isinstance(nxt, _PutJob):
                    size += len(nxt.payload)
            jobs = [j for j in batch if isinstance(j, _PutJob)]
            if jobs and jobs[0].record is not None:
                self._drain(jobs)
            elif jobs:
                self._commit(jobs)
            waiting += [b for b in batch if isinstance(b, _Barrier)]
            self._reclaim()
            drained = self._journal.drained_seq if self._journal is not None else 0
            for barrier in [b for b in waiting if b.through_seq <= drained]:
                waiting.remove(barrier)
                barrier.future.set_result(None)

    def _drain(self, jobs: Sequence[_PutJob]) -> None:
        """Commit journaled (already acknowledged) blocks to LMDB, with how far the
        journal's chain is now covered, then free what that covers. Retried until it
        works: these blocks exist nowhere else but the journal."""
        journal, path = self._journal, self._journal_path
        assert journal is not None and path is not None
        seqs = {job.record.seq for job in jobs if job.record is not None}
        with self._lock:
            live = [j for j in jobs if not j.void and self._pending.get(j.key) is j]
        deletes = [key for job in jobs for key in job.evicted]
        writes = [
            PendingWrite(j.key, j.tenant, j.epoch, j.clock, j.payload, j.model_tag) for j in live
        ]
        point = journal.drain_point(seqs)
        while writes or deletes or point is not None:
            try:
                self._disk.write(writes, deletes, (point, path) if point is not None else None)
                break
            except Exception as error:
                reason = type(error).__name__
                log.error("moving journaled puts into LMDB failed (%s); retrying", reason)
                with self._lock:
                    self._commit_failure = f"an LMDB commit failed ({reason})"
                if self._closing.wait(RETRY_DRAIN_S):
                    return  # stopping: the journal keeps them for the next start
        with self._lock:
            for job in live:
                if self._pending.get(job.key) is job:
                    del self._pending[job.key]
                self.events.stored(job.tenant, "lmdb", len(job.payload))
        journal.finish(seqs, point)
        self._release_pending(sum(len(j.payload) for j in jobs))

    def _journal_full(self) -> None:
        """A put waits for journal room: wake the writer (drain, then reclaim)."""
        self._drain_now.set()
        if not self._reclaim_asked.is_set():
            self._reclaim_asked.set()
            self._queue.put(_Reclaim())

    def _reclaim(self) -> None:
        """Reuse journal space of drained blocks, oldest first, down to half the ring
        (all of it while a put waits for room). Until then the memory tier serves those
        blocks from their records, without a copy."""
        journal = self._journal
        if journal is None:
            return
        self._reclaim_asked.clear()
        ring = journal.capacity
        keep = 0 if journal.waiting_for_room() else ring // 2
        through = journal.reclaimable(keep)
        if through is None:
            return
        with self._lock:  # readers entering from now on cannot find these views
            while self._view_seqs and self._view_seqs[0] <= through:
                key, view = self._views_in_memory.pop(heapq.heappop(self._view_seqs))
                if self._memory.get(key) is view:
                    self._memory.drop(key)
        journal.reclaim(through)

    def _wait_for_quiet(self) -> None:
        """Hold journaled puts back until requests pause, unless something needs them
        now. Draining copies every byte again and faults in page-cache pages; on a small
        host (two vCPUs here, likely one core's hyperthreads) it slowed concurrent gets
        by a quarter or more even at nice 19, so it waits for the store to be idle."""
        journal = self._journal
        while journal is not None and not self._closing.is_set() and not self._barriers:
            quiet_for = time.monotonic() - self._last_activity
            if quiet_for >= self._drain_idle_s or journal.under_pressure():
                return
            self._drain_now.wait(self._drain_idle_s - quiet_for)
            self._drain_now.clear()

    def _barrier(self) -> None:
        """Wait until every journal record reserved so far is drained or given up."""
        if self._journal is None:
            return
        barrier = _Barrier(self._journal.last_seq)
        with self._lock:
            self._barriers += 1
        self._queue.put(barrier)
        self._drain_now.set()
        try:
            barrier.future.result(timeout=BARRIER_TIMEOUT_S)
        except concurrent.futures.TimeoutError:
            raise Unavailable(
                "the disk writer is behind or failing; retry the delete later"
            ) from None
        finally:
            with self._lock:
                self._barriers -= 1

    def _plan(
        self, batch: Sequence[_PutJob]
    ) -> tuple[list[_PutJob], list[tuple[StorageKey, Entry, EvictReason]]]:
        """Reserve room for the batch in the index; returns admitted jobs and evicted entries."""
        admitted: list[_PutJob] = []
        evicted: list[tuple[StorageKey, Entry, EvictReason]] = []
        for job in batch:
            if job.key in self._index or any(a.key == job.key for a in admitted):
                job.future.set_result(False)
                self.events.put_outcome(job.tenant, "already_present", len(job.payload))
                continue
            try:
                victims = self._index.victims_with_reasons(job.tenant, len(job.payload))
            except NoRoom as error:
                job.future.set_exception(self._no_room(job.tenant, len(job.payload), error))
                continue
            for victim, reason in victims.items():
                entry = self._index.remove(victim)
                if entry is not None:
                    evicted.append((victim, entry, reason))
            self._index.add(job.key, job.tenant, len(job.payload), tag=job.model_tag)
            job.clock = self._index.clock
            admitted.append(job)
        return admitted, evicted

    def _commit(
        self, batch: Sequence[_PutJob], drained: tuple[Position, Path] | None = None
    ) -> None:
        """Commit new blocks to LMDB, then make them visible (write-through puts, and
        the replay of the journal at start-up, which passes the position it reached)."""
        with self._lock:
            admitted, evicted = self._plan(batch)
            for key, _, _ in evicted:
                self._memory.drop(key)
            # Entries are in the index for planning only; hide them until committed.
            for job in admitted:
                self._index.remove(job.key)
        if not admitted and not evicted and drained is None:
            return
        writes = [
            PendingWrite(j.key, j.tenant, j.epoch, j.clock, j.payload, j.model_tag)
            for j in admitted
        ]
        try:
            stored = self._disk.write(writes, [k for k, _, _ in evicted], drained)
        except Exception as error:  # the batch failed as a whole: nothing was written
            with self._lock:
                for key, entry, _ in evicted:
                    self._index.add(key, entry.tenant, entry.size, clock=entry.clock, tag=entry.tag)
                self._commit_failure = f"an LMDB commit failed ({type(error).__name__})"
                for job in admitted:
                    self.events.put_outcome(job.tenant, "failed", len(job.payload))
            failure = (
                error
                if isinstance(error, KvshareError)
                else Unavailable(
                    "the disk tier could not commit; check free space and permissions "
                    "of the data dir"
                )
            )
            if not isinstance(error, KvshareError):
                log.exception("LMDB commit failed")
            for job in admitted:
                job.future.set_exception(failure)
            return
        with self._lock:
            for _, entry, reason in evicted:
                self.events.evicted("lmdb", reason, entry.size)
            for job, fresh in zip(admitted, stored, strict=True):
                if not fresh:
                    self.events.put_outcome(job.tenant, "already_present", len(job.payload))
                    continue
                self._index.add(
                    job.key, job.tenant, len(job.payload), clock=job.clock, tag=job.model_tag
                )
                self.events.stored(job.tenant, "lmdb", len(job.payload))
                self._note_stored(job)
        for job, fresh in zip(admitted, stored, strict=True):
            job.future.set_result(fresh)

    # -- deletes, stats, shutdown -----------------------------------------------------

    def _remove_everywhere(self, keys: Sequence[StorageKey]) -> None:
        """Forget `keys` in the index and memory, and any journaled block of them not yet
        in LMDB (the writer then passes over its record)."""
        for key in keys:
            self._index.remove(key)
            self._memory.drop(key)
            self._pending.pop(key, None)

    def _remove_from_index(self, keys: Sequence[StorageKey]) -> None:
        """Forget `keys`, journaled ones included, then wait until the writer has passed
        their journal records, so that neither its next commit nor a replay after a
        crash can bring them back. Blocking."""
        with self._lock:
            self._remove_everywhere(keys)
        self._barrier()

    def delete(self, keys: Sequence[StorageKey]) -> int:
        with self._lock:
            present = [k for k in keys if k in self._index]
        self._remove_from_index(present)
        if not present:
            return 0
        self._disk.delete(present)
        return len(present)

    def delete_tenant(self, tenant: TenantId, model_tag: ModelTag | None = None) -> int:
        """Every block of the tenant, or (with `model_tag`) of one model of it."""
        with self._lock:
            keys = self._index.keys_of(tenant, model_tag)
        self._remove_from_index(keys)
        if not keys:
            return 0
        self._disk.delete(keys)
        return len(keys)

    def tenant_usage(self, tenant: TenantId) -> tuple[int, int]:
        with self._lock:
            return self._index.tenant_blocks(tenant), self._index.tenant_bytes(tenant)

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        """name -> (blocks, bytes, budget_bytes)."""
        with self._lock:
            return {
                "memory": (len(self._memory), self._memory.used_bytes, self._memory.budget_bytes),
                "lmdb": (len(self._index), self._index.used_bytes, self._index.budget_bytes),
            }

    @property
    def undrained_blocks(self) -> int:
        """Journaled (acknowledged) blocks not yet committed to LMDB."""
        with self._lock:
            return len(self._pending)

    @property
    def integrity_failures(self) -> int:
        return self._disk.integrity_failures

    def close(self) -> None:
        """Finish queued writes, then close LMDB cleanly."""
        self._closing.set()  # a writer retrying a failed drain gives up; the journal keeps it
        self._drain_now.set()
        self._queue.put(None)
        self._writer.join()
        if self._syncer is not None:
            self._syncer.join()
        if self._journal is not None:
            # Everything journaled is in LMDB now: the journal is not needed to start again.
            self._journal.close(remove=not self._pending)
        self._disk.close()
