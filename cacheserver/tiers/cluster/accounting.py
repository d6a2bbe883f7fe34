"""Per-tenant accounting in the cluster: quotas and least-recently-used order that hold
across every server.

Each tenant's accounting lives in its own hash slot (`layout`), changed only by the
scripts there, so each change is atomic on one node whichever server makes it:

- `admit` lists a block once its bytes are written (so an eviction always finds the
  bytes it deletes), and, when that takes the tenant
  over its quota, takes its least recently used blocks out of the list in the same
  step (the caller then deletes their keys). The list's total never exceeds the quota.
- `touch` moves blocks to the recent end as any server reads them.
- `release` stops listing deleted blocks; `take` empties an epoch, oldest first
  (whole-tenant deletes, retired epochs); `sweep` finds evicted blocks whose keys a
  crashed server never deleted, and blocks a crashed server wrote and never admitted
  (`mark_writing` notes each write before it begins).

What is exact and what is not (docs/scale-out.md): the list and its total are exact at
every instant; the bytes in Redis may exceed the quota while a batch is written and not
yet admitted, and while evicted keys wait for their DEL (one round trip after the
admission that evicted them); blocks written around a node's loss can be listed without
bytes (harmless: they count until evicted) or held without being listed until swept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from cacheserver.tiers.cluster import layout
from cacheserver.tiers.cluster.layout import Keys, TenantKeys
from cacheserver.tiers.cluster.nodes import ClusterNodes, Failed
from policy.types import StorageKey, TenantId

TAKE_BATCH = 512
# A block written this long ago and never admitted was left by a server that stopped
# between the two: `sweep` deletes it. Far above any write's duration: a slower one
# only loses its block (a miss), never a quota.
UNADMITTED_AGE_S = 60


@dataclass(frozen=True, slots=True)
class Tenant:
    """What this server knows of a tenant (its config; the same on every server)."""

    id: TenantId
    tag: bytes  # policy.naming.cluster_tag
    epoch: int
    quota_bytes: int  # 0: no quota (bounded by the cluster's memory)


@dataclass(frozen=True, slots=True)
class QuotaListing:
    """What `Accounting.admit` made of one block in its tenant's quota list."""

    listed: bool  # True: newly listed (write it); False: listed already, or refused
    refused: bool  # larger than the quota on its own
    victims: tuple[StorageKey, ...] = ()


