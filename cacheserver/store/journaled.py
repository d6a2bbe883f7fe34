"""Journaled puts: the put journal as a tier of the store, in process and under its
lock. It is the store's own, not a `cacheserver.tiers.Tier`: it lives and dies with the
store's writer, and only its reads and deletes look like a tier's.

A journaled put is acknowledged once its record is committed in the journal
(`cacheserver.store.journal`), and stays here (`_pending`) until the writer has moved it into
LMDB. Its record goes RESERVED (`_begin`), receives its bytes in place, then is
COMMITTED and made visible (`_finish`), or is given up (`_abandon`); either way the
writer is handed the job, to drain it or just pass over its record.

Invariants (the state here changes only under the store's lock, `IndexedTiers.lock`):
- A key is in `_pending` exactly while its block is visible and not yet in LMDB:
  reads fall back to the record's view there (`held`).
- The memory tier may hold a view of a record only while `_views` tracks it: views
  are dropped from memory (`reclaim`) before the record's space is released, and a
  view served by `read_through` is never promoted into memory. A fixed-order
  namespace's view (the public scope, which reads never bring back) is replaced by a
  copy instead: a published block stays in memory, whatever the ring reclaims.
- Views handed to readers stay valid while the reader is pinned (`pin`): the ring does
  not write released space again while a reader that entered before may still send it.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from cacheserver.blocks import BlockSource
from cacheserver.store.backlog import WriteBacklog
from cacheserver.store.jobs import PutJob, commit_error
from cacheserver.store.journal import Journal, JournalFull
from cacheserver.store.tiering import IndexedTiers
from cacheserver.tiers import Payload
from kvcommon.errors import KvshareError, Unavailable
from policy.types import ModelTag, StorageKey, TenantId

log = logging.getLogger(__name__)
JOURNAL_WAIT_S = 5.0  # a put waits this long for journal room before it is refused


class JournaledPuts:
    def __init__(
        self,
        tiers: IndexedTiers,
        journal: Journal,
        path: Path,
        epochs: dict[TenantId, int],
        backlog: WriteBacklog,
        enqueue: Callable[[PutJob], None],
    ) -> None:
        """`enqueue(job)` hands a finished or given-up job to the writer."""
        self.journal = journal
        self.path = path
        self._tiers = tiers
        self._epochs = epochs
        self._backlog = backlog
        self._enqueue = enqueue
        self._pending: dict[StorageKey, PutJob] = {}  # journaled, not yet in LMDB
        # Journaled blocks held by the memory tier as views of their records, by seq:
        # dropped from memory before the record's space is released.
        self._views: dict[int, tuple[StorageKey, TenantId, memoryview]] = {}
        self._view_seqs: list[int] = []  # a heap of the seqs in _views
        # Why the writer cannot move journaled puts into LMDB (its last drain failed),
        # or None: a put the full journal refuses then says so (`_why_full`).
        self.drain_failure: KvshareError | None = None

    # -- puts ------------------------------------------------------------------------

    def put(
        self, tenant: TenantId, key: StorageKey, model_tag: ModelTag, source: BlockSource
    ) -> bool:
        """Receive the block into its record and make it visible; returns whether it
        was stored (False: already present). Refusals raise ResourceExhausted."""
        job = self._begin(tenant, key, source.size, model_tag)
        if job is None:
            source.skip()
            return False
        try:
            source.fill(memoryview(job.payload))
        except BaseException:
            self._abandon(job)
            raise
        return self._finish(job)

    def _begin(
        self, tenant: TenantId, key: StorageKey, size: int, model_tag: ModelTag
    ) -> PutJob | None:
        """Reserve a record for a block of `size` bytes: the job's `payload` is a view
        of it. None: the block is already stored. Raises ResourceExhausted when the
        tenant's quota, the writer's backlog or the journal has no room."""
        tiers = self._tiers
        job = PutJob(key, tenant, self._epochs.get(tenant, 0), b"", model_tag)
        if not tiers.admissible(tenant, key, size):  # refused before it is journaled
            return None
        self._backlog.reserve(tenant, size, JOURNAL_WAIT_S)
        try:
            job.record = self.journal.reserve(
                key, tenant, job.epoch, model_tag, size, JOURNAL_WAIT_S
            )
        except JournalFull as full:
            self._backlog.release(tenant, size)
            tiers.events.put_outcome(tenant, "rejected", size)
            raise self._why_full(full) from None
        except OSError as error:
            self._backlog.release(tenant, size)
            tiers.events.put_outcome(tenant, "failed", size)
            log.error("put journal write failed: %s", error.strerror)
            raise Unavailable(
                "the put journal could not be written; check free space on "
                "[storage] journal_dir (default /dev/shm)"
            ) from None
        job.payload = job.record.view
        return job

    def _why_full(self, full: JournalFull) -> JournalFull:
        """The refusal of a put the journal has no room for, naming the real cause.
        The ring only knows it is full; when that is because the writer cannot move its
        blocks into LMDB (the map or the disk is full), more journal space would only
        postpone the refusal, so the message says what LMDB needs instead."""
        failure = self.drain_failure
        if failure is None:
            return full
        return JournalFull(
            f"the put journal is full because its blocks cannot move into LMDB: {failure}"
        )

    def _finish(self, job: PutJob) -> bool:
        """The job's block is complete: commit its record and make it visible. Returns
        whether it was stored (False: another put of the same key came first).

        Raises ResourceExhausted if the block lost its room meanwhile (quota)."""
        tiers, record = self._tiers, job.record
        assert record is not None
        self.journal.commit(record)
        self._backlog.landed(job.tenant, len(job.payload))
        job.landed = True
        with tiers.lock:
            admitted, evicted, _ = tiers.plan([job])  # one job: none superseded
            job.evicted = tuple(key for key, _, _ in evicted)
            for key, entry, reason in evicted:
                tiers.memory.drop(key)
                self._pending.pop(key, None)  # the writer will pass over it
                tiers.events.evicted("lmdb", reason, entry.size)
            if admitted:
                self._pending[job.key] = job
                tiers.note_stored(job)
                if tiers.memory.get(job.key) is job.payload:
                    self._views[record.seq] = (job.key, job.tenant, record.view)
                    heapq.heappush(self._view_seqs, record.seq)
            else:
                job.void = True
            tiers.last_activity = time.monotonic()
        self._enqueue(job)
        failure = job.refusal()
        if failure is not None:
            raise failure
        return bool(admitted)

    def _abandon(self, job: PutJob) -> None:
        """The block of a `_begin` will not come (a dropped connection, a refused
        payload): its record is passed over."""
        job.void = True
        self._enqueue(job)

    # -- the writer's side (each takes the store's lock) -----------------------------

    def live(self, jobs: Sequence[PutJob]) -> list[PutJob]:
        """Those of `jobs` still to be moved into LMDB (not given up, deleted or evicted)."""
        with self._tiers.lock:
            return [j for j in jobs if not j.void and self._pending.get(j.key) is j]

    def drained(self, jobs: Sequence[PutJob]) -> None:
        """`jobs` are in LMDB now: reads find them there."""
        with self._tiers.lock:
            self.drain_failure = None
            for job in jobs:
                if self._pending.get(job.key) is job:
                    del self._pending[job.key]
                self._tiers.events.stored(job.tenant, "lmdb", len(job.payload))

    def drain_failed(self, error: Exception) -> None:
        """Moving journaled puts into LMDB failed: the health probe says so, and so does
        the refusal of a put the journal has no room for."""
        with self._tiers.lock:
            self._tiers.note_commit_failure(error)
            self.drain_failure = commit_error(error)

    def reclaim(self) -> None:
        """Reuse journal space of drained blocks, oldest first, down to half the ring
        (all of it while a put waits for room). Until then the memory tier serves those
        blocks from their records, without a copy. Writer thread; takes the lock."""
        journal = self.journal
        keep = 0 if journal.waiting_for_room() else journal.capacity // 2
        through = journal.reclaimable(keep)
        if through is None:
            return
        memory = self._tiers.memory
        pinned: list[tuple[StorageKey, memoryview]] = []
        with self._tiers.lock:  # readers entering from now on cannot find these views
            while self._view_seqs and self._view_seqs[0] <= through:
                key, tenant, view = self._views.pop(heapq.heappop(self._view_seqs))
                if not memory.holds(key, view):
                    continue
                if tenant in memory.fixed_order:
                    pinned.append((key, view))  # copied below, before the space is reused
                else:
                    memory.drop(key)
        self._keep_copies(pinned)
        journal.reclaim(through)

    def _keep_copies(self, pinned: list[tuple[StorageKey, memoryview]]) -> None:
        """Replace the memory tier's views of these records by copies: blocks of a
        fixed-order namespace, which a read would never bring back into memory. The
        copies are made outside the lock (the records are not reused before
        `journal.reclaim`); a block deleted or evicted meanwhile is not brought back."""
        if not pinned:
            return
        copies = [(key, view, bytes(view)) for key, view in pinned]
        memory = self._tiers.memory
        with self._tiers.lock:
            for key, view, copy in copies:
                memory.replace(key, view, copy)

    # -- reads -----------------------------------------------------------------------

    def held(self, keys: Sequence[StorageKey]) -> dict[StorageKey, Payload]:
        """The record views of those `keys` that are journaled and not yet in LMDB."""
        return {key: self._pending[key].payload for key in keys if key in self._pending}

    def holds(self, key: StorageKey) -> bool:
        return key in self._pending

    @property
    def undrained_blocks(self) -> int:
        return len(self._pending)

    # -- reads and deletes as a tier's, under the store's lock ------------------------

    def read_many(self, keys: Sequence[StorageKey]) -> list[Payload | None]:
        held = self.held(keys)
        return [held.get(key) for key in keys]

    def delete(self, keys: Sequence[StorageKey]) -> int:
        """Forget journaled blocks of `keys`: the writer passes over their records (a
        delete then waits for it to do so: `Writer.barrier`)."""
        return sum(self._pending.pop(key, None) is not None for key in keys)

    def close(self) -> None:
        """Close the journal; remove its file when everything in it is in LMDB."""
        self.journal.close(remove=not self._pending)
