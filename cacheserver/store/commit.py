"""The LMDB commit of a batch of new blocks, the one path of write-through puts (the
writer thread) and of the journal's replay at start-up (cacheserver.store.recovery).

A batch ends where the same puts one by one would: room is planned job after job under
the store's lock (`IndexedTiers.plan`), the admitted blocks are written outside it, and
only then do they enter the index (become visible), are counted and kept hot; a commit
that fails puts back what its plan evicted, and every job of it fails. Like the
journal's puts and the writer, it works on the index and the tiers directly
(cacheserver.store.tiering).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cacheserver.store.jobs import Evicted, PutJob, commit_error
from cacheserver.store.tiering import IndexedTiers
from cacheserver.tiers import JournalCheckpoint
from kvcommon.errors import KvshareError

log = logging.getLogger(__name__)


def commit_batch(
    tiers: IndexedTiers, batch: Sequence[PutJob], drained: JournalCheckpoint | None = None
) -> KvshareError | None:
    """Commit new blocks to LMDB, then make them visible (write-through puts, and
    the replay of the journal at start-up, which passes the position it reached).
    Returns why the commit failed (each job's future carries it too), or None."""
    with tiers.lock:
        admitted, evicted, superseded = tiers.plan(batch)
        tiers.memory.delete([key for key, _, _ in evicted])
        # Entries are in the index for planning only; hide them until committed.
        for job in admitted:
            tiers.index.remove(job.key)
    if not admitted and not evicted and not superseded and drained is None:
        return None
    writes = [job.as_write() for job in admitted]
    try:
        stored = tiers.disk.write(writes, [k for k, _, _ in evicted], drained)
    except Exception as error:  # the batch failed as a whole: nothing was written
        return _commit_failed(tiers, error, [*admitted, *(job for job, _ in superseded)], evicted)
    events = tiers.events
    with tiers.lock:
        for _, entry, reason in evicted:
            events.evicted("lmdb", reason, entry.size)
        for job, reason in superseded:
            events.put_outcome(job.tenant, "stored", len(job.payload))
            events.evicted("lmdb", reason, len(job.payload))
        for job, fresh in zip(admitted, stored, strict=True):
            if not fresh:
                events.put_outcome(job.tenant, "already_present", len(job.payload))
                continue
            tiers.index.add(
                job.key, job.tenant, len(job.payload), clock=job.clock, tag=job.model_tag
            )
            events.stored(job.tenant, "lmdb", len(job.payload))
            tiers.note_stored(job)
    for job, _ in superseded:
        job.future.set_result(True)
    for job, fresh in zip(admitted, stored, strict=True):
        job.future.set_result(fresh)
    tiers.lineup.write_behind([w for w, fresh in zip(writes, stored, strict=True) if fresh])
    return None


def _commit_failed(
    tiers: IndexedTiers, error: Exception, admitted: Sequence[PutJob], evicted: Evicted
) -> KvshareError:
    with tiers.lock:
        for key, entry, _ in evicted:
            tiers.index.add(key, entry.tenant, entry.size, clock=entry.clock, tag=entry.tag)
        tiers.note_commit_failure(error)
        for job in admitted:
            tiers.events.put_outcome(job.tenant, "failed", len(job.payload))
    if not isinstance(error, KvshareError):
        log.exception("LMDB commit failed")
    failure = commit_error(error)
    for job in admitted:
        job.future.set_exception(failure)
    return failure
