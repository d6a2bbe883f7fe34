"""The tiers the store composes, the index over them, and the one lock that guards both.

Invariants:
- The index is the authority on what exists here. Every block it lists is held by the
  put journal (acknowledged, not yet drained: `JournaledPuts`) or by LMDB, the first
  lower tier, and reads fall through in that order (then through any tier behind
  LMDB). The memory tier holds a subset of the index, never more.
- A block enters the index (becomes visible) only once a crash of the server can no
  longer lose it: after its LMDB commit, or after its journal record is committed.
- First writer wins: a key already in the index is never written again.
- The index, the memory tier and the journaled-put state change only under `lock`;
  lower tiers are called outside it (blocking I/O).
- Tiers behind LMDB (`behind`, none by default) get every block LMDB commits, after
  the commit (written behind: their failures never fail a put), and every delete.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

from cacheserver.events import EvictReason, StoreEvents
from cacheserver.tiers.index import BlockIndex, Entry, NoRoom
from cacheserver.store.jobs import PutJob
from cacheserver.tiers import (
    JournalCheckpoint,
    LowerTier,
    Payload,
    PendingWrite,
    SharedTier,
    Tier,
)
from cacheserver.tiers.lmdb import LmdbTier
from cacheserver.tiers.memory import MemoryTier
from kvcommon.errors import KvshareError, ResourceExhausted, Unavailable
from policy.types import StorageKey, TenantId

if TYPE_CHECKING:
    from cacheserver.store.journaled import JournaledPuts

log = logging.getLogger(__name__)
Evicted = list[tuple[StorageKey, Entry, EvictReason]]


class Admission(NamedTuple):
    """What `Tiers.plan` decided for a batch of puts."""

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


class Tiers:
    def __init__(
        self,
        index: BlockIndex,
        memory: MemoryTier,
        disk: LmdbTier,
        behind: Sequence[LowerTier],
        events: StoreEvents,
    ) -> None:
        self.lock = threading.Lock()
        self.index = index
        self.memory = memory
        self.disk = disk
        self.behind = tuple(behind)
        self.lower: tuple[LowerTier, ...] = (disk, *self.behind)
        # Issue 17: the tier behind LMDB that other servers share (the Redis Cluster),
        # if any: the facade asks it on index misses and sends deletes through it.
        self.shared: SharedTier | None = next(
            (tier for tier in self.behind if isinstance(tier, SharedTier)), None
        )
        self.events = events
        # Set once at start-up when puts are journaled (cacheserver.store.journaled).
        self.journaled: JournaledPuts | None = None
        # time.monotonic() of the last request the store served (lookup, get, put): the
        # writer drains the journal when requests pause (Writer._wait_for_quiet).
        self.last_activity = 0.0
        # Why the last commit failed, until the health probe has seen it (probe()).
        self.commit_failure: str | None = None
        # Journal records dropped at replay because their bytes failed their checksum
        # (LMDB counts its own corrupt blocks: LmdbTier.integrity_failures).
        self.journal_integrity_failures = 0
        # Why the writer cannot move journaled puts into LMDB (its last drain failed),
        # or None: a put the full journal refuses then says so (JournaledPuts).
        self.drain_failure: KvshareError | None = None

    # -- admission (under `lock`) ----------------------------------------------------

    def plan(self, batch: Sequence[PutJob]) -> Admission:
        """Reserve room for the batch in the index, job after job, as if each were put
        on its own: the admitted jobs, the entries their room evicted, and the jobs a
        later job of the same batch evicted again (`Admission`)."""
        admitted: dict[StorageKey, PutJob] = {}
        evicted: Evicted = []
        superseded: list[tuple[PutJob, EvictReason]] = []
        for job in batch:
            if job.key in self.index or job.key in admitted:
                job.future.set_result(False)
                self.events.put_outcome(job.tenant, "already_present", len(job.payload))
                continue
            try:
                victims = self.index.victims_with_reasons(job.tenant, len(job.payload))
            except NoRoom as error:
                job.future.set_exception(self.no_room(job.tenant, len(job.payload), error))
                continue
            for victim, reason in victims.items():
                entry = self.index.remove(victim)
                if victim in admitted:
                    # Evicted by a later block of its own batch: it never reaches LMDB.
                    # Writing it anyway would leave its tenant over quota (and the store
                    # over budget) once the batch commits; a put call or a journal replay
                    # of several blocks must end where the same puts one by one would.
                    superseded.append((admitted.pop(victim), reason))
                elif entry is not None:
                    evicted.append((victim, entry, reason))
            self.index.add(job.key, job.tenant, len(job.payload), tag=job.model_tag)
            job.clock = self.index.clock
            admitted[job.key] = job
        return Admission(list(admitted.values()), evicted, superseded)

    def no_room(self, tenant: TenantId, size: int, error: NoRoom) -> ResourceExhausted:
        self.events.quota_rejected(tenant)
        self.events.put_outcome(tenant, "rejected", size)
        return ResourceExhausted(
            f"no room for a {size}-byte block: {error.reason}; raise the "
            "tenant's quota_bytes or [storage] disk_budget_bytes"
        )

    def note_stored(self, job: PutJob) -> None:
        """A new block is stored (under `lock`): count it and keep it hot."""
        self.events.put_outcome(job.tenant, "stored", len(job.payload))
        if self.memory.admit(job.key, job.tenant, job.payload):
            self.events.stored(job.tenant, "memory", len(job.payload))

    def remove_everywhere(self, keys: Sequence[StorageKey]) -> None:
        """Forget `keys` in the index and the in-process tiers (under `lock`): a
        journaled block of them not yet in LMDB is passed over by the writer."""
        for key in keys:
            self.index.remove(key)
            self.memory.drop(key)
        if self.journaled is not None:
            self.journaled.delete(keys)

    # -- commits (the writer thread, and the replay at start-up) ---------------------

    def commit(
        self, batch: Sequence[PutJob], drained: JournalCheckpoint | None = None
    ) -> KvshareError | None:
        """Commit new blocks to LMDB, then make them visible (write-through puts, and
        the replay of the journal at start-up, which passes the position it reached).
        Returns why the commit failed (each job's future carries it too), or None."""
        with self.lock:
            admitted, evicted, superseded = self.plan(batch)
            for key, _, _ in evicted:
                self.memory.drop(key)
            # Entries are in the index for planning only; hide them until committed.
            for job in admitted:
                self.index.remove(job.key)
        if not admitted and not evicted and not superseded and drained is None:
            return None
        writes = [job.as_write() for job in admitted]
        try:
            stored = self.disk.write(writes, [k for k, _, _ in evicted], drained)
        except Exception as error:  # the batch failed as a whole: nothing was written
            return self._commit_failed(error, [*admitted, *(job for job, _ in superseded)], evicted)
        with self.lock:
            for _, entry, reason in evicted:
                self.events.evicted("lmdb", reason, entry.size)
            for job, reason in superseded:
                self.events.put_outcome(job.tenant, "stored", len(job.payload))
                self.events.evicted("lmdb", reason, len(job.payload))
            for job, fresh in zip(admitted, stored, strict=True):
                if not fresh:
                    self.events.put_outcome(job.tenant, "already_present", len(job.payload))
                    continue
                self.index.add(
                    job.key, job.tenant, len(job.payload), clock=job.clock, tag=job.model_tag
                )
                self.events.stored(job.tenant, "lmdb", len(job.payload))
                self.note_stored(job)
        for job, _ in superseded:
            job.future.set_result(True)
        for job, fresh in zip(admitted, stored, strict=True):
            job.future.set_result(fresh)
        if self.behind:
            self.write_behind([w for w, fresh in zip(writes, stored, strict=True) if fresh])
        return None

    def _commit_failed(
        self, error: Exception, admitted: Sequence[PutJob], evicted: Evicted
    ) -> KvshareError:
        with self.lock:
            for key, entry, _ in evicted:
                self.index.add(key, entry.tenant, entry.size, clock=entry.clock, tag=entry.tag)
            self.commit_failure = f"an LMDB commit failed ({type(error).__name__})"
            for job in admitted:
                self.events.put_outcome(job.tenant, "failed", len(job.payload))
        if not isinstance(error, KvshareError):
            log.exception("LMDB commit failed")
        failure = commit_error(error)
        for job in admitted:
            job.future.set_exception(failure)
        return failure

    def write_behind(self, writes: Sequence[PendingWrite]) -> None:
        """Hand blocks LMDB has just committed to every tier behind it. A failure there
        fails no put (each is acknowledged already); it is logged, and the tier's own
        probe says why it cannot take writes."""
        for tier in self.behind:
            try:
                tier.write(writes, ())
            except Exception as error:
                log.error(
                    "writing behind to %s failed (%s)", type(tier).__name__, type(error).__name__
                )

    # -- across the lower tiers (blocking: outside `lock`) ---------------------------

    def read_below(self, keys: Sequence[StorageKey]) -> dict[StorageKey, Payload | None]:
        """The payloads of `keys` from the lower tiers: each from the first tier that
        holds it (LMDB, then the tiers behind it), None where none does."""
        found: dict[StorageKey, Payload | None] = dict(
            zip(keys, self.disk.read_many(keys), strict=True)
        )
        for tier in self.behind:
            missing = [key for key, payload in found.items() if payload is None]
            if not missing:
                break
            found.update(zip(missing, tier.read_many(missing), strict=True))
        return found

    def delete_below(self, keys: Sequence[StorageKey]) -> int:
        """Delete `keys` from every lower tier, durably; how many LMDB held. The shared
        tier is left to the caller: its deletes are announced to the other servers
        (`SharedTier.delete_held`, `delete_namespace`)."""
        deleted = self.disk.delete(keys)
        for tier in self.behind:
            if tier is not self.shared:
                tier.delete(keys)
        return deleted

    def probe(self) -> str | None:
        """Why a lower tier cannot take writes now, or None."""
        for tier in self.lower:
            reason = tier.probe()
            if reason is not None:
                return reason
        return None

    def close(self) -> None:
        """Close every tier, fastest first: the memory tier lets go of its views of
        journal records before the journal is unmapped."""
        tiers: list[Tier] = [self.memory]
        if self.journaled is not None:
            tiers.append(self.journaled)
        tiers.extend(self.lower)
        for tier in tiers:
            tier.close()
