"""The contract every tier keeps (`cacheserver.tiers.Tier`), as one check that each
tier's tests run against their own tier: memory and LMDB in tests/unit, the Redis
Cluster tier in tests/cluster against a real cluster. A new tier copies one of those.

What a tier declares (`capabilities`) changes only what the contract allows it:
a `QUEUED_WRITES` tier stores what it took on later (`settle` waits for it).
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from cacheserver.blocks import BlockSource
from cacheserver.tiers import Capability, PendingWrite, SharedTier, Tier
from policy.types import ModelTag, StorageKey, TenantId

TENANT = TenantId("alpha")
TAG = ModelTag(bytes(range(16)))


@dataclass
class FakeLocalCopies:
    """A `LocalCopies` with no local tiers behind it: records what the tier asked."""

    forgotten: list[StorageKey] = field(default_factory=list)
    kept: list[StorageKey] = field(default_factory=list)

    def keep_copy(
        self, tenant: TenantId, key: StorageKey, model_tag: ModelTag, source: BlockSource
    ) -> concurrent.futures.Future[bool]:
        self.kept.append(key)
        source.skip()
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()
        future.set_result(True)
        return future

    def local_copy(self, key: StorageKey) -> bytes | bytearray | None:
        return None

    def local_keys(self, tenant: TenantId) -> list[tuple[StorageKey, ModelTag]]:
        return []

    def forget_local(
        self,
        keys: Sequence[StorageKey] = (),
        namespace: tuple[TenantId, ModelTag | None] | None = None,
    ) -> int:
        self.forgotten.extend(keys)
        return 0


def pending_write(key: StorageKey, payload: bytes) -> PendingWrite:
    return PendingWrite(key, TENANT, 0, 1, payload, TAG)


def _read(tier: Tier, keys: Sequence[StorageKey]) -> list[bytes | None]:
    return [None if p is None else bytes(p) for p in tier.read_many(keys)]


def check_tier_contract(tier: Tier, settle: Callable[[], None] = lambda: None) -> FakeLocalCopies:
    """Run `tier` through its whole life: start, writes, reads, deletes, probe, counts,
    stop and close. `settle` waits until writes a `QUEUED_WRITES` tier took on landed.
    Returns the `LocalCopies` it was started with (what it asked of the store)."""
    assert isinstance(tier.name, str) and tier.name
    assert isinstance(tier.capabilities, Capability)
    assert (Capability.SHARED in tier.capabilities) == isinstance(tier, SharedTier)
    local = FakeLocalCopies()
    tier.start(local)
    ks = [StorageKey(os.urandom(32)) for _ in range(3)]
    payloads = [os.urandom(4096 + i) for i in range(3)]

    # A write says, per write, what it stored (or took on to store).
    assert (
        tier.write([pending_write(ks[0], payloads[0]), pending_write(ks[1], payloads[1])], ())
        == [True] * 2
    )
    settle()
    assert _read(tier, ks) == [payloads[0], payloads[1], None]  # read after write
    # First writer wins: a key held already is not stored again, and keeps its bytes.
    assert tier.write([pending_write(ks[1], b"other"), pending_write(ks[2], payloads[2])], ()) == [
        False,
        True,
    ]
    settle()
    assert _read(tier, ks) == payloads

    # A delete says how many of the keys were held; they are misses from then on.
    unknown = StorageKey(os.urandom(32))
    assert tier.delete([ks[0], unknown]) == 1
    assert _read(tier, ks) == [None, *payloads[1:]]
    # A write deletes its `deletes` first.
    assert tier.write([], [ks[1]]) == []
    settle()
    assert _read(tier, ks) == [None, None, payloads[2]]

    assert tier.probe() is None  # healthy: it can take writes
    counts = tier.counts()
    assert isinstance(counts, Mapping)
    assert all(isinstance(k, str) and isinstance(v, int) for k, v in counts.items())
    tier.stop()
    tier.stop()  # idempotent
    tier.close()
    return local
