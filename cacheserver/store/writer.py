"""The store's one writer thread: group commits, the drain of journaled puts, barriers.

Writes go through one thread that groups every queued block into one LMDB transaction
(group commit): with `sync_writes`, one fsync acknowledges many puts. With the journal
(the default unless `sync_writes`), puts are acknowledged already and the writer
drains behind them (`_drain`), at whatever pace the disk allows, in smaller commits,
each recording how far the journal's chain is covered, then frees journal space.

Invariants:
- LMDB never gets back a block the index dropped: the writer commits only journaled
  jobs still pending (`JournaledPuts.live`), and deletes wait (`barrier`) until it has
  passed every journal record reserved before them, so a replay after a crash cannot
  bring a deleted block back either.
- A drain is retried until it works: its blocks exist nowhere else but the journal.
- The writer runs at the lowest CPU priority when puts are journaled (they are
  acknowledged already), and waits for requests to pause unless something needs it.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

from cacheserver.events import StoreEvents
from cacheserver.store.backlog import WriteBacklog
from cacheserver.store.commit import commit_batch
from cacheserver.store.jobs import Barrier, Message, PutJob, Reclaim
from cacheserver.store.tiering import IndexedTiers
from cacheserver.store.upkeep import lower_this_threads_priority
from kvcommon.errors import Unavailable

if TYPE_CHECKING:
    from cacheserver.store.journaled import JournaledPuts

log = logging.getLogger(__name__)
MAX_BATCH_BYTES = 256 << 20  # bound one commit's size so a burst cannot stall reads long
# Journaled blocks drain in smaller commits: journal space is reclaimed after each, and
# a put waiting for room should not wait for a quarter of a gigabyte to reach the disk.
MAX_DRAIN_BYTES = 32 << 20
# After a bulk worker handed back a read, journaled puts reach LMDB within
# `drain_within_s` for this long (`reads_handed_back`).
HANDED_BACK_READS_HOLD_S = 1.0
MAX_BATCH_BLOCKS = 4096
RETRY_DRAIN_S = 1.0  # a failed drain of journaled puts is retried after this long
BARRIER_TIMEOUT_S = 60.0  # a delete waits at most this long for the writer


class Writer:
    def __init__(
        self,
        tiers: IndexedTiers,
        events: StoreEvents,
        max_pending_bytes: int,
        max_pending_tenant_bytes: int,
        drain_idle_s: float,
        closing: threading.Event,
        drain_within_s: float | None = None,
    ) -> None:
        """`closing` is set when the store stops: a writer retrying a failed drain gives
        up (the journal keeps those blocks for the next start). `drain_within_s`: while
        bulk workers hand reads back (`reads_handed_back`), a journaled put moves into
        LMDB at most this long after it was acknowledged, even while requests never
        pause (bulk workers read LMDB only)."""
        self._tiers = tiers
        self._queue: queue.SimpleQueue[Message] = queue.SimpleQueue()  # C: ~1 us less a put
        self._reclaim_asked = threading.Event()
        self._drain_now = threading.Event()  # wakes a writer waiting for a quiet moment
        # Journaled puts move into LMDB once puts pause this long ([storage] drain_idle_ms)
        self._drain_idle_s = drain_idle_s
        self._drain_within_s = drain_within_s
        self._reads_handed_back_at = -HANDED_BACK_READS_HOLD_S  # monotonic seconds
        self._barriers = 0  # deletes waiting for the writer (under _barriers_lock)
        self._barriers_lock = threading.Lock()
        # The journaled puts it drains, once the store has opened the journal
        # (`use_journal`, before `start`); None: puts are written through.
        self._journaled: JournaledPuts | None = None
        self._closing = closing
        self.backlog = WriteBacklog(
            max_pending_bytes, events, self._drain_now.set, max_pending_tenant_bytes
        )
        self._in_hand = 0  # put jobs of the batch the writer holds (written by its thread)
        self._thread = threading.Thread(target=self._loop, name="kvshare-writer", daemon=True)

    def use_journal(self, journaled: JournaledPuts) -> None:
        """Drain these journaled puts (called once, before `start`)."""
        self._journaled = journaled

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Finish what is queued, then stop (after `closing` is set)."""
        self._drain_now.set()
        self._queue.put(None)
        self._thread.join()

    # -- what the store hands the writer ---------------------------------------------

    def submit(self, job: PutJob) -> concurrent.futures.Future[bool]:
        """Write-through (no journal): queue the block, whose bytes the caller reserved
        in the backlog (`backlog.reserve`), for the next commit; the future completes
        once it is committed, and gives the reservation back."""
        nbytes, tenant = len(job.payload), job.tenant
        job.future.add_done_callback(lambda _: self.backlog.release(tenant, nbytes))
        self._queue.put(job)
        return job.future

    def enqueue(self, job: PutJob) -> None:
        """A journaled job, acknowledged (or given up): drain it (or pass its record)."""
        self._queue.put(job)

    def reads_handed_back(self) -> None:
        """A bulk worker handed a read back (blocks LMDB lacks, journaled ones among
        them): for the next HANDED_BACK_READS_HOLD_S, journaled puts move into LMDB
        within `drain_within_s`, where workers find them. Puts alone wait for a pause,
        as without workers: draining them while they arrive took ~90 us of server CPU
        a 64 KiB put from 4 clients on 2 cores, and no worker asked for them. (Reads a
        worker hands back for other reasons, misses among them, hold it too: in mixed
        traffic it is on most of the time, the rule before 2026-12-05.)"""
        now = time.monotonic()
        began = not self._holding(now)
        self._reads_handed_back_at = now
        if self._drain_within_s is not None and began:
            self._drain_now.set()  # the hold begins: a writer waiting for a pause looks again

    def _holding(self, now: float) -> bool:
        """Whether a worker handed a read back within HANDED_BACK_READS_HOLD_S of `now`."""
        return now - self._reads_handed_back_at <= HANDED_BACK_READS_HOLD_S

    def journal_full(self) -> None:
        """A put waits for journal room: wake the writer (drain, then reclaim)."""
        self._drain_now.set()
        if not self._reclaim_asked.is_set():
            self._reclaim_asked.set()
            self._queue.put(Reclaim())

    def barrier(self) -> None:
        """Wait until every journal record reserved so far is drained or given up.
        Raises Unavailable after BARRIER_TIMEOUT_S."""
        journaled = self._journaled
        if journaled is None:
            return
        barrier = Barrier(journaled.journal.last_seq)
        with self._barriers_lock:
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
            with self._barriers_lock:
                self._barriers -= 1

    @property
    def waiting_blocks(self) -> int:
        """Blocks handed to the writer and not yet committed (journaled ones: not yet
        drained) or passed over: queued, or in the batch it holds (a delete's barrier or
        a reclaim still queued counts as one too). Read for a metric: two reads without
        a lock, so it may be off by one batch for the moment the writer takes one."""
        return self._queue.qsize() + self._in_hand

    # -- the thread ------------------------------------------------------------------

    def _loop(self) -> None:
        if self._journaled is not None:
            lower_this_threads_priority()
        waiting: list[Barrier] = []
        while True:
            first = self._queue.get()
            if first is None:
                return
            self._in_hand = 1 if isinstance(first, PutJob) else 0
            if isinstance(first, PutJob) and first.record is not None:
                self._wait_for_quiet(time.monotonic())
            batch = self._gather(first)
            jobs = [j for j in batch if isinstance(j, PutJob)]
            self._in_hand = len(jobs)
            if jobs and jobs[0].record is not None:
                self._drain(jobs)
            elif jobs:
                commit_batch(self._tiers, jobs)
            waiting += [b for b in batch if isinstance(b, Barrier)]
            self._in_hand = 0
            self._reclaim()
            self._settle(waiting)

    def _gather(self, first: PutJob | Barrier | Reclaim) -> list[PutJob | Barrier | Reclaim]:
        """`first` and whatever else is queued, up to one commit's worth."""
        batch = [first]
        size = len(first.payload) if isinstance(first, PutJob) else 0
        limit = MAX_DRAIN_BYTES if self._journaled is not None else MAX_BATCH_BYTES
        while size < limit and len(batch) < MAX_BATCH_BLOCKS:
            try:
                nxt = self._queue.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                self._queue.put(None)  # finish this batch, then stop
                break
            batch.append(nxt)
            if isinstance(nxt, PutJob):
                size += len(nxt.payload)
        return batch

    def _settle(self, waiting: list[Barrier]) -> None:
        """Complete the barriers the journal's drained position has passed."""
        journaled = self._journaled
        drained = journaled.journal.drained_seq if journaled is not None else 0
        for barrier in [b for b in waiting if b.through_seq <= drained]:
            waiting.remove(barrier)
            barrier.future.set_result(None)

    def _drain(self, jobs: Sequence[PutJob]) -> None:
        """Commit journaled (already acknowledged) blocks to LMDB, with how far the
        journal's chain is now covered, then free what that covers. Retried until it
        works: these blocks exist nowhere else but the journal."""
        tiers, journaled = self._tiers, self._journaled
        assert journaled is not None
        journal = journaled.journal
        seqs = {job.record.seq for job in jobs if job.record is not None}
        live = journaled.live(jobs)
        deletes = [key for job in jobs for key in job.evicted]
        writes = [job.as_write() for job in live]
        point = journal.drain_point(seqs)
        while writes or deletes or point is not None:
            try:
                checkpoint = (point, journaled.path) if point is not None else None
                tiers.disk.write(writes, deletes, checkpoint)
                break
            except Exception as error:
                reason = type(error).__name__
                log.error("moving journaled puts into LMDB failed (%s); retrying", reason)
                journaled.drain_failed(error)  # health, and why the journal fills up
                if self._closing.wait(RETRY_DRAIN_S):
                    return  # stopping: the journal keeps them for the next start
        journaled.drained(live)
        journal.finish(seqs, point)
        for job in jobs:
            self.backlog.release(job.tenant, len(job.payload), landed=job.landed)
        tiers.lineup.write_behind(writes)

    def _reclaim(self) -> None:
        journaled = self._journaled
        if journaled is None:
            return
        self._reclaim_asked.clear()
        journaled.reclaim()

    def _wait_for_quiet(self, since: float) -> None:
        """Hold journaled puts back until requests pause, unless something needs them
        now, or (`drain_within_s`, while workers hand reads back) the oldest waited that
        long since `since`. Draining copies every byte again and faults in page-cache
        pages; on a small host (two vCPUs here, likely one core's hyperthreads) it
        slowed concurrent gets by a quarter or more even at nice 19, so it waits for
        the store to be idle."""
        journaled = self._journaled
        while journaled is not None and not self._closing.is_set() and not self._barriers:
            now = time.monotonic()
            quiet_for = now - self._tiers.last_activity
            waited = now - since
            # No worker asked lately for what it could not find: no bound.
            within = self._drain_within_s if self._holding(now) else None
            if (
                quiet_for >= self._drain_idle_s
                or (within is not None and waited >= within)
                or journaled.journal.under_pressure()
                or self.backlog.has_waiters
            ):
                return
            wait_s = self._drain_idle_s - quiet_for
            if within is not None:
                wait_s = min(wait_s, within - waited)
            self._drain_now.wait(wait_s)
            self._drain_now.clear()
