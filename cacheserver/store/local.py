"""What a shared tier (issue 17, `cacheserver.tiers.cluster`) asks of this server's own
copies: the keys it holds of a tenant, a copy of one block that stays valid, and the
dropping of copies that a delete made through another server took away. Only the local
tiers (memory, journal, LMDB) are involved, never a tier behind LMDB.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cacheserver.store.tiering import Tiers
from policy.types import ModelTag, StorageKey, TenantId


def keys_of(tiers: Tiers, tenant: TenantId) -> list[tuple[StorageKey, ModelTag]]:
    """The keys this server holds of `tenant`, each with its model tag."""
    index = tiers.index
    with tiers.lock:
        return [(k, ModelTag(e.tag)) for k in index.keys_of(tenant) if (e := index.get(k))]


def copy_of(
    tiers: Tiers, pin: Callable[[], Callable[[], None]], key: StorageKey
) -> bytes | bytearray | None:
    """This server's copy of a block (memory, journal or LMDB), as bytes that stay
    valid; None if it holds none. Blocking."""
    unpin = pin()
    try:
        with tiers.lock:
            if key not in tiers.index:
                return None
            payload = tiers.memory.get(key)
            if payload is None and tiers.journaled is not None:
                payload = tiers.journaled.held([key]).get(key)
        if payload is None:
            payload = tiers.disk.read_many([key])[0]
        if payload is None or isinstance(payload, bytes | bytearray):
            return payload
        return bytes(payload)  # a view of a journal record, valid only while pinned
    finally:
        unpin()


def forget(
    tiers: Tiers,
    barrier: Callable[[], None],
    keys: Sequence[StorageKey],
    namespace: tuple[TenantId, ModelTag | None] | None,
) -> int:
    """Drop this server's copies of `keys`, or of a namespace (tenant, and a model tag
    or None for all of it): a delete made through another server. As in
    `BlockStore.delete`, the writer's barrier comes before the lower tiers' delete, so no
    commit or replay brings them back. Returns how many it held. Blocking."""
    with tiers.lock:
        if namespace is not None:
            present = tiers.index.keys_of(*namespace)
        else:
            present = [k for k in keys if k in tiers.index]
        tiers.remove_everywhere(present)
    if present:
        barrier()
        tiers.delete_below(present)
    return len(present)
