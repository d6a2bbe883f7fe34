"""The block store: a memory tier over an LMDB tier, with one writer thread.

Invariants:
- A block is visible (to lookup and get) only after its durable commit: new entries
  join the disk index after the commit that wrote them.
- First writer wins: a key already on disk is never overwritten.
- The disk index is the authority on what exists; the memory tier only ever holds a
  subset of it (dropping a block from disk drops it from memory too).
- All index and memory-tier state is touched under `_lock`; LMDB I/O happens outside
  it (reads on executor threads, writes on the writer thread).

Writes go through one writer thread that groups every queued block into one LMDB
transaction (group commit): with `sync_writes`, one fsync acknowledges many puts.

Everything countable (hits, misses, blocks and bytes per tier, evictions, refusals,
integrity failures) is reported to a `StoreEvents` as it happens; the server's
telemetry turns those into metrics. The events carry tenants and sizes, never keys.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cacheserver.config import StorageConfig
from cacheserver.events import NoEvents, StoreEvents, Tier
from cacheserver.index import BlockIndex, Entry, EvictReason, NoRoom
from cacheserver.lmdb_tier import LmdbTier, PendingWrite
from cacheserver.memory_tier import MemoryTier, Payload
from kvshare.errors import KvshareError, ResourceExhausted, Unavailable
from policy.types import ModelTag, StorageKey, TenantId

log = logging.getLogger(__name__)
MAX_BATCH_BYTES = 256 << 20  # bound one commit's size so a burst cannot stall reads long
MAX_BATCH_BLOCKS = 4096
PREWARM_IDLE_S = 0.02  # the writer warms file space after this long without puts


@dataclass
class TenantCounters:
    lookups: int = 0
    lookup_hits: int = 0
    lookup_digests: int = 0  # digests asked: lookup_hits / lookup_digests is the hit rate
    blocks_served: int = 0
    bytes_served: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0


@dataclass
class _PutJob:
    key: StorageKey
    tenant: TenantId
    epoch: int
    payload: Payload
    model_tag: ModelTag
    clock: int = 0
    future: concurrent.futures.Future[bool] = field(default_factory=concurrent.futures.Future)


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
        self.counters: dict[TenantId, TenantCounters] = {}
        self._queue: queue.Queue[_PutJob | None] = queue.Queue()
        self._pending_bytes = 0  # payload bytes queued for, or inside, the writer
        self._prewarm_bytes = storage.prewarm_bytes
        self._pending_lock = threading.Lock()
        self._max_pending_bytes = storage.max_pending_write_bytes
        self._rebuild_index()
        self._writer = threading.Thread(target=self._write_loop, name="kvshare-writer", daemon=True)
        self._writer.start()
        self._closing = threading.Event()
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
        """Bound what a power loss can take when commits are not fsynced one by one."""
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

    # -- reads ------------------------------------------------------------------------

    def count(self, tenant: TenantId) -> TenantCounters:
        counters = self.counters.get(tenant)
        if counters is None:
            counters = self.counters[tenant] = TenantCounters()
        return counters

    def lookup(self, tenant: TenantId, keys: Sequence[StorageKey]) -> int:
        with self._lock:
            present = 0
            for key in keys:
                if not self._index.touch(key):
                    break
                present += 1
            counters = self.count(tenant)
            counters.lookups += 1
            counters.lookup_hits += present
            counters.lookup_digests += len(keys)
            self.events.looked_up(tenant, len(keys), present)
            return present

    def read_from_memory(self, keys: Sequence[StorageKey]) -> list[Payload]:
        """Leading payloads held in memory (fast; safe to call on the event loop)."""
        out: list[Payload] = []
        with self._lock:
            for key in keys:
                payload = self._memory.get(key)
                if payload is None or not self._index.touch(key):
                    break
                out.append(payload)
        return out

    def is_stored(self, key: StorageKey) -> bool:
        with self._lock:
            return key in self._index

    def read_from_disk(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> list[Payload]:
        """Leading payloads (about `max_bytes` of them, at least one) read through from
        LMDB and promoted to memory. Blocking: run it off the event loop."""
        with self._lock:
            wanted: list[StorageKey] = []
            total = 0
            for key in keys:
                entry = self._index.get(key)
                if entry is None or (wanted and total + entry.size > max_bytes):
                    break
                wanted.append(key)
                total += entry.size
        payloads = self._disk.read_many(wanted)
        out: list[Payload] = []
        with self._lock:
            for key, payload in zip(wanted, payloads, strict=True):
                if payload is None:
                    self._remove_everywhere([key])  # corrupt or gone: a miss from now on
                    break
                if self._index.touch(key) and self._memory.admit(key, tenant, payload):
                    self.events.stored(tenant, "memory", len(payload))
                out.append(payload)
        return out

    def note_served(self, tenant: TenantId, tier: Tier, payloads: Sequence[Payload]) -> None:
        """`payloads` (read from `tier`) went to a client."""
        nbytes = sum(len(p) for p in payloads)
        with self._lock:
            counters = self.count(tenant)
            counters.blocks_served += len(payloads)
            counters.bytes_served += nbytes
        self.events.served(tenant, tier, len(payloads), nbytes)

    def note_get(self, tenant: TenantId, asked: int, served: int) -> None:
        """A get of `asked` blocks ended after `served` of them (the rest: misses)."""
        self.events.got(tenant, asked, served)

    # -- writes -----------------------------------------------------------------------

    def submit_put(
        self, tenant: TenantId, key: StorageKey, payload: Payload, model_tag: ModelTag
    ) -> concurrent.futures.Future[bool]:
        """Queue a block for the writer; the future is True (stored) or False (already present)."""
        job = _PutJob(key, tenant, self._epochs.get(tenant, 0), payload, model_tag)
        with self._lock:
            if key in self._index:
                self._index.touch(key)
                job.future.set_result(False)
                self.events.put_outcome(tenant, "already_present")
                return job.future
        with self._pending_lock:
            if self._pending_bytes + len(payload) > self._max_pending_bytes:
                # Refuse rather than queue without bound: writers faster than the disk
                # must not grow the server's memory (the client retries or drops).
                job.future.set_exception(
                    ResourceExhausted(
                        f"{self._pending_bytes} bytes already wait for the disk writer; "
                        f"max_pending_write_bytes is {self._max_pending_bytes}: retry later, "
                        "or raise it in [storage]"
                    )
                )
                self.events.put_outcome(tenant, "rejected")
                return job.future
            self._pending_bytes += len(payload)
        job.future.add_done_callback(lambda _: self._release_pending(len(payload)))
        self._queue.put(job)
        return job.future

    def _release_pending(self, nbytes: int) -> None:
        # Futures may complete while the writer holds _lock: count under a lock of its own.
        with self._pending_lock:
            self._pending_bytes -= nbytes

    def _write_loop(self) -> None:
        warming = self._prewarm_bytes > 0
        while True:
            try:
                # Idle: zero-fill file space ahead of LMDB (LmdbTier.prewarm), a chunk at a time.
                job = self._queue.get(timeout=PREWARM_IDLE_S) if warming else self._queue.get()
            except queue.Empty:
                warming = self._disk.prewarm(self._prewarm_bytes)
                continue
            if job is None:
                return
            warming = self._prewarm_bytes > 0
            batch = [job]
            size = len(job.payload)
            while size < MAX_BATCH_BYTES and len(batch) < MAX_BATCH_BLOCKS:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # finish this batch, then stop
                    break
                batch.append(nxt)
                size += len(nxt.payload)
            self._commit(batch)

    def _plan(
        self, batch: Sequence[_PutJob]
    ) -> tuple[list[_PutJob], list[tuple[StorageKey, Entry, EvictReason]]]:
        """Reserve room for the batch in the index; returns admitted jobs and evicted entries."""
        admitted: list[_PutJob] = []
        evicted: list[tuple[StorageKey, Entry, EvictReason]] = []
        for job in batch:
            if job.key in self._index or any(a.key == job.key for a in admitted):
                job.future.set_result(False)
                self.events.put_outcome(job.tenant, "already_present")
                continue
            try:
                victims = self._index.victims_with_reasons(job.tenant, len(job.payload))
            except NoRoom as error:
                self.events.quota_rejected(job.tenant)
                self.events.put_outcome(job.tenant, "rejected")
                job.future.set_exception(
                    ResourceExhausted(
                        f"no room for a {len(job.payload)}-byte block: {error.reason}; raise the "
                        "tenant's quota_bytes or [storage] disk_budget_bytes"
                    )
                )
                continue
            for victim, reason in victims.items():
                entry = self._index.remove(victim)
                if entry is not None:
                    evicted.append((victim, entry, reason))
            self._index.add(job.key, job.tenant, len(job.payload))
            job.clock = self._index.clock
            admitted.append(job)
        return admitted, evicted

    def _commit(self, batch: Sequence[_PutJob]) -> None:
        with self._lock:
            admitted, evicted = self._plan(batch)
            for key, _, _ in evicted:
                self._memory.drop(key)
            # Entries are in the index for planning only; hide them until committed.
            for job in admitted:
                self._index.remove(job.key)
        if not admitted and not evicted:
            return
        writes = [
            PendingWrite(j.key, j.tenant, j.epoch, j.clock, j.payload, j.model_tag)
            for j in admitted
        ]
        try:
            stored = self._disk.write(writes, [k for k, _, _ in evicted])
        except Exception as error:  # the batch failed as a whole: nothing was written
            with self._lock:
                for key, entry, _ in evicted:
                    self._index.add(key, entry.tenant, entry.size, clock=entry.clock, tag=entry.tag)
                self._commit_failure = f"an LMDB commit failed ({type(error).__name__})"
                for job in admitted:
                    self.events.put_outcome(job.tenant, "failed")
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
                    self.events.put_outcome(job.tenant, "already_present")
                    continue
                self._index.add(
                    job.key, job.tenant, len(job.payload), clock=job.clock, tag=job.model_tag
                )
                self.events.put_outcome(job.tenant, "stored")
                self.events.stored(job.tenant, "lmdb", len(job.payload))
                if self._memory.admit(job.key, job.tenant, job.payload):
                    self.events.stored(job.tenant, "memory", len(job.payload))
                counters = self.count(job.tenant)
                counters.blocks_stored += 1
                counters.bytes_stored += len(job.payload)
        for job, fresh in zip(admitted, stored, strict=True):
            job.future.set_result(fresh)

    # -- deletes, stats, shutdown -----------------------------------------------------

    def _remove_everywhere(self, keys: Sequence[StorageKey]) -> None:
        for key in keys:
            self._index.remove(key)
            self._memory.drop(key)

    def delete(self, keys: Sequence[StorageKey]) -> int:
        with self._lock:
            present = [k for k in keys if k in self._index]
            self._remove_everywhere(present)
        return self._disk.delete(present) if present else 0

    def delete_tenant(self, tenant: TenantId, model_tag: ModelTag | None = None) -> int:
        """Every block of the tenant, or (with `model_tag`) of one model of it."""
        with self._lock:
            keys = self._index.keys_of(tenant, model_tag)
            self._remove_everywhere(keys)
        return self._disk.delete(keys) if keys else 0

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
    def integrity_failures(self) -> int:
        return self._disk.integrity_failures

    def close(self) -> None:
        """Finish queued writes, then close LMDB cleanly."""
        self._queue.put(None)
        self._writer.join()
        self._closing.set()
        if self._syncer is not None:
            self._syncer.join()
        self._disk.close()
