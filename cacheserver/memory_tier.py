"""The hot tier: a byte-bounded LRU of payloads in process memory.

Inclusive of the LMDB tier: every block here is also on disk, so dropping one loses
nothing. Per-tenant quotas (scaled from the disk quotas by the store) give it the same
eviction rule as the disk tier. Not thread-safe by itself; the store calls it under
its lock.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeAlias

from cacheserver.index import BlockIndex, EvictReason, NoRoom
from cacheserver.tiers import Payload
from policy.types import StorageKey, TenantId

OnEvict: TypeAlias = Callable[[EvictReason, int], None]  # (reason, bytes) per block evicted


class MemoryTier:
    def __init__(
        self,
        budget_bytes: int,
        quotas_bytes: Mapping[TenantId, int] | None = None,
        on_evict: OnEvict | None = None,
    ) -> None:
        self._index = BlockIndex(budget_bytes, quotas_bytes)
        self._payloads: dict[StorageKey, Payload] = {}
        self._on_evict = on_evict

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

    def drop(self, key: StorageKey) -> None:
        if self._payloads.pop(key, None) is not None:
            self._index.remove(key)
