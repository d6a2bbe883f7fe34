"""A block read from the Redis Cluster twice before this server keeps its copy is kept
once and counted once (ClusterTier's `promoted`: blocks read from the cluster and kept
here), however the reads and the keeper thread interleave."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import TenantId
from tests.support.cluster import MODEL, KiB, Servers, blocks, tier_of

pytestmark = pytest.mark.slow  # two servers and a cluster: seconds


def test_a_block_read_twice_before_it_is_kept_counts_one_promotion(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster)
    digests, payloads = blocks(2, 32 * KiB)
    with (
        servers[0].client("a", transport="grpc") as a_on_a,
        servers[1].client("a", transport="grpc") as a_on_b,
    ):
        assert a_on_a.put("alpha", MODEL, digests, payloads) == [True, True]
        servers.settle()
        # One read names the first block twice: both are read from the cluster and
        # queued to be kept before the keeper takes either (a second read arriving
        # before the first one's copy is made does the same, as the timing allows).
        once = digests[:1] * 2
        assert a_on_b.get("alpha", MODEL, once) == payloads[:1] * 2
        servers.settle()
        assert servers[1].store.tenant_usage(TenantId("alpha"))[0] == 1
        assert tier_of(servers[1]).counts()["promoted"] == 1
        # Control: the other block, read once, is kept and counted too.
        assert a_on_b.get("alpha", MODEL, digests[1:]) == payloads[1:]
        servers.settle()
        assert servers[1].store.tenant_usage(TenantId("alpha"))[0] == 2
        assert tier_of(servers[1]).counts()["promoted"] == 2
