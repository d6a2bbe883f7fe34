"""`StoreCopies`: what a tier may ask of this server's own copies (the tiers' side of it
is `cacheserver.tiers.LocalCopies`): the keys it holds of a tenant, a copy of one block
that stays valid, a block to keep, and the dropping of copies that a delete made
through another server took away. Only the local tiers (memory, journal, LMDB) are
involved, never a tier behind LMDB. The store hands it to its tiers when it starts, so
no tier holds a reference to the store.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Sequence

from cacheserver.blocks import BlockSource
from cacheserver.store.tiering import IndexedTiers
from policy.types import ModelTag, StorageKey, TenantId

Put = Callable[[TenantId, StorageKey, ModelTag, BlockSource], concurrent.futures.Future[bool]]


class StoreCopies:
    def __init__(
        self,
        tiers: IndexedTiers,
        put: Put,
        pin: Callable[[], Callable[[], None]],
        barrier: Callable[[], None],
    ) -> None:
        """`put` is the store's own (a copy is admitted like any put), `pin` keeps views
        of journal records valid, `barrier` waits for the writer (`Writer.barrier`)."""
        self._tiers = tiers
        self._put = put
        self._pin = pin
        self._barrier = barrier

    def keep_copy(
        self, tenant: TenantId, key: StorageKey, model_tag: ModelTag, source: BlockSource
    ) -> concurrent.futures.Future[bool]:
        return self._put(tenant, key, model_tag, source)

    def local_keys(self, tenant: TenantId) -> list[tuple[StorageKey, ModelTag]]:
        return self._tiers.local_keys(tenant)

    def local_copy(self, key: StorageKey) -> bytes | bytearray | None:
        """This server's copy of a block, as bytes that stay valid; None if it holds
        none. Blocking."""
        unpin = self._pin()
        try:
            payload = self._tiers.read_local(key)
            if payload is None or isinstance(payload, bytes | bytearray):
                return payload
            return bytes(payload)  # a view of a journal record, valid only while pinned
        finally:
            unpin()

    def forget_local(
        self,
        keys: Sequence[StorageKey] = (),
        namespace: tuple[TenantId, ModelTag | None] | None = None,
    ) -> int:
        """Drop this server's copies of `keys`, or of a namespace (tenant, and a model
        tag or None for all of it): a delete made through another server. As in
        `BlockStore.delete`, the writer's barrier comes before the lower tiers' delete,
        so no commit or replay brings them back. Returns how many it held. Blocking."""
        tiers = self._tiers
        present = tiers.forget_namespace(*namespace) if namespace else tiers.forget(keys)
        if present:
            self._barrier()
            tiers.lineup.delete_below(present)
        return len(present)
