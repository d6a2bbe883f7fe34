"""A bulk read worker's one copy of the config's defaults (cacheserver.core.readonly
.WorkerDefaults): the newest generation wins, whichever reaches the worker first, a
live reload's update or a delegation made before it."""

from __future__ import annotations

from pathlib import Path

from cacheserver.core.readonly import Defaults, ReadOnlyCore, WorkerDefaults
from cacheserver.core.served import EventSums
from cacheserver.tiers.lmdb.tier import LmdbTier
from policy.permissions import PublicScope
from policy.ratelimit import SharedBuckets
from policy.types import TenantId

NO_PUBLIC = PublicScope(configured=False, reader_tenants=frozenset())


def defaults(generation: int, max_digests: int, readers: frozenset[TenantId]) -> Defaults:
    return Defaults(generation, PublicScope(True, readers), 100 * generation, 2, max_digests)


def test_the_newest_generation_wins_in_either_order() -> None:
    alpha = frozenset({TenantId("alpha")})
    for order in ((1, 2), (2, 1)):
        worker = WorkerDefaults(SharedBuckets(["a"]))
        assert worker.public == NO_PUBLIC
        sent = {1: defaults(1, 8192, alpha), 2: defaults(2, 4, frozenset())}
        for generation in order:
            worker.take(sent[generation])
        assert worker.generation == 2
        assert worker.limits.current.max_digests_per_call == 4
        assert worker.public == PublicScope(True, frozenset())
        assert worker.limiter.default_requests_per_s == 200


def test_an_update_brings_the_rate_slots_even_after_a_delegation_brought_its_defaults(
    tmp_path: Path,
) -> None:
    """A connection delegated after the reload may reach the worker before the reload's
    update: the update's rate slots still apply (only updates carry them)."""
    LmdbTier(tmp_path / "lmdb", map_bytes=64 << 20, sync_writes=False).close()
    buckets = SharedBuckets(["a"])
    core = ReadOnlyCore(tmp_path / "lmdb", 64 << 20, buckets, EventSums())
    try:
        newer = defaults(2, 8192, frozenset())
        assert core.defaults.take(newer)  # what the delegation brought
        assert not core.update(newer, {"a": 0, "new": 1})  # defaults: already in use
        assert buckets.slots == {"a": 0, "new": 1}
    finally:
        core.close()
