"""`BlockStore`: the store's one face, for the request core (`cacheserver.core.requests`)
and the transports' reads (`cacheserver.store.reading.ReadSource`).

Invariants of the facade (the store's own are in `cacheserver.store.tiering`):
- A put is acknowledged (its future True) only once its block is visible and a crash
  of the server cannot lose it; the caller never learns whether it was journaled.
- `read_from_memory` never blocks (the index and memory tier, under the lock): safe on
  the event loop; nor does `lookup` unless a shared tier is configured
  (`lookup_blocks`, issue 17). Methods marked Blocking run off it.
- Everything countable (hits, misses, blocks and bytes per tier, evictions, refusals,
  integrity failures) is reported to `events` as it happens; the events carry
  tenants and sizes, never keys.
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from cacheserver.blocks import BlockSource
from cacheserver.config import StorageConfig
from cacheserver.events import NoEvents, StoreEvents
from cacheserver.store import local
from cacheserver.tiers.index import BlockIndex, NoRoom
from cacheserver.store.jobs import PutJob, done
from cacheserver.store.journaled import JournaledPuts
from cacheserver.store.reading import Reading
from cacheserver.store.recovery import open_journal, rebuild_index, replay_journal
from cacheserver.store.tiering import Tiers
from cacheserver.store.upkeep import start_prefaulter, start_syncer
from cacheserver.store.writer import Writer
from cacheserver.tiers import JournalCheckpoint, LowerTier, Payload
from cacheserver.tiers.lmdb import LmdbTier
from cacheserver.tiers.memory import MemoryTier, memory_quotas
from policy.types import ModelTag, StorageKey, TenantId


def _nothing() -> None:
    pass


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
        lower_tiers: Sequence[LowerTier] = (),
    ) -> None:
        """`lower_tiers`: durable tiers behind LMDB (see the package docstring)."""
        self.events: StoreEvents = events or NoEvents()
        self._on_integrity_failure = on_integrity_failure
        disk = LmdbTier(
            data_dir / "lmdb",
            map_bytes=storage.effective_map_bytes(),
            sync_writes=storage.sync_writes,
            on_integrity_failure=self._integrity_failed,
        )
        memory = MemoryTier(
            storage.memory_budget_bytes,
            memory_quotas(quotas_bytes, storage.memory_budget_bytes, storage.disk_budget_bytes),
            on_evict=lambda reason, nbytes: self.events.evicted("memory", reason, nbytes),
        )
        index = BlockIndex(storage.disk_budget_bytes, quotas_bytes)
        self._tiers = Tiers(index, memory, disk, lower_tiers, self.events)
        self._epochs = dict(epochs)
        self._closing = threading.Event()
        self._writer = Writer(
            self._tiers,
            self.events,
            storage.max_pending_write_bytes,
            storage.max_pending_write_bytes_per_tenant,
            storage.drain_idle_ms / 1000,
            self._closing,
        )
        self.reclaimed_at_start = rebuild_index(self._tiers, self._epochs)
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

    def _start_journal(
        self, data_dir: Path, storage: StorageConfig, recorded: JournalCheckpoint | None
    ) -> None:
        opened = open_journal(self._tiers, data_dir, storage, recorded)
        if opened is None:
            return
        journal, path = opened
        journal.on_full = self._writer.journal_full
        writer = self._writer
        self._tiers.journaled = JournaledPuts(
            self._tiers, journal, path, self._epochs, writer.backlog, writer.enqueue
        )
        start_prefaulter(journal, self._closing)

    def _integrity_failed(self, tenant: TenantId, blocks: int) -> None:
        self.events.integrity_failure(tenant, blocks)
        if self._on_integrity_failure is not None:
            self._on_integrity_failure(tenant, blocks)

    def probe(self) -> str | None:
        """Why the store cannot take writes (for the health check), or None. Blocking.

        A real commit that failed since the last probe counts once even if the probe's
        own write works, so a failure between probes is seen; health then recovers by
        itself as soon as the tier commits again."""
        tiers = self._tiers
        with tiers.lock:
            failure, tiers.commit_failure = tiers.commit_failure, None
        return tiers.probe() or failure

    # -- reads ------------------------------------------------------------------------

    def lookup(self, tenant: TenantId, keys: Sequence[StorageKey]) -> int:
        tiers = self._tiers
        index = tiers.index
        with tiers.lock:
            tiers.last_activity = time.monotonic()
            present = 0
            for key in keys:
                if not index.touch(key):
                    break
                present += 1
        if tiers.shared is not None:  # issue 17: an index miss asks the shared tier (blocks)
            present += tiers.shared.count_leading(tenant, keys, present)
        self.events.looked_up(tenant, len(keys), present)
        return present

    def read(self, tenant: TenantId, keys: Sequence[StorageKey]) -> Reading:
        """The leading present blocks of `keys`, batch by batch (cacheserver.store.reading)."""
        return Reading(self, tenant, keys)

    def pin(self) -> Callable[[], None]:
        """Keep views of journal records valid until the returned function is called:
        a record's space is not written again while a reader that entered before it
        was released is still using it."""
        journaled = self._tiers.journaled
        if journaled is None:
            return _nothing
        return journaled.pin()

    def read_from_memory(
        self, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads held in memory (about `max_bytes` of them, at least one),
        and whether the key after them is stored (fast; safe on the event loop)."""
        out: list[Payload] = []
        total = 0
        tiers = self._tiers
        memory, index = tiers.memory, tiers.index
        with tiers.lock:
            tiers.last_activity = time.monotonic()
            for key in keys:
                if out and total >= max_bytes:
                    break
                payload = memory.get(key)
                if payload is None or not index.touch(key):
                    break
                out.append(payload)
                total += len(payload)
            more = len(out) < len(keys) and (keys[len(out)] in index or tiers.shared is not None)
        return out, more

    def read_through(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """Leading payloads (about `max_bytes` of them, at least one) read through the
        journal and the lower tiers and promoted to memory, and whether the key after
        them is stored. Blocking: run it off the event loop."""
        tiers = self._tiers
        journaled = tiers.journaled
        with tiers.lock:
            wanted: list[StorageKey] = []
            total = 0
            for key in keys:
                entry = tiers.index.get(key)
                if entry is None or (wanted and total + entry.size > max_bytes):
                    break
                wanted.append(key)
                total += entry.size
            held = journaled.held(wanted) if journaled is not None else {}
        if not wanted and tiers.shared is not None:  # issue 17: an index miss
            return tiers.shared.read_leading(tenant, keys, max_bytes)
        below = [key for key in wanted if key not in held]
        read = tiers.read_below(below) if below else {}
        out: list[Payload] = []
        with tiers.lock:
            for key in wanted:
                payload = held[key] if key in held else read[key]
                if payload is None:
                    if journaled is None or not journaled.holds(key):  # not put again
                        tiers.remove_everywhere([key])  # corrupt or gone: a miss from now on
                    return out, False
                # A view of a journal record is not promoted: the record may have been
                # drained and its space reclaimed since it was taken above, and the
                # memory tier must never keep such a view past the reclaim.
                touched = tiers.index.touch(key)
                if touched and key not in held and tiers.memory.admit(key, tenant, payload):
                    self.events.stored(tenant, "memory", len(payload))
                out.append(payload)
            more = len(out) < len(keys) and (
                keys[len(out)] in tiers.index or tiers.shared is not None
            )
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
        journaled = self._tiers.journaled
        if journaled is not None:
            stored = journaled.put(tenant, key, model_tag, source)
            if stored and self._tiers.shared is not None:  # issue 17: now, not at the drain
                self._tiers.shared.share(tenant, key, model_tag)
            return done(stored)
        tiers = self._tiers
        with tiers.lock:
            if key in tiers.index:
                tiers.index.touch(key)
                self.events.put_outcome(tenant, "already_present", source.size)
                source.skip()
                return done(False)
        # Room in the writer's backlog before any buffer is taken for the bytes: a
        # bound checked after allocating bounds nothing (issue 15, F6).
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
        tiers = self._tiers
        with tiers.lock:
            if key in tiers.index:
                return
            try:
                tiers.index.victims_with_reasons(tenant, size)
            except NoRoom as error:
                raise tiers.no_room(tenant, size, error) from None

    def _put_through(self, job: PutJob) -> concurrent.futures.Future[bool]:
        """Write-through (no journal): queue the block for the writer's next commit."""
        tiers = self._tiers
        with tiers.lock:
            if job.key in tiers.index:
                tiers.index.touch(job.key)
                self._writer.backlog.release(job.tenant, len(job.payload))
                job.future.set_result(False)
                self.events.put_outcome(job.tenant, "already_present", len(job.payload))
                return job.future
        return self._writer.submit(job)

    # -- deletes, stats, shutdown -----------------------------------------------------

    def delete(self, keys: Sequence[StorageKey]) -> int:
        """Delete blocks by key; returns how many were stored. Blocking.

        Durable when it returns: the keys leave the index and memory, the writer passes
        their journal records (so neither its next commit nor a replay after a crash
        can bring them back), then every tier below deletes every key asked — listed in
        the index or not. When the writer cannot be waited for (Unavailable), nothing
        is reported deleted, and a retry deletes from the tiers below what the first
        attempt already took out of the index: no state a retry hides."""
        tiers = self._tiers
        with tiers.lock:
            present = sum(1 for k in keys if k in tiers.index)
            tiers.remove_everywhere(keys)
        self._writer.barrier()
        shared = tiers.shared  # issue 17: it deletes the other servers' copies too
        held = shared.delete_held(keys) if shared is not None else set()
        deleted = tiers.delete_below(keys)
        return max(present, deleted, len(held))

    def delete_tenant(self, tenant: TenantId, model_tag: ModelTag | None = None) -> int:
        """Every block of the tenant, or (with `model_tag`) of one model of it, by the
        same rules as `delete`; LMDB is swept for the tenant's blocks, so a retry after
        a failure finds what the index no longer lists. Blocking."""
        tiers = self._tiers
        with tiers.lock:
            keys = tiers.index.keys_of(tenant, model_tag)
            tiers.remove_everywhere(keys)
        self._writer.barrier()
        swept = [
            meta.key
            for meta in tiers.disk.scan()
            if meta.tenant == tenant and (model_tag is None or meta.model_tag == model_tag)
        ]
        shared = tiers.shared  # issue 17: blocks of other servers, and their copies
        held = shared.delete_namespace(tenant, model_tag) if shared is not None else set()
        deleted = tiers.delete_below(sorted({*keys, *swept}))
        return max(len(keys), deleted, len(held))

    # -- issue 17: what the shared tier (cacheserver.tiers.cluster) asks of this server ------

    @property
    def lookup_blocks(self) -> bool:
        """Whether `lookup` may block (it asks a shared tier on index misses)."""
        return self._tiers.shared is not None

    def local_keys(self, tenant: TenantId) -> list[tuple[StorageKey, ModelTag]]:
        return local.keys_of(self._tiers, tenant)

    def local_copy(self, key: StorageKey) -> bytes | bytearray | None:
        return local.copy_of(self._tiers, self.pin, key)

    def forget_local(
        self,
        keys: Sequence[StorageKey] = (),
        namespace: tuple[TenantId, ModelTag | None] | None = None,
    ) -> int:
        return local.forget(self._tiers, self._writer.barrier, keys, namespace)

    def tenant_usage(self, tenant: TenantId) -> tuple[int, int]:
        tiers = self._tiers
        with tiers.lock:
            return tiers.index.tenant_blocks(tenant), tiers.index.tenant_bytes(tenant)

    def tier_usage(self) -> dict[str, tuple[int, int, int]]:
        """name -> (blocks, bytes, budget_bytes)."""
        tiers = self._tiers
        memory, index = tiers.memory, tiers.index
        with tiers.lock:
            return {
                "memory": (len(memory), memory.used_bytes, memory.budget_bytes),
                "lmdb": (len(index), index.used_bytes, index.budget_bytes),
            }

    @property
    def undrained_blocks(self) -> int:
        """Journaled (acknowledged) blocks not yet committed to LMDB."""
        tiers = self._tiers
        with tiers.lock:
            return tiers.journaled.undrained_blocks if tiers.journaled is not None else 0

    @property
    def integrity_failures(self) -> int:
        """Corrupt blocks dropped: read from LMDB, or found in the journal at replay."""
        return self._tiers.disk.integrity_failures + self._tiers.journal_integrity_failures

    def close(self) -> None:
        """Finish queued writes, then close every tier (LMDB cleanly; the journal is
        removed when everything in it is in LMDB, so it is not needed to start again)."""
        self._closing.set()  # a writer retrying a failed drain gives up; the journal keeps it
        self._writer.stop()
        if self._syncer is not None:
            self._syncer.join()
        self._tiers.close()
