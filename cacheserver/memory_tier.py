"""The hot tier: a byte-bounded LRU of payloads in process memory.

Inclusive of the LMDB tier: every block here is also on disk, so dropping one loses
nothing. Not thread-safe by itself; the store calls it under its lock.
"""

from __future__ import annotations

from cacheserver.index import BlockIndex, NoRoom
from policy.types import StorageKey, TenantId


class MemoryTier:
    def __init__(self, budget_bytes: int) -> None:
        self._index = BlockIndex(budget_bytes)
        self._payloads: dict[StorageKey, bytes] = {}

    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    @property
    def budget_bytes(self) -> int:
        return self._index.budget_bytes

    def __len__(self) -> int:
        return len(self._payloads)

    def get(self, key: StorageKey) -> bytes | None:
        payload = self._payloads.get(key)
        if payload is not None:
            self._index.touch(key)
        return payload

    def admit(self, key: StorageKey, tenant: TenantId, payload: bytes) -> None:
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
