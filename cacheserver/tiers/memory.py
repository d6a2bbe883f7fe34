"""The hot tier: a byte-bounded LRU of payloads in process memory (a `Tier`,
`Capability.IN_PROCESS`).

Invariant: inclusive of the tiers below. Every block here is also in LMDB or in the put
journal, so dropping one loses nothing, and the tier never holds more than its budget.
Per-tenant quotas (scaled from the disk quotas by the store, `memory_quotas`) give it
the same eviction rule as the disk tier: a flooding tenant evicts its own hot blocks.
Not thread-safe by itself; the store calls it under its lock (it never blocks).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

from cacheserver.events import EvictReason
from cacheserver.tiers import Capability, LocalCopies, Payload, PendingWrite
from cacheserver.tiers.index import BlockIndex, NoRoom
from policy.types import StorageKey, TenantId

OnEvict: TypeAlias = Callable[[EvictReason, int], None]  # (reason, bytes) per block evicted


class MemoryTier:
    name = "memory"
    capabilities = Capability.IN_PROCESS

    def __init__(
        self,
        budget_bytes: int,
        quotas_bytes: Mapping[TenantId, int] | None = None,
        on_evict: OnEvict | None = None,
        fixed_order: frozenset[TenantId] = frozenset(),
    ) -> None:
        """`fixed_order`: namespaces whose blocks a read neither reorders nor promotes
        (BlockIndex); the store admits them here only when they are put (and at
        start-up), and keeps them here within their share: the public scope is pinned,
        so how fast a published block is served never depends on who read what."""
        self._index = BlockIndex(budget_bytes, quotas_bytes, fixed_order)
        self._payloads: dict[StorageKey, Payload] = {}
        self._on_evict = on_evict

    @property
    def fixed_order(self) -> frozenset[TenantId]:
        return self._index.fixed_order

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def budget_bytes(self) -> int:
        return self._index.budget_bytes

    def __len__(self) -> int:
        return len(self._payloads)

    def get(self, key: StorageKey) -> Payload | None:
        payload = self._payloads.get(key)
        if payload is not None:
            self._index.touch(key)
        return payload

    def admit(self, key: StorageKey, tenant: TenantId, payload: Payload) -> bool:
        """Keep `payload` hot, evicting least recently used blocks; skip it if it cannot fit.

        True when the block was newly admitted."""
        if key in self._payloads:
            self._index.touch(key)
            return False
        try:
            if tenant in self.fixed_order:  # pinned: its share is reserved
                victims = self._index.victims_reserved(tenant, len(payload))
            else:
                victims = self._index.victims_with_reasons(tenant, len(payload))
        except NoRoom:
            return False  # larger than the whole tier: serve it from disk only
        for victim, reason in victims.items():
            dropped = self._payloads.get(victim)
            self.drop(victim)
            if dropped is not None and self._on_evict is not None:
                self._on_evict(reason, len(dropped))
        self._index.add(key, tenant, len(payload))
        self._payloads[key] = payload
        return True

    def set_quotas(self, quotas_bytes: Mapping[TenantId, int]) -> None:
        """New per-tenant quotas (a live config reload; the store's lock held): a block
        put from now on evicts by them."""
        self._index.quotas_bytes = dict(quotas_bytes)

    def drop(self, key: StorageKey) -> None:
        if self._payloads.pop(key, None) is not None:
            self._index.remove(key)

    def holds(self, key: StorageKey, payload: Payload) -> bool:
        """Whether `key` is held as this very `payload` object (not touched)."""
        return self._payloads.get(key) is payload

    def replace(self, key: StorageKey, old: Payload, new: Payload) -> bool:
        """Hold `new` for `key` where it still holds `old` (the same bytes, another
        buffer: a copy of a journal record's view), keeping its place in the order."""
        if self._payloads.get(key) is not old:
            return False
        self._payloads[key] = new
        return True

    # -- the Tier protocol (cacheserver.tiers) ---------------------------------------

    # `get`, `admit` and `drop` above are the same verbs for one block, without the
    # lists: the store's hot paths (a read of blocks in memory) use them.

    def read_many(self, keys: Sequence[StorageKey]) -> list[Payload | None]:
        """The payloads held of `keys` (None where not), each touched as used."""
        return [self.get(key) for key in keys]

    def write(self, writes: Sequence[PendingWrite], deletes: Sequence[StorageKey]) -> list[bool]:
        """Drop `deletes`, then keep each write hot (`admit`): True where it was newly
        admitted, False where it was held already or cannot fit."""
        self.delete(deletes)
        return [self.admit(w.key, w.tenant, w.payload) for w in writes]

    def delete(self, keys: Sequence[StorageKey]) -> int:
        held = 0
        for key in keys:
            held += key in self._payloads
            self.drop(key)
        return held

    def probe(self) -> str | None:
        """None: a full memory tier evicts, it never refuses."""
        return None

    def start(self, local: LocalCopies) -> None:
        """Nothing runs on threads of its own."""

    def stop(self) -> None:
        """Nothing runs on threads of its own."""

    def close(self) -> None:
        """Let go of every payload (views of journal records among them)."""
        for key in list(self._payloads):
            self.drop(key)

    def counts(self) -> dict[str, int]:
        return {"blocks": len(self), "bytes": self.used_bytes, "budget_bytes": self.budget_bytes}


def memory_quotas(
    quotas_bytes: Mapping[TenantId, int],
    memory_budget_bytes: int,
    disk_budget_bytes: int,
    fixed_order: frozenset[TenantId] = frozenset(),
) -> dict[TenantId, int]:
    """Each tenant's quota scaled to the memory tier, so the hot tier follows the same
    rule as the disk tier: a flooding tenant evicts its own hot blocks, not others'.

    A fixed-order namespace (the public scope) keeps its whole quota here, up to half
    the tier: a read never promotes it (BlockIndex), so only what fits at put time is
    ever hot, and the more of it fits, the fewer of its reads wait on the disk."""
    if disk_budget_bytes <= 0:
        return {}
    return {
        tenant: (
            min(quota, max(1, memory_budget_bytes // 2))
            if tenant in fixed_order
            else max(1, quota * memory_budget_bytes // disk_budget_bytes)
        )
        for tenant, quota in quotas_bytes.items()
        if quota
    }
