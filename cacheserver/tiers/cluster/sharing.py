"""Copies between this server and the cluster, on threads of their own.

- Writing: a block acknowledged here is queued (`enqueue`) and written to the cluster
  behind the acknowledgement: `SET NX` with its header, then listed by its tenant's
  accounting (which may evict that tenant's oldest blocks; their keys are deleted at
  once, and a block not admitted is deleted again). The queue is bounded in blocks
  and bytes; past it, or while the cluster is unreachable, writes are dropped and
  counted: the block stays local. Payloads not held as stable bytes are read back from
  the local tiers when their turn comes (`LocalCopies.local_copy`), so a put never
  copies for the cluster on its own thread.
- Touches: blocks used here (lookups, reads) move to the recent end of their tenant's
  order in the cluster, a batch per tenant every TOUCH_EVERY_S.
- Keeping: blocks read from the cluster are put into the local tiers (`promote`), so
  the next read is local; a delete that ran meanwhile undoes the copy (`DeleteLog`).
- Neither touches nor keeps reach a fixed-order namespace (the public scope): the
  tier does not hand its reads here (`ClusterTier.fixed_order`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass

from cacheserver.blocks import BytesSource
from cacheserver.tiers import LocalCopies, Payload
from cacheserver.tiers.cluster.accounting import QuotaListing, Tenant
from cacheserver.tiers.cluster.layout import pack_header
from cacheserver.tiers.cluster.nodes import Failed
from cacheserver.tiers.cluster.parts import ClusterParts
from kvcommon.errors import KvshareError
from policy.types import ModelTag, StorageKey

log = logging.getLogger(__name__)
BATCH_BLOCKS = 64
BATCH_BYTES = 64 << 20
MAX_QUEUED_BLOCKS = 65536
TOUCH_EVERY_S = 0.2
PROMOTE_QUEUE_BYTES = 64 << 20
RECENT_KEYS = 1 << 17  # keys known to be in the cluster: not written again


@dataclass(slots=True)
class _Share:
    tenant: Tenant
    key: StorageKey
    model_tag: ModelTag
    payload: bytes | bytearray | memoryview | None  # None: read it back when its turn comes
    generation: int


@dataclass(frozen=True, slots=True)
class Keep:
    tenant: Tenant
    key: StorageKey
    model_tag: ModelTag
    payload: Payload
    generation: int  # the DeleteLog's before the block was read


class Sharing:
    def __init__(self, tier: ClusterParts) -> None:
        self._tier = tier
        self._local: LocalCopies | None = None
        self._cond = threading.Condition()
        self._queue: deque[_Share] = deque()
        self._queued: set[StorageKey] = set()
        self._queued_bytes = 0
        self._busy = False
        self._touches: dict[Tenant, dict[StorageKey, None]] = {}
        self._promote_cond = threading.Condition()
        self._promotions: deque[Keep] = deque()
        self._promote_bytes = 0
        self._recent: OrderedDict[StorageKey, None] = OrderedDict()
        self._recent_lock = threading.Lock()
        self._stopping = False
        self._threads: list[threading.Thread] = []

    def start(self, local: LocalCopies) -> None:
        self._local = local
        for target, name in ((self._write_loop, "writer"), (self._promote_loop, "keeper")):
            thread = threading.Thread(target=target, name=f"kvshare-cluster-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        with self._promote_cond:
            self._promote_cond.notify_all()
        for thread in self._threads:
            thread.join(timeout=30)

    # -- what others hand in -----------------------------------------------------------

    def enqueue(
        self,
        tenant: Tenant,
        key: StorageKey,
        model_tag: ModelTag,
        payload: bytes | bytearray | None,
    ) -> bool:
        """Queue a block to be written to the cluster; whether it was taken on (False:
        in the cluster or queued already, or dropped because the queue is full)."""
        if self.is_shared(key):
            return False
        size = len(payload) if payload is not None else 0
        with self._cond:
            if key in self._queued:  # acknowledged, and now drained to LMDB: once is enough
                return False
            full = len(self._queue) >= MAX_QUEUED_BLOCKS or (
                self._queued_bytes + size > self._tier.config.write_queue_bytes
            )
            if not full:
                generation = self._tier.deletes.generation
                self._queue.append(_Share(tenant, key, model_tag, payload, generation))
                self._queued.add(key)
                self._queued_bytes += size
                self._cond.notify()
        if full:
            self._tier.count(dropped=1)
        return not full

    def touch(self, tenant: Tenant, keys: Sequence[StorageKey]) -> None:
        if keys:
            with self._cond:
                self._touches.setdefault(tenant, {}).update(dict.fromkeys(keys))

    def promote(self, kept: Keep) -> None:
        """Keep a block read from the cluster in the local tiers (dropped when the
        queue is full: the block was served, only not kept)."""
        with self._promote_cond:
            if self._promote_bytes + len(kept.payload) > PROMOTE_QUEUE_BYTES:
                return
            self._promotions.append(kept)
            self._promote_bytes += len(kept.payload)
            self._promote_cond.notify()

    def mark_shared(self, keys: Sequence[StorageKey]) -> None:
        with self._recent_lock:
            for key in keys:
                self._recent[key] = None
                self._recent.move_to_end(key)
            while len(self._recent) > RECENT_KEYS:
                self._recent.popitem(last=False)

    def is_shared(self, key: StorageKey) -> bool:
        with self._recent_lock:
            return key in self._recent

    def pending(self) -> set[StorageKey]:
        with self._cond:
            return set(self._queued)

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every queued write and touch is done (tests, benchmarks)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            self._cond.notify_all()
            while self._queue or self._busy or self._touches:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.05))
        with self._promote_cond:
            while self._promotions:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._promote_cond.wait(min(left, 0.05))
        return True

    # -- the writer thread --------------------------------------------------------------

    def _write_loop(self) -> None:
        next_touch = time.monotonic() + TOUCH_EVERY_S
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()
                while not self._stopping and not self._queue and not self._touches:
                    self._cond.wait()
                if self._stopping:
                    return
                if not self._queue:
                    self._cond.wait(max(0.0, next_touch - time.monotonic()))
                batch = self._take_batch()
                touches = {}
                if time.monotonic() >= next_touch or not batch:
                    touches, self._touches = self._touches, {}
                    next_touch = time.monotonic() + TOUCH_EVERY_S
                self._busy = bool(batch or touches)
            try:
                if batch:
                    self._write(batch)
                if touches:
                    self._tier.accounting.touch({t: list(k) for t, k in touches.items()})
            except Exception:  # a bug here must not stop sharing; the blocks stay local
                log.exception("writing to the Redis Cluster failed")
                self._tier.count(dropped=len(batch))

    def _take_batch(self) -> list[_Share]:
        batch: list[_Share] = []
        size = 0
        while self._queue and len(batch) < BATCH_BLOCKS and size < BATCH_BYTES:
            item = self._queue.popleft()
            self._queued.discard(item.key)
            held = len(item.payload) if item.payload is not None else 0
            self._queued_bytes -= held
            size += held
            batch.append(item)
        return batch

    def _write(self, batch: list[_Share]) -> None:
        """Bytes first, then the listing: a block is listed (and so can be evicted) only
        once its bytes are in Redis, so whoever evicts it deletes bytes that are there.
        Listing first let an eviction (by this batch's later admissions or another
        server's) delete a key not yet written, whose write then left it in Redis out of
        every quota, for good."""
        tier, local = self._tier, self._local
        if not tier.nodes.is_connected or local is None:
            tier.count(dropped=len(batch))
            return
        ready: list[tuple[_Share, Payload]] = []
        for item in batch:
            payload = item.payload if item.payload is not None else local.local_copy(item.key)
            if payload is not None:  # else: deleted or evicted here meanwhile
                ready.append((item, payload))
        names = [tier.keys.block(item.key) for item, _ in ready]
        present = tier.nodes.run([(n, ("EXISTS", n)) for n in names])
        missing = [i for i, answer in enumerate(present) if answer == 0]
        tier.count(dropped=sum(isinstance(answer, Failed) for answer in present))
        stored = dict.fromkeys((i for i, a in enumerate(present) if a == 1), False)
        tier.accounting.mark_writing([(ready[i][0].tenant, ready[i][0].key) for i in missing])
        for i, answer in zip(missing, self._set([ready[i] for i in missing]), strict=True):
            if answer is not None:
                stored[i] = answer  # True: written by this server; False: by another
        admitted = [ready[i] for i in stored]
        listings = tier.accounting.admit([(i.tenant, i.key, len(p)) for i, p in admitted])
        undo: list[StorageKey] = []
        for (item, payload), ours, listing in zip(admitted, stored.values(), listings, strict=True):
            if isinstance(listing, Failed) or listing.refused:
                tier.count(dropped=1)
                if ours:  # out of the quota's reach: take the bytes back out
                    undo.append(item.key)
                continue
            self._evict(item.tenant, listing)
            if ours:
                tier.count(written=1, written_bytes=len(payload))
            self.mark_shared([item.key])
            if tier.deletes.deleted_since(
                item.generation, item.tenant.tag, item.key, item.model_tag
            ):
                undo.append(item.key)  # deleted while it was being written: again
        if undo:
            tier.erasure.delete_blocks(undo)

    def _evict(self, tenant: Tenant, listing: QuotaListing) -> None:
        if not listing.victims:
            return
        tier = self._tier
        names = [tier.keys.block(key) for key in listing.victims]
        answers = tier.nodes.run([(n, ("DEL", n)) for n in names])
        tier.count(evicted=len(listing.victims))
        if not any(isinstance(a, Failed) for a in answers):
            tier.accounting.forget_doomed(tenant, listing.victims)

    def _set(self, writes: list[tuple[_Share, Payload]]) -> list[bool | None]:
        """`SET NX` each block's value: True (written), False (another server's copy
        was there first), or None (not written: its node failed; counted as dropped)."""
        tier = self._tier
        commands = []
        for item, payload in writes:
            name = tier.keys.block(item.key)
            tenant = item.tenant
            header = pack_header(tier.mac, name, tenant.tag, tenant.epoch, item.model_tag, payload)
            commands.append((name, ("SET", name, b"".join((header, payload)), "NX")))
        out: list[bool | None] = []
        for answer in tier.nodes.run(commands):
            if isinstance(answer, Failed):
                tier.count(dropped=1)
                out.append(None)
            else:
                out.append(answer is not None)
        return out

    # -- the keeper thread --------------------------------------------------------------

    def _promote_loop(self) -> None:
        while True:
            with self._promote_cond:
                while not self._stopping and not self._promotions:
                    self._promote_cond.wait()
                if self._stopping:
                    return
                kept = self._promotions[0]
            try:
                self._keep(kept)
            except Exception:
                log.exception("keeping a block read from the Redis Cluster failed")
            with self._promote_cond:
                self._promotions.popleft()
                self._promote_bytes -= len(kept.payload)
                self._promote_cond.notify_all()

    def _keep(self, kept: Keep) -> None:
        local, tier = self._local, self._tier
        assert local is not None
        tenant, key, model_tag = kept.tenant, kept.key, kept.model_tag
        stored = True  # still on its way into LMDB after 30 s: kept, all the same
        try:
            future = local.keep_copy(tenant.id, key, model_tag, BytesSource(kept.payload))
            with contextlib.suppress(concurrent.futures.TimeoutError):
                stored = future.result(timeout=30)
        except KvshareError:  # no room here (quota, backlog): served, not kept
            return
        # Not stored: held here already (a read of it before this one was kept first,
        # or a put through this server); counted once, when a copy is made.
        if stored:
            tier.count(promoted=1)
        if tier.deletes.deleted_since(kept.generation, tenant.tag, key, model_tag):
            local.forget_local([key])
