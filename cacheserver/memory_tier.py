"""The hot tier: a byte-bounded LRU of payloads in process memory.

Inclusive of the LMDB tier: every block here is also on disk, so dropping one loses
nothing. Per-tenant quotas (scaled from the disk quotas by the store) give it the same
eviction rule as the disk tier. Not thread-safe by itself; the store calls it under
its lock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeAlias

from cacheserver.index import BlockIndex, NoRoom
from policy.types import StorageKey, TenantId

# A block's bytes as the store holds them: bytes from gRPC, the receive buffer itself
# (bytearray, never written again) from the bulk channel, so neither path copies.
Payload: TypeAlias = bytes | bytearray


class MemoryTier:
    def __init__(
        self, budget_bytes: int, quotas_bytes: Mapping[TenantId, int] | None = None
    ) -> None:
        self._index = BlockIndex(budget_bytes, quotas_bytes)
        self._payloads: dict[StorageKey, Payload] = {}

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

    def admit(self, key: StorageKey, tenant: TenantId, payload: Payload) -> None:
        """Keep `payload` hot, evicting least recently used blocks; skip it if it cannot fit."""
        if key in self._payloads:
            self._index.touch(key)
            return
        try:
            victims = self._index.victims_for(tenant, len(payload))
        except NoRoom:
            return  # larger than the whole tier: serve it from disk only
        for victim in victims:
            self.drop(victim)
        self._index.add(key, tenant, len(payload))
        self._payloads[key] = payload

    def drop(self, key: StorageKey) -> None:
        if self._payloads.pop(key, None) is not None:
            self._index.remove(key)
