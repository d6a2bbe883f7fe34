"""What the store's threads hand each other: put jobs, barriers, reclaim requests, the
plan of a batch of puts (`PutPlan`), and what a failed commit means for a caller.

Invariant: a put job's future completes exactly once, and only when the put's outcome
is final: stored (True, the block is visible and survives a crash of the server),
already present (False), or refused (an exception). A journaled job's future is done
when its record is committed, before the writer ever sees the job.
"""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field
from typing import NamedTuple

from cacheserver.events import EvictReason
from cacheserver.store.journal import Reservation
from cacheserver.tiers import Payload, PendingWrite
from cacheserver.tiers.index import Entry
from kvcommon.errors import KvshareError, Unavailable
from policy.types import ModelTag, StorageKey, TenantId


@dataclass
class PutJob:
    key: StorageKey
    tenant: TenantId
    epoch: int
    payload: Payload
    model_tag: ModelTag
    clock: int = 0
    _future: concurrent.futures.Future[bool] | None = field(default=None, repr=False)
    # Journaled puts only: the record (its view is `payload`), the blocks its admission
    # evicted (deleted from LMDB by the commit that drains this job), and whether the
    # put was given up (refused or broken off): the writer then only passes its record.
    record: Reservation | None = None
    evicted: tuple[StorageKey, ...] = ()
    void: bool = False
    landed: bool = False  # its bytes all arrived (WriteBacklog.landed)

    @property
    def future(self) -> concurrent.futures.Future[bool]:
        """The put's outcome, made on first use: a journaled put is settled on its own
        thread and needs one only when refused or already present (making one costs
        ~5 µs of a small put's ~100: a Condition and its lock). Whoever hands the job to
        another thread (Writer.submit) makes it first."""
        if self._future is None:
            self._future = concurrent.futures.Future()
        return self._future

    def refusal(self) -> BaseException | None:
        """The exception the job was settled with, if any (makes no future)."""
        future = self._future
        return future.exception() if future is not None and future.done() else None

    def as_write(self) -> PendingWrite:
        record = self.record
        return PendingWrite(
            self.key,
            self.tenant,
            self.epoch,
            self.clock,
            self.payload,
            self.model_tag,
            None if record is None else record.checksum,
        )


@dataclass
class Reclaim:
    """Asks the writer to reuse drained journal space now (a put waits for room)."""


@dataclass
class Barrier:
    """Completes once every journal record reserved before it is drained or given up."""

    through_seq: int
    future: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


Message = PutJob | Barrier | Reclaim | None  # None: stop


def _completed(stored: bool) -> concurrent.futures.Future[bool]:
    future: concurrent.futures.Future[bool] = concurrent.futures.Future()
    future.set_result(stored)
    return future


# A completed future cannot change again (set_result raises), so one of each is shared:
# making one per journaled put cost ~5 µs (a Condition and its lock).
_STORED, _PRESENT = _completed(True), _completed(False)


def done(stored: bool) -> concurrent.futures.Future[bool]:
    """A put's future, already complete."""
    return _STORED if stored else _PRESENT


def was_stored(job: PutJob) -> bool:
    return job.future.done() and job.future.exception() is None and job.future.result()


Evicted = list[tuple[StorageKey, Entry, EvictReason]]


class PutPlan(NamedTuple):
    """What `IndexedTiers.plan` decided for a batch of puts: which enter the index."""

    admitted: list[PutJob]  # in the index now, to be committed
    evicted: Evicted  # entries their room took, stored before the batch
    # Jobs of the batch that a later job of it evicted again, with why: stored for the
    # caller (their put succeeded, then lost its room like any stored block), but never
    # written. Their futures complete with the commit of the batch.
    superseded: list[tuple[PutJob, EvictReason]]


def commit_error(error: Exception) -> KvshareError:
    """What a failed LMDB commit means for a caller, with what to change: the tier's
    own error where it has one (a full map: ResourceExhausted naming lmdb_map_bytes),
    else the disk (full, or not writable)."""
    if isinstance(error, KvshareError):
        return error
    return Unavailable(
        "the disk tier could not commit: free space on the data dir's disk and check its "
        "permissions, or lower [storage] disk_budget_bytes to what that disk holds"
    )
