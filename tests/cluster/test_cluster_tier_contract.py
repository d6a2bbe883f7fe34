"""The Redis Cluster tier keeps the tier contract (tests/support/tier_contract.py) against
a real cluster, and its probe names the nodes when it cannot take writes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cacheserver.tiers import Capability, SharedTier
from cacheserver.tiers.cluster.accounting import Tenant
from cacheserver.tiers.cluster.config import RedisClusterConfig
from cacheserver.tiers.cluster.tier import ClusterTier
from kvcommon.hostport import parse_host_port
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.shared_values import ValueMac
from policy.types import StorageKey
from tests.support.tier_contract import TENANT, FakeLocalCopies, check_tier_contract, pending_write

pytestmark = pytest.mark.slow  # every test here takes seconds

MiB = 1 << 20


def cluster_tier(
    seeds: list[str], data_dir: Path, *, write_queue_bytes: int = 256 * MiB, timeout_ms: int = 2000
) -> ClusterTier:
    config = RedisClusterConfig(
        tuple(parse_host_port(seed) for seed in seeds),
        write_queue_bytes=write_queue_bytes,
        timeout_ms=timeout_ms,
    )
    tenant = Tenant(TENANT, tag=bytes(16), epoch=0, quota_bytes=0)
    return ClusterTier(config, [tenant], data_dir, MiB, ValueMac(os.urandom(32)))


def test_the_cluster_tier_keeps_the_tier_contract(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    tier = cluster_tier(cluster.seeds, tmp_path)
    assert isinstance(tier, SharedTier)
    assert tier.capabilities == (
        Capability.SHARED | Capability.QUEUED_WRITES | Capability.OWN_HEALTH
    )

    def settle() -> None:  # its writes are queued: wait until they landed
        assert tier.sharing.flush(30)

    local = check_tier_contract(tier, settle)
    assert local.forgotten  # a delete drops the local copies made while it ran
    assert tier.counts()["written"] == 3


def test_the_cluster_tier_reports_writes_it_cannot_take_on(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    tier = cluster_tier(cluster.seeds, tmp_path, write_queue_bytes=6000)
    tier.start(FakeLocalCopies())
    try:
        tier.sharing.stop()  # nothing leaves the queue: the second write finds it full
        writes = [pending_write(StorageKey(bytes([i]) * 32), bytes(4096)) for i in range(2)]
        assert tier.write(writes, ()) == [True, False]
        assert tier.counts()["dropped"] == 1
    finally:
        tier.close()


def test_the_cluster_tier_probe_says_why_it_cannot_take_writes(tmp_path: Path) -> None:
    tier = cluster_tier(["127.0.0.1:1"], tmp_path, timeout_ms=200)  # nothing listens there
    tier.start(FakeLocalCopies())
    try:
        reason = tier.probe()
        assert reason is not None and reason
    finally:
        tier.close()
