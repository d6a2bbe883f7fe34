"""`BlockStore`: the store's one face, for the request core (`cacheserver.core.requests`)
and the transports' reads (`cacheserver.store.reading.ReadSource`).

Invariants of the facade (the store's own are in `cacheserver.store.tiering`):
- A put is acknowledged (its future True) only once its block is visible and a crash
  of the server cannot lose it; the caller never learns whether it was journaled.
- `read_from_memory` never blocks (the index and memory tier, under the lock): safe on
  the event loop; nor does `lookup` unless a shared tier is configured
  (`lookup_blocks`: it asks that tier on an index miss). Methods marked Blocking run
  off it.
- The facade reaches the tiers only through the verbs of `IndexedTiers` and `Lineup`, which
  take the lock where they need it.
- Everything countable (hits, misses, blocks and bytes per tier, evictions, refusals,
  integrity failures) is reported to `events` as it happens; the events carry
  tenants and sizes, never keys.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from cacheserver.blocks import BlockSource
from cacheserver.config import StorageConfig
from cacheserver.events import NoEvents, StoreEvents
from cacheserver.store.jobs import PutJob, done
from cacheserver.store.journal import Journal
from cacheserver.store.journaled import JournaledPuts
from cacheserver.store.lineup import Lineup
from cacheserver.store.local import StoreCopies
from cacheserver.store.reading import Reading
from cacheserver.store.recovery import (
    open_journal,
    rebuild_index,
    replay_journal,
    restore_pinned,
)
from cacheserver.store.tiering import IndexedTiers
from cacheserver.store.upkeep import start_prefaulter, start_syncer
from cacheserver.store.writer import Writer
from cacheserver.tiers import JournalCheckpoint, Payload, Tier
from cacheserver.tiers.index import BlockIndex
from cacheserver.tiers.lmdb.tier import LmdbTier
from cacheserver.tiers.memory import MemoryTier, memory_quotas
from policy.types import ModelTag, StorageKey, TenantId

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


def _warn_if_not_pinned(
    quotas_bytes: Mapping[TenantId, int], fixed_order: frozenset[TenantId], memory_bytes: int
) -> None:
    """A fixed-order namespace (the public scope) is pinned in memory up to half the
    tier (`memory_quotas`); what its quota allows past that is read from disk, as fast
    as the page cache happens to make it, which depends on who read it last."""
    for tenant in fixed_order:
        if quotas_bytes.get(tenant, 0) > memory_bytes // 2:
            log.warning(
                "the public scope's quota_bytes (%d) is over half of [storage] "
                "memory_budget_bytes (%d): published blocks past that are served from "
                "disk, and how fast tells whether they were read lately; lower "
                "[public] quota_bytes or raise memory_budget_bytes",
                quotas_bytes[tenant],
                memory_bytes,
            )


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
        lower_tiers: Sequence[Tier] = (),
        fixed_order: frozenset[TenantId] = frozenset(),
        drain_within_s: float | None = None,
    ) -> None:
        """`lower_tiers`: tiers behind LMDB, in order (see the package docstring). The
        store starts them once it exists (`Tier.start`), and stops and closes them.
        `fixed_order`: namespaces that reads leave as they found them (the public
        scope: cacheserver.tiers.index)."""
        self.events: StoreEvents = events or NoEvents()
        self._on_integrity_failure = on_integrity_failure
        disk = LmdbTier(
            data_dir / "lmdb",
            map_bytes=storage.effective_map_bytes(),
            sync_writes=storage.sync_writes,
            on_integrity_failure=self._integrity_failed,
        )
        self.lmdb_path = disk.path  # what bulk workers read (cacheserver.transport.bulk.readworker)
        memory = MemoryTier(
            storage.memory_budget_bytes,
            memory_quotas(
                quotas_bytes,
                storage.memory_budget_bytes,
                storage.disk_budget_bytes,
                fixed_order,
            ),
            on_evict=lambda reason, nbytes: self.events.evicted("memory", reason, nbytes),
            fixed_order=fixed_order,
        )
        _warn_if_not_pinned(quotas_bytes, fixed_order, storage.memory_budget_bytes)
        index = BlockIndex(storage.disk_budget_bytes, quotas_bytes, fixed_order)
        self._lineup = Lineup(memory, disk, lower_tiers)
        self._tiers = IndexedTiers(index, self._lineup, self.events)
        self._journaled: JournaledPuts | None = None
        self._journal: Journal | None = None  # what a read pins (`pin`)
        self._prefaulter: threading.Thread | None = None
        self._epochs = dict(epochs)
        self._storage, self._fixed_order = storage, fixed_order  # for `set_quotas`
        self._closing = threading.Event()
        self._writer = Writer(
            self._tiers,
            self.events,
            storage.max_pending_write_bytes,
            storage.max_pending_write_bytes_per_tenant,
            storage.drain_idle_ms / 1000,
            self._closing,
            drain_within_s,
        )
        self.reclaimed_at_start = rebuild_index(self._tiers, self._epochs)
        restore_pinned(self._tiers)
        recorded = disk.journal_position()
        try:
            self.replayed_at_start = replay_journal(
                self._tiers, self._epochs, recorded, self._integrity_failed
            )
        except BaseException:  # the start fails (JournalNotReplayed): let go of LMDB
            disk.close()
            raise
        if storage.journal_bytes and not storage.sync_writes:
            self._start_journal(data_dir, storage, recorded)
        self._writer.start()
        self._syncer: threading.Thread | None = None
        if not storage.sync_writes and storage.sync_interval_ms:
            self._syncer = start_syncer(disk, storage.sync_interval_ms / 1000, self._closing)
        local = StoreCopies(self._tiers, self.put, self.pin, self._writer.barrier)
        self._lineup.start(local)

    def _start_journal(
        self, data_dir: Path, storage: StorageConfig, recorded: JournalCheckpoint | None
    ) -> None:
        opened = open_journal(self._tiers, data_dir, storage, recorded)
        if opened is None:
            return
        journal, path = opened
        self._journal = journal
        journal.on_full = self._writer.journal_full
        writer = self._writer
        self._journaled = JournaledPuts(
            self._tiers, journal, path, self._epochs, writer.backlog, writer.enqueue
        )
        self._tiers.journaled = self._journaled
        writer.use_journal(self._journaled)
        tiers = self._tiers
        self._prefaulter = start_prefaulter(
            journal.space, self._closing, lambda: tiers.last_activity, storage.drain_idle_ms / 1000
        )

    def _integrity_failed(self, tenant: TenantId, blocks: int) -> None:
        self.events.integrity_failure(tenant, blocks)
        if self._on_integrity_failure is not None:
            self._on_integrity_failure(tenant, blocks)

    def probe(self) -> str | None:
        """Why the store cannot take writes (for the health check), or None. Blocking.

        A real commit that failed since the last probe counts once even if the probe's
        own write works, so a failure between probes is seen; health then recovers by
        itself as soon as the tier commits again. A tier with a health of its own
        (`Capability.OWN_HEALTH`, the Redis Cluster) is not asked."""
        return self._tiers.probe()

    # -- reads ------------------------------------------------------------------------

    def reads_handed_back(self) -> None:
        """A bulk worker handed a read back: journaled puts move into LMDB within
        `drain_within_s` for a while (Writer.reads_handed_back)."""
        self._writer.reads_handed_back()

    def lookup(self, tenant: TenantId, keys: Sequence[StorageKey]) -> int:
        """How many of `keys`, leading, are stored. Blocking only with a shared tier
        (`lookup_blocks`), which is asked about the keys after the index's last hit."""
        present = self._tiers.touch_leading(keys)
        present += self._lineup.count_shared(tenant, keys, present)
        self.events.looked_up(tenant, len(keys), present)
        return present

    def touch(self, keys: Iterable[StorageKey]) -> None:
        """Mark `keys` as just used, where the index lists them: blocks that a bulk
        worker served (it reads LMDB, not the index)."""
        self._tiers.touch(keys)

    def read(self, tenant: TenantId, keys: Sequence[StorageKey]) -> Reading:
        """The leading present blocks of `keys`, batch by batch (cacheserver.store.reading)."""
        return Reading(self, tenant, keys)

    def pin(self) -> Callable[[], None]:
        """Keep views of journal records valid until the returned function is called:
        a record's space is not written again while a reader that entered before it
        was released is still using it (`Journal.enter_read`)."""
        journal = self._journal
        if journal is None:
            return _nothing
        token = journal.enter_read()
        return lambda: journal.exit_read(token)

    def read_from_memory(
        self, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads held in memory (about `max_bytes` of them, at least one),
        and whether the key after them is stored (fast; safe on the event loop)."""
        return self._tiers.read_from_memory(keys, max_bytes)

    def read_through(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads (about `max_bytes` of them, at least one) read through the
        journal and the lower tiers and promoted to memory, and whether the key after
        them is stored. Blocking: run it off the event loop."""
        return self._tiers.read_through(tenant, keys, max_bytes)

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
        journaled = self._journaled
        if journaled is not None:
            stored = journaled.put(tenant, key, model_tag, source)
            if stored:  # shared tiers write it now: a drain may be far off
                self._lineup.share(tenant, key, model_tag)
            return done(stored)
        if self._tiers.already_present(tenant, key, source.size):
            source.skip()
            return done(False)
        # Room in the writer's backlog before any buffer is taken for the bytes: a
        # bound checked after allocating bounds nothing (a put of many large blocks
        # would hold them all in memory before the first refusal).
        self._writer.backlog.reserve(tenant, source.size, 0.0)
        try:
            payload = source.payload()
            if payload is None:
                buffer = bytearray(source.size)
                source.fill(memoryview(buffer))  # kept as filled: no further copy
                payload = buffer
        except BaseException:
            self._writer.backlog.release(tenant, source.size)
            raise
        return self._put_through(
            PutJob(key, tenant, self._epochs.get(tenant, 0), payload, model_tag)
        )

    def check_room(self, tenant: TenantId, key: StorageKey, size: int) -> None:
        """Refuse now (ResourceExhausted) a block of `size` bytes that could not be
        admitted — bigger than the tenant's quota or the budget, or no block left that
        the rules let it evict — before its bytes are received. A block stored already
        is not refused: its put is answered "already present" (first writer wins)."""
        self._tiers.check_room(tenant, key, size)

    def _put_through(self, job: PutJob) -> concurrent.futures.Future[bool]:
        """Write-through (no journal): queue the block for the writer's next commit."""
        if self._tiers.already_present(job.tenant, job.key, len(job.payload)):
            self._writer.backlog.release(job.tenant, len(job.payload))
            job.future.set_result(False)
            return job.future
        return self._writer.submit(job)

    # -- deletes, stats, shutdown -----------------------------------------------------

    def delete(self, keys: Sequence[StorageKey]) -> int:
        """Delete blocks by key; returns how many were stored. Blocking.

        Durable when it returns: the keys leave the index and memory, the writer passes
        their journal records (so neither its next commit nor a replay after a crash
        can bring them back), then every tier below deletes every key asked — listed in
        the index or not; a shared tier deletes the other servers' copies too. When the
        writer cannot be waited for (Unavailable), nothing is reported deleted, and a
        retry deletes from the tiers below what the first attempt already took out of
        the index: no state a retry hides."""
        present = len(self._tiers.forget(keys))
        self._writer.barrier()
        held = self._lineup.delete_shared(keys)
        deleted = self._lineup.delete_below(keys)
        return max(present, deleted, held)

    def set_quotas(self, quotas_bytes: Mapping[TenantId, int]) -> list[StorageKey]:
        """New per-tenant quotas (a live config reload): a tenant over its new quota is
        evicted down to it at once, least recently used first: its blocks leave the
        index and memory here (other tenants keep every block); pass the keys returned
        to `delete` to delete them below (that waits on the writer: a caller that must
        not wait does it later)."""
        storage = self._storage
        memory = memory_quotas(
            quotas_bytes,
            storage.memory_budget_bytes,
            storage.disk_budget_bytes,
            self._fixed_order,
        )
        return self._tiers.set_quotas(quotas_bytes, memory)

    def delete_tenant(self, tenant: TenantId, model_tag: ModelTag | None = None) -> int:
        """Every block of the tenant, or (with `model_tag`) of one model of it, by the
        same rules as `delete`; LMDB is swept for the tenant's blocks, so a retry after
        a failure finds what the index no longer lists. Blocking."""
        keys = self._tiers.forget_namespace(tenant, model_tag)
        self._writer.barrier()
        swept = self._tiers.swept(tenant, model_tag)
        held = self._lineup.delete_shared_namespace(tenant, model_tag)
        deleted = self._lineup.delete_below(sorted({*keys, *swept}))
        return max(len(keys), deleted, held)

    # -- figures, shutdown ------------------------------------------------------------

    @property
    def lookup_blocks(self) -> bool:
        """Whether `lookup` may block (it asks a shared tier on index misses)."""
        return self._lineup.asks_on_miss

    def tenant_usage(self, tenant: TenantId) -> tuple[int, int]:
        return self._tiers.tenant_usage(tenant)

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        """name -> (blocks, bytes, budget_bytes)."""
        return self._tiers.usage()

    @property
    def undrained_blocks(self) -> int:
        """Journaled (acknowledged) blocks not yet committed to LMDB."""
        return self._tiers.undrained_blocks

    def journal_usage(self) -> tuple[int, int]:
        """(bytes the put journal's records may take, bytes of records not yet drained
        into LMDB); (0, 0) without a journal."""
        journal = self._journal
        return (0, 0) if journal is None else (journal.ring_bytes, journal.undrained_bytes)

    def writer_backlog(self) -> tuple[int, int, int, dict[TenantId, int]]:
        """What waits for the disk writer: (blocks, bytes, max_pending_write_bytes,
        bytes by tenant with any)."""
        writer = self._writer
        nbytes, by_tenant = writer.backlog.pending_bytes()
        return writer.waiting_blocks, nbytes, writer.backlog.max_bytes, by_tenant

    @property
    def integrity_failures(self) -> int:
        """Corrupt blocks dropped: read from LMDB, or found in the journal at replay."""
        return self._tiers.integrity_failures

    def close(self) -> None:
        """Finish queued writes, then close every tier (LMDB cleanly; the journal is
        removed when everything in it is in LMDB, so it is not needed to start again).
        The tiers' own threads stop first: they may still put or read local copies."""
        self._lineup.stop()
        self._closing.set()  # a writer retrying a failed drain gives up; the journal keeps it
        self._writer.stop()
        if self._syncer is not None:
            self._syncer.join()
        self._tiers.close()
        if self._prefaulter is not None:  # the journal's close woke it: it ends now
            self._prefaulter.join()
