"""`ClusterTier`: the Redis Cluster as the store's shared tier (a `SharedTier`; its
capabilities: `SHARED`, `QUEUED_WRITES`, `OWN_HEALTH`).

Several `kvshare serve` processes with the same tenants, principals and `secret_file`
name a block the same, so they find each other's blocks here. Each keeps its memory
tier and LMDB as a local cache in front: blocks are immutable and keyed, so a local
copy is never stale, only possibly deleted — which the delete stream settles
(`deletes`, `follower`).

Invariants:
- The cluster never fails a request: a node that is down, slow or wrong answers a miss
  (reads, lookups), drops a write (the block stays local, counted), and only a delete
  that could not reach the cluster or the other servers is an error (UNAVAILABLE: the
  caller retries; nothing acknowledged is undone).
- A block is served (or kept locally) only when its header names the asking tenant
  (by its keyed tag) and its MAC, keyed by the servers' secret over the key name, the
  header and the payload, checks; anything else is a miss, counted as an integrity
  failure (a value of an older format: a plain miss), and its key deleted.
- A delete reaches the cluster and the delete stream before it is acknowledged, and
  every copy this server was making of a deleted block meanwhile is undone (`DeleteLog`).
- Quotas hold across servers (`accounting`); eviction there never touches another
  tenant's blocks.
- A fixed-order namespace (`fixed_order`: the public scope) is left as its puts made
  it: its reads and lookups neither touch its order in the cluster nor keep local
  copies, so no server's tiers or the cluster's eviction order say who read what
  (docs/isolation.md, public scope).

Threads: calls come from executor threads and the store's writer; `sharing` writes to
the cluster and keeps copies on its own threads; `follower` applies others' deletes and
does the upkeep. None of it runs under the store's lock. Those threads get the tier's
parts (`parts.ClusterParts`: connection, naming, accounting, delete log, counts), never
the tier, so the imports run one way: tier -> follower -> sharing -> parts.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence
from pathlib import Path

from cacheserver.tiers import Capability, LocalCopies, Payload, PendingWrite
from cacheserver.tiers.cluster.accounting import Tenant
from cacheserver.tiers.cluster.config import RedisClusterConfig
from cacheserver.tiers.cluster.deletes import DeleteEntry
from cacheserver.tiers.cluster.follower import Follower, announce
from cacheserver.tiers.cluster.layout import is_old_format, open_value, unpack_header
from cacheserver.tiers.cluster.nodes import Failed
from cacheserver.tiers.cluster.parts import ClusterParts
from cacheserver.tiers.cluster.replies import OVER_BUDGET as OVER_BUDGET_REASON
from cacheserver.tiers.cluster.sharing import Keep, Sharing
from kvcommon.errors import Unavailable
from policy import AccessPolicy
from policy.shared_values import ValueMac
from policy.types import PUBLIC, ModelTag, StorageKey, TenantId

log = logging.getLogger(__name__)
FIRST_READ_WINDOW = 2  # blocks asked at once before their size is known
FIRST_LOOKUP_WINDOW = 32
OVER_BUDGET = Failed(OVER_BUDGET_REASON)  # `_read`'s answer for a value read past


class ClusterTier(ClusterParts):
    name = "redis_cluster"
    # Puts are acknowledged locally and written here behind them (QUEUED_WRITES); the
    # server keeps serving its local tiers while the cluster is down (OWN_HEALTH).
    capabilities = Capability.SHARED | Capability.QUEUED_WRITES | Capability.OWN_HEALTH

    def __init__(
        self,
        config: RedisClusterConfig,
        tenants: Iterable[Tenant],
        data_dir: Path,
        max_block_bytes: int,
        mac: ValueMac,
        fixed_order: frozenset[TenantId] = frozenset(),
    ) -> None:
        super().__init__(config, tenants, data_dir, max_block_bytes, mac)
        self.fixed_order = fixed_order
        self.sharing = Sharing(self)
        self._local: LocalCopies | None = None
        self._follower: Follower | None = None

    # -- lifecycle --------------------------------------------------------------------

    def start(self, local: LocalCopies) -> None:
        """Connect (or keep trying in the background), catch up with deletes made while
        this server was away, and start the threads. Called once the store exists."""
        self._local = local
        follower = Follower(self, local, self.sharing)
        self._follower = follower
        follower.catch_up()
        self.sharing.start(local)
        follower.start()

    def probe(self) -> str | None:
        """Why the cluster (or part of it) cannot be used now, or None. Blocking.

        Its own health (`Capability.OWN_HEALTH`): the store never refuses a put for it,
        since puts are local first; the server publishes it as a service of its own."""
        return self.nodes.problem()

    # -- reads ------------------------------------------------------------------------

    def count_leading(self, tenant: TenantId, keys: Sequence[StorageKey], local: int) -> int:
        known = self.tenants.get(tenant)
        if known is None:
            return 0
        self._touch(known, keys[:local])
        rest = keys[local:]
        present, window = 0, FIRST_LOOKUP_WINDOW
        while present < len(rest):  # windows that double: a long miss tail costs little
            names = [self.keys.block(key) for key in rest[present : present + window]]
            for answer in self.nodes.run([(name, ("EXISTS", name)) for name in names]):
                if answer != 1:
                    self.count(misses=1, failures=int(isinstance(answer, Failed)))
                    self._touch(known, rest[:present])
                    return present
                present += 1
            window *= 2
        self._touch(known, rest)
        return present

    def _touch(self, tenant: Tenant, keys: Sequence[StorageKey]) -> None:
        """Blocks used here move to the recent end of their tenant's order in the
        cluster; a fixed-order namespace's stay where their puts left them."""
        if tenant.id not in self.fixed_order:
            self.sharing.touch(tenant, keys)

    def read_leading(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        known = self.tenants.get(tenant)
        if known is None or not keys:
            return [], False
        generation = self.deletes.generation
        out: list[tuple[memoryview, ModelTag]] = []
        total, largest, start, window = 0, 1, 0, FIRST_READ_WINDOW
        while start < len(keys):
            batch = keys[start : start + window]
            for found in self._read(known, batch, max_bytes - total):
                if isinstance(found, Failed):  # OVER_BUDGET: spent on blocks after this one
                    return self._served(known, keys, out, generation), True
                if found is None:
                    return self._served(known, keys, out, generation), False
                out.append(found)
                total += len(found[0])
                largest = max(largest, len(found[0]))
                if total >= max_bytes:
                    more = len(out) < len(keys)
                    return self._served(known, keys, out, generation), more
            start += len(batch)
            # Sized by the largest block yet, so blocks like those fit the budget; larger
            # ones than announced are read past by `_read`, never taken in.
            window = max(1, min(64, (max_bytes - total) // largest))
        return self._served(known, keys, out, generation), False

    def _served(
        self,
        tenant: Tenant,
        keys: Sequence[StorageKey],
        found: list[tuple[memoryview, ModelTag]],
        generation: int,
    ) -> list[Payload]:
        served = keys[: len(found)]
        self._touch(tenant, served)
        self.sharing.mark_shared(served)
        # A fixed-order namespace is never kept from a read: which of its blocks this
        # server holds (and so how fast it serves them) depends on what was put here,
        # never on who read what through it. Every read of one it does not hold costs
        # the same round trip to the cluster.
        if self.config.local_copies and tenant.id not in self.fixed_order:
            for key, (payload, model_tag) in zip(served, found, strict=True):
                self.sharing.promote(Keep(tenant, key, model_tag, payload, generation))
        return [payload for payload, _ in found]

    def _read(
        self, tenant: Tenant, keys: Sequence[StorageKey], budget_bytes: int
    ) -> list[tuple[memoryview, ModelTag] | Failed | None]:
        """Each block's payload (a view of the value) and model tag, None (a miss), or
        OVER_BUDGET: `budget_bytes` went to other values of this read first, so it was
        read past, not taken in. The budget, not what the first blocks' sizes promise,
        bounds what a read holds: at most `budget_bytes` + one value. The first key's
        node is read first, its value first, so the first block is never read past."""
        names = [self.keys.block(key) for key in keys]
        out: list[tuple[memoryview, ModelTag] | Failed | None] = []
        corrupt, old = [], []
        values = self.nodes.get(names, self.max_value_bytes, budget_bytes)
        for name, raw in zip(names, values, strict=True):
            if isinstance(raw, Failed) and raw.reason == OVER_BUDGET_REASON:
                out.append(OVER_BUDGET)
                continue
            if raw is None or isinstance(raw, Failed):
                self.count(misses=1, failures=int(isinstance(raw, Failed)))
                out.append(None)
                continue
            opened = open_value(self.mac, name, raw, tenant.tag)
            if opened is not None:
                self.count(hits=1, hit_bytes=len(opened[0]))
            elif is_old_format(raw):
                old.append(name)
            else:
                corrupt.append(name)
            out.append(opened)
        if old:  # an older server's format: a miss, and room for a put to write it again
            self.count(misses=len(old))
            self.nodes.run([(name, ("DEL", name)) for name in old])
        if corrupt:
            self._drop_corrupt(corrupt)
        return out

    def _drop_corrupt(self, names: list[bytes]) -> None:
        """Torn, corrupt, moved or forged values: misses from now on (a put writes them
        again). The log says how many, never which: key names are keyed, but still
        nothing an operator's log needs."""
        self.count(integrity_failures=len(names))
        log.warning("%d block(s) in the Redis Cluster failed their check; deleted", len(names))
        self.nodes.run([(name, ("DEL", name)) for name in names])

    def read_many(self, keys: Sequence[StorageKey]) -> list[Payload | None]:
        """Indexed blocks LMDB could not return (a corrupt local copy): any tenant's."""
        out: list[Payload | None] = []
        names = [self.keys.block(key) for key in keys]
        for name, raw in zip(names, self.nodes.get(names, self.max_value_bytes), strict=True):
            opened = None
            if isinstance(raw, bytearray) and (header := unpack_header(raw)) is not None:
                owner = self.by_tag.get(header.tenant_tag)
                if owner is not None:
                    opened = open_value(self.mac, name, raw, owner.tag)
            out.append(opened[0] if opened is not None else None)
        return out

    # -- writes -----------------------------------------------------------------------

    def share(self, tenant: TenantId, key: StorageKey, model_tag: ModelTag) -> None:
        known = self.tenants.get(tenant)
        if known is not None:
            self.sharing.enqueue(known, key, model_tag, None)

    def write(self, writes: Sequence[PendingWrite], deletes: Sequence[StorageKey]) -> list[bool]:
        """Blocks LMDB just committed: queued for the cluster (`Capability.QUEUED_WRITES`).
        Per write, whether it was taken on: False for a tenant the cluster does not
        serve, a block in the cluster or queued already, or a full queue (counted as
        dropped). What lands, or is dropped later (the cluster unreachable, a tenant's
        quota), is in `counts`. `deletes` are deleted first, as `delete` does."""
        if deletes:
            self.delete(deletes)
        taken = []
        for w in writes:
            known = self.tenants.get(w.tenant)
            stable = w.payload if isinstance(w.payload, bytes | bytearray) else None
            taken.append(
                known is not None and self.sharing.enqueue(known, w.key, w.model_tag, stable)
            )
        return taken

    # -- deletes ----------------------------------------------------------------------

    def delete(self, keys: Sequence[StorageKey]) -> int:
        return len(self._delete(keys, announce_always=False))

    def delete_held(self, keys: Sequence[StorageKey]) -> set[StorageKey]:
        return self._delete(keys, announce_always=True)

    def _delete(self, keys: Sequence[StorageKey], *, announce_always: bool) -> set[StorageKey]:
        if not keys:
            return set()
        self.deletes.record(DeleteEntry(keys=frozenset(keys)))
        held, complete = self.erasure.delete_blocks(keys)
        if held or announce_always:
            complete = announce(self, [DeleteEntry(keys=frozenset(keys))]) and complete
        if self._local is not None:
            self._local.forget_local(keys)  # copies kept while the delete ran
        if not complete:
            raise Unavailable(
                "the delete reached this server but not all of the Redis Cluster or the "
                "other servers (a node did not answer); retry it"
            )
        return held

    def delete_namespace(self, tenant: TenantId, model_tag: ModelTag | None) -> set[StorageKey]:
        known = self.tenants.get(tenant)
        if known is None:
            return set()
        entry = DeleteEntry(tenant_tag=known.tag, model_tag=model_tag or b"")
        self.deletes.record(entry)
        held, complete = self.erasure.delete_tenant_blocks(known, model_tag)
        complete = announce(self, [entry]) and complete
        if self._local is not None:
            self._local.forget_local(namespace=(tenant, model_tag))
        if not complete:
            raise Unavailable(
                "the namespace delete did not reach all of the Redis Cluster or the other "
                "servers (a node did not answer); retry it"
            )
        return held

    def stop(self) -> None:
        """Stop the threads (before the store closes: they read from it). Idempotent."""
        follower, self._follower = self._follower, None
        if follower is not None:
            follower.stop()
        self.sharing.stop()

    def close(self) -> None:
        self.stop()
        self.nodes.close()


def open_cluster_tier(
    config: RedisClusterConfig, policy: AccessPolicy, data_dir: Path, max_block_bytes: int
) -> ClusterTier:
    """The tier for this server's tenants (from its config: the same on every server).
    Reads the password file now (a bad one stops the start-up); connects in `start`."""
    tenants = [
        Tenant(tenant, policy.cluster_tag(tenant), policy.epoch(tenant), quota)
        for tenant, quota in policy.quotas_bytes.items()
    ]
    fixed_order = frozenset({PUBLIC}) if policy.has_public else frozenset()
    return ClusterTier(
        config, tenants, data_dir, max_block_bytes, policy.shared_value_mac(), fixed_order
    )
