"""`Lineup`: the store's tiers as one ordered list, fastest first, sorted once by what
each declares (`cacheserver.tiers.Capability`), and the verbs that go across them.

    memory     the in-process cache (`Capability.IN_PROCESS`), under the store's lock
    lmdb       the first lower tier: the index is rebuilt from it, the journal drains
               into it, and every put is committed to it before it is visible
    behind     any further tiers, in the order given: written behind each LMDB commit

Everything here but the memory tier is blocking and called outside the store's lock.
What only some tiers do is a list made at construction: the shared tiers (asked on an
index miss, told of every put, deleting through the other servers), the tiers whose
probe is the store's health (not `OWN_HEALTH`), the tiers a local delete reaches (not
`SHARED`: a shared tier's deletes go to the other servers too, `delete_shared`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from cacheserver.tiers import Capability, LocalCopies, Payload, PendingWrite, SharedTier, Tier
from cacheserver.tiers.lmdb.tier import LmdbTier
from cacheserver.tiers.memory import MemoryTier
from policy.types import ModelTag, StorageKey, TenantId

log = logging.getLogger(__name__)


def _as_shared(tier: Tier) -> SharedTier:
    if not isinstance(tier, SharedTier):
        raise TypeError(f"tier {tier.name} declares Capability.SHARED without its methods")
    return tier


class Lineup:
    def __init__(self, memory: MemoryTier, disk: LmdbTier, behind: Sequence[Tier]) -> None:
        for tier in behind:
            if Capability.IN_PROCESS in tier.capabilities:
                raise TypeError(f"tier {tier.name} is in process: only memory is, and first")
        self.memory = memory
        self.disk = disk
        self.behind = tuple(behind)
        self.all: tuple[Tier, ...] = (memory, disk, *self.behind)
        self.lower: tuple[Tier, ...] = (disk, *self.behind)
        self.shared = tuple(
            _as_shared(t) for t in self.behind if Capability.SHARED in t.capabilities
        )
        self._deleted_here = tuple(t for t in self.behind if t not in self.shared)
        self._probed = tuple(t for t in self.lower if Capability.OWN_HEALTH not in t.capabilities)

    @property
    def asks_on_miss(self) -> bool:
        """Whether a key the index does not list may still be held (by a shared tier)."""
        return bool(self.shared)

    # -- reads, writes and deletes below the memory tier -----------------------------

    def read_below(self, keys: Sequence[StorageKey]) -> dict[StorageKey, Payload | None]:
        """The payloads of `keys` from the lower tiers: each from the first tier that
        holds it (LMDB, then the tiers behind it), None where none does."""
        found: dict[StorageKey, Payload | None] = dict(
            zip(keys, self.disk.read_many(keys), strict=True)
        )
        for tier in self.behind:
            missing = [key for key, payload in found.items() if payload is None]
            if not missing:
                break
            found.update(zip(missing, tier.read_many(missing), strict=True))
        return found

    def write_behind(self, writes: Sequence[PendingWrite]) -> None:
        """Hand blocks LMDB has just committed to every tier behind it. A failure there
        fails no put (each is acknowledged already); it is logged, and the tier's own
        probe says why it cannot take writes."""
        if not writes:
            return
        for tier in self.behind:
            try:
                tier.write(writes, ())
            except Exception as error:
                log.error(
                    "writing behind to %s failed (%s)", type(tier).__name__, type(error).__name__
                )

    def delete_below(self, keys: Sequence[StorageKey]) -> int:
        """Delete `keys` from every lower tier, durably; how many LMDB held. The shared
        tiers are left to `delete_shared`: their deletes reach the other servers."""
        deleted = self.disk.delete(keys)
        for tier in self._deleted_here:
            tier.delete(keys)
        return deleted

    # -- what only shared tiers do (`Capability.SHARED`) -----------------------------

    def count_shared(self, tenant: TenantId, keys: Sequence[StorageKey], present: int) -> int:
        """How many of `keys[present:]`, leading, the shared tiers hold. Blocking."""
        found = 0
        for tier in self.shared:
            found += tier.count_leading(tenant, keys, present + found)
        return found

    def read_shared(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> tuple[list[Payload], bool]:
        """The leading payloads of `keys` from the first shared tier that holds the
        first of them, and whether the key after them may be held. Blocking."""
        for tier in self.shared:
            payloads, more = tier.read_leading(tenant, keys, max_bytes)
            if payloads:
                return payloads, more
        return [], False

    def share(self, tenant: TenantId, key: StorageKey, model_tag: ModelTag) -> None:
        """A put was acknowledged: the shared tiers write it soon, not at the drain."""
        for tier in self.shared:
            tier.share(tenant, key, model_tag)

    def delete_shared(self, keys: Sequence[StorageKey]) -> int:
        """Delete `keys` through the shared tiers, everywhere; how many they held."""
        held: set[StorageKey] = set()
        for tier in self.shared:
            held |= tier.delete_held(keys)
        return len(held)

    def delete_shared_namespace(self, tenant: TenantId, model_tag: ModelTag | None) -> int:
        held: set[StorageKey] = set()
        for tier in self.shared:
            held |= tier.delete_namespace(tenant, model_tag)
        return len(held)

    # -- lifecycle ---------------------------------------------------------------------

    def start(self, local: LocalCopies) -> None:
        for tier in self.all:
            tier.start(local)

    def stop(self) -> None:
        """Stop the tiers' threads, slowest first (they may use the local copies)."""
        for tier in reversed(self.all):
            tier.stop()

    def probe(self) -> str | None:
        """Why a lower tier the store depends on cannot take writes now, or None."""
        for tier in self._probed:
            reason = tier.probe()
            if reason is not None:
                return reason
        return None
