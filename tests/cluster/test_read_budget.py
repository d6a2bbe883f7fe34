"""A cold read through the cluster holds what the store asked for, not what Redis
announces (cacheserver/tiers/cluster/tier.py, `read_leading`).

The read window grows from the sizes of the first blocks: two small blocks, then large
ones, made it ask for 64 blocks at once, and every value a node sent was taken in —
64 x `max_block_bytes` per read, whatever the store's batch. The test counts the bytes
the reader takes into buffers (`Replies._take`), with no timing.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from cacheserver.tiers.cluster.layout import HEADER_BYTES
from cacheserver.tiers.cluster.replies import Replies
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import BlockDigest, ModelName, TenantId
from tests.support.cluster import MODEL, KiB, Servers, blocks, tier_of

pytestmark = pytest.mark.slow  # every test here takes seconds

ALPHA = TenantId("alpha")
MiB = 1024 * KiB


def test_a_cold_read_takes_in_at_most_its_budget_and_one_block(
    cluster: LocalRedisCluster,
    start_servers: Callable[..., Servers],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    servers = start_servers(cluster)
    small, small_payloads = blocks(2, 1 * KiB)
    large, large_payloads = blocks(24, 1 * MiB)
    digests, payloads = small + large, small_payloads + large_payloads
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    servers.settle()
    policy, reader = servers[0].policy, tier_of(servers[1])  # the reader holds no copy
    keys = [policy.storage_key(ALPHA, ModelName(MODEL), BlockDigest(d)) for d in digests]
    taken: list[int] = []
    take = Replies._take

    def counted(self: Replies, size: int) -> bytearray:
        taken.append(size)
        return take(self, size)

    monkeypatch.setattr(Replies, "_take", counted)
    budget, reads = 3 * MiB, 0
    served: list[bytes] = []
    while len(served) < len(keys):  # the store's batches, each with its budget
        taken.clear()
        got, more = reader.read_leading(ALPHA, keys[len(served) :], budget)
        assert got, "every read returns at least one block"
        assert sum(taken) <= budget + 1 * MiB + HEADER_BYTES, sum(taken)
        served += [bytes(p) for p in got]
        assert more == (len(served) < len(keys))
        reads += 1
    assert served == payloads  # every block, in order, none lost to the budget
    assert reads <= 16
