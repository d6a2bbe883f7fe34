"""Two kvshare servers over one real 3-node Redis Cluster serve one store
(docs/scale-out.md).

Each test puts through one server and checks through the other, whose local tiers
never held the block: what it finds, it found in the cluster.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from cacheserver.config import StorageConfig
from cacheserver.tiers.cluster.layout import unpack_header
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import BlockDigest, ModelName, StorageKey, TenantId
from tests.support.cluster import MODEL, KiB, Servers, blocks, cluster_contents, eventually, tier_of
from tests.support.servers import launch, write_config

pytestmark = pytest.mark.slow  # every test here takes seconds

ALPHA = TenantId("alpha")


def test_a_block_put_through_one_server_is_found_fetched_and_deleted_through_the_other(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers], transport: str
) -> None:
    servers = start_servers(cluster)
    a, b = servers[0].client("a", transport=transport), servers[1].client("a", transport=transport)
    digests, payloads = blocks(6, 256 * KiB)
    assert a.put("alpha", MODEL, digests, payloads) == [True] * 6
    servers.settle()
    assert servers[1].store.tenant_usage(ALPHA) == (0, 0)  # B holds nothing of its own
    assert b.lookup("alpha", MODEL, digests) == 6
    assert b.get("alpha", MODEL, digests) == payloads  # byte-identical, from the cluster
    servers.settle()
    assert servers[1].store.tenant_usage(ALPHA)[0] == 6  # kept: the next read is local
    assert b.delete("alpha", MODEL, digests[:2]) == 2
    # A's own copies go too (through the delete stream), and the cluster's.
    assert eventually(lambda: a.lookup("alpha", MODEL, digests) == 0)
    assert a.get("alpha", MODEL, digests[:2]) == []
    assert a.get("alpha", MODEL, digests[2:]) == payloads[2:]  # positive control
    assert servers[0].store.tenant_usage(ALPHA)[0] == 4


def test_a_second_tenant_sees_nothing_of_the_first(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster)
    digests, payloads = blocks(4)
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    servers.settle()
    for server in servers.running:
        beta = server.client("b", transport="grpc")
        assert beta.lookup("beta", MODEL, digests) == 0
        assert beta.get("beta", MODEL, digests) == []
        # Positive control: the owner, through the same server, finds all of them.
        assert server.client("a", transport="grpc").get("alpha", MODEL, digests) == payloads
    # The same digests in beta name other blocks: beta's own puts do not collide.
    own = [bytes(reversed(p)) for p in payloads]
    servers[1].client("b", transport="grpc").put("beta", MODEL, digests, own)
    servers.settle()
    assert servers[0].client("b", transport="grpc").get("beta", MODEL, digests) == own
    assert servers[1].client("a", transport="grpc").get("alpha", MODEL, digests) == payloads


def _storage_keys(servers: Servers, digests: Sequence[bytes]) -> list[StorageKey]:
    policy = servers[0].policy
    return [policy.storage_key(ALPHA, ModelName(MODEL), BlockDigest(d)) for d in digests]


def _alpha_in_cluster(cluster: LocalRedisCluster, servers: Servers) -> set[StorageKey]:
    """Alpha's blocks, by scanning every block key in Redis and reading its header."""
    tier = tier_of(servers[0])
    tag = tier.tenants[ALPHA].tag
    found = set()
    for name, value in cluster_contents(cluster).items():
        if tier.keys.is_block(name) and isinstance(value, bytes):
            header = unpack_header(value)
            if header is not None and header.tenant_tag == tag:
                assert len(value) - header.size > 0
                found.add(StorageKey(bytes.fromhex(name.rsplit(b":", 1)[1].decode())))
    return found


def test_a_quota_holds_across_servers_and_evicts_the_tenants_least_recently_used(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    size, quota = 64 * KiB, 16 * 64 * KiB
    servers = start_servers(cluster, quotas={"alpha": quota, "beta": quota})
    tier = tier_of(servers[0])
    alpha = [servers[i].client("a", transport="grpc") for i in (0, 1)]
    beta_digests, beta_payloads = blocks(8, size)  # beta stays within its quota
    servers[1].client("b", transport="grpc").put("beta", MODEL, beta_digests, beta_payloads)
    digests, payloads = blocks(48, size)  # 3x alpha's quota, through both servers in turn
    keys = _storage_keys(servers, digests)

    def put(first: int, end: int) -> None:
        for i in range(first, end):
            alpha[i % 2].put("alpha", MODEL, digests[i : i + 1], payloads[i : i + 1])
            servers.settle()  # each reaches the cluster before the next: a known order

    put(0, 16)  # the quota, full
    assert alpha[1].lookup("alpha", MODEL, digests[:1]) == 1  # block 0 (A's) used via B
    servers.settle()
    put(16, 24)  # evicts the 8 least recently used: 1..8, not 0
    assert _alpha_in_cluster(cluster, servers) == {keys[0], *keys[9:24]}
    put(24, 48)
    assert _alpha_in_cluster(cluster, servers) == set(keys[32:48])  # 16 blocks: the quota
    assert tier.accounting.usage(tier.tenants[ALPHA]) == (16, quota)
    # Beta lost nothing: a server that never held its blocks reads them from the cluster.
    third = start_servers(cluster, 1, quotas={"alpha": quota, "beta": quota})[0]
    assert third.client("b", transport="grpc").get("beta", MODEL, beta_digests) == beta_payloads
    assert third.client("a", transport="grpc").get("alpha", MODEL, digests[32:]) == payloads[32:]


def test_without_the_put_journal_puts_reach_the_cluster_behind_the_lmdb_commit(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster, storage=StorageConfig(journal_bytes=0))
    digests, payloads = blocks(4)
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    servers.settle()
    reader = servers[1].client("a", transport="grpc")
    assert reader.get("alpha", MODEL, digests) == payloads
    servers.settle()
    assert servers[1].store.tenant_usage(ALPHA)[0] == 4  # kept, through the LMDB commit


def test_a_server_joining_the_cluster_shares_what_it_holds(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers], tmp_path: Path
) -> None:
    secret = tmp_path / "server.secret"  # the one start_servers gives the cluster's servers
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    (tmp_path / "alone").mkdir()
    tenancy = write_config(tmp_path / "alone", extra=f'secret_file = "{secret}"')
    alone = launch(tenancy, data_dir=tmp_path / "joining")
    digests, payloads = blocks(3)
    alone.client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    alone.stop()  # a server without a cluster, with blocks in its LMDB
    servers = start_servers(cluster)
    joining = launch(servers.tenancy, data_dir=tmp_path / "joining")
    try:
        assert tier_of(joining).sharing.flush(30)
        assert servers[1].client("a", transport="grpc").get("alpha", MODEL, digests) == payloads
    finally:
        joining.stop()