class Accounting:
    def __init__(self, nodes: ClusterNodes, keys: Keys) -> None:
        self._nodes = nodes
        self._keys = keys
        self._admit = nodes.register(layout.ADMIT)
        self._release = nodes.register(layout.RELEASE)
        self._touch = nodes.register(layout.TOUCH)
        self._take = nodes.register(layout.TAKE)
        self._sweep = nodes.register(layout.SWEEP)
        self._writing = nodes.register(layout.WRITING)

    def _of(self, tenant: Tenant) -> TenantKeys:
        return self._keys.tenant(tenant.tag)

    def admit(
        self, blocks: Sequence[tuple[Tenant, StorageKey, int]]
    ) -> list[QuotaListing | Failed]:
        """List each (tenant, key, size), evicting as the quota requires: one script
        per block, pipelined per node."""
        commands = []
        for tenant, key, size in blocks:
            t = self._of(tenant)
            names = [*t.of_epoch(tenant.epoch), t.clock, t.epochs, t.doomed, t.writing]
            args = (key, size, tenant.quota_bytes, tenant.epoch)
            commands.append((t.base, ("EVALSHA", self._admit, len(names), *names, *args)))
        out: list[QuotaListing | Failed] = []
        for answer in self._nodes.run(commands):
            if isinstance(answer, Failed):
                out.append(answer)
                continue
            status = int(answer[0])
            victims = tuple(StorageKey(bytes(v)) for v in answer[1:])
            out.append(QuotaListing(status == 1, status < 0, victims))
        return out

    def mark_writing(self, blocks: Sequence[tuple[Tenant, StorageKey]]) -> None:
        """Note that these blocks' bytes are about to be written (before their
        admission): if this server stops in between, `sweep` finds them."""
        by_tenant: dict[Tenant, list[StorageKey]] = {}
        for tenant, key in blocks:
            by_tenant.setdefault(tenant, []).append(key)
        commands = []
        for tenant, keys in by_tenant.items():
            t = self._of(tenant)
            commands.append((t.base, ("EVALSHA", self._writing, 1, t.writing, *keys)))
        self._nodes.run(commands)

    def forget_doomed(self, tenant: Tenant, victims: Sequence[StorageKey]) -> None:
        """The victims' keys are deleted: they need no sweep."""
        t = self._of(tenant)
        self._nodes.call(t.base, "SREM", t.doomed, *victims)

    def release(self, tenant_tag: bytes, epoch: int, blocks: Sequence[StorageKey]) -> Failed | int:
        t = self._keys.tenant(tenant_tag)
        names = t.of_epoch(epoch)
        answer = self._nodes.call(t.base, "EVALSHA", self._release, len(names), *names, *blocks)
        return answer if isinstance(answer, Failed) else int(answer)

    def touch(self, touched: dict[Tenant, list[StorageKey]]) -> None:
        """Mark blocks used now, in order (best effort: a lost touch only ages a block)."""
        commands = []
        for tenant, blocks in touched.items():
            t = self._of(tenant)
            names = [t.lru(tenant.epoch), t.clock]
            commands.append((t.base, ("EVALSHA", self._touch, 2, *names, *blocks)))
        self._nodes.run(commands)

    def epochs(self, tenant: Tenant) -> set[int] | Failed:
        t = self._of(tenant)
        answer = self._nodes.call(t.base, "SMEMBERS", t.epochs)
        if isinstance(answer, Failed):
            return answer
        return {int(e) for e in answer} | {tenant.epoch}

    def take(self, tenant: Tenant, epoch: int) -> list[StorageKey] | Failed:
        """Up to TAKE_BATCH of the epoch's blocks, oldest first, no longer listed; []
        once the epoch is empty (its keys are then gone)."""
        t = self._of(tenant)
        names = [*t.of_epoch(epoch), t.epochs]
        answer = self._nodes.call(
            t.base, "EVALSHA", self._take, len(names), *names, TAKE_BATCH, epoch
        )
        if isinstance(answer, Failed):
            return answer
        return [StorageKey(bytes(block)) for block in answer]

    def listed(self, tenant: Tenant, epoch: int) -> list[StorageKey] | Failed:
        """Every block listed for the epoch (for a model's delete, which reads headers)."""
        t = self._of(tenant)
        answer = self._nodes.call(t.base, "ZRANGE", t.lru(epoch), 0, -1)
        if isinstance(answer, Failed):
            return answer
        return [StorageKey(bytes(block)) for block in answer]

    def sweep(
        self, tenant: Tenant, count: int = TAKE_BATCH, age_s: int = UNADMITTED_AGE_S
    ) -> list[StorageKey]:
        """Blocks whose keys may be in Redis unlisted (evicted and not deleted, or
        written and never admitted): the caller deletes them."""
        t = self._of(tenant)
        names = [t.doomed, t.lru(tenant.epoch), t.writing]
        answer = self._nodes.call(t.base, "EVALSHA", self._sweep, 3, *names, count, age_s)
        return [] if isinstance(answer, Failed) else [StorageKey(bytes(b)) for b in answer]

    def usage(self, tenant: Tenant) -> tuple[int, int] | Failed:
        """(blocks, bytes) listed for the tenant's current epoch."""
        t = self._of(tenant)
        answers = self._nodes.run(
            [
                (t.base, ("ZCARD", t.lru(tenant.epoch))),
                (t.base, ("GET", t.used(tenant.epoch))),
            ]
        )
        for answer in answers:
            if isinstance(answer, Failed):
                return answer
        return int(answers[0]), int(answers[1] or 0)
