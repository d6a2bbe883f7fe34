"""The public scope over a Redis Cluster: reads leave no trace that another tenant
could time (docs/isolation.md, "Public prefixes"; threat model C76).

Two servers share one real 3-node cluster; a publisher publishes through server A.
Tenant beta reads published blocks through server B (which never held them) and
through A. What the reads must not change: which public blocks B holds locally (a
kept copy is served from B's memory, every other one from the cluster: a reader of B
would time which prefixes were read) and the cluster's state (the scope's recency
order there decides its eviction). Control: the same reads of alpha's own blocks do
both, so the test sees a read when one counts.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import PUBLIC, TenantId
from tests.support.cluster import (
    MODEL,
    KiB,
    Servers,
    blocks,
    cluster_config,
    cluster_contents,
    tier_of,
)
from tests.support.servers import Tenancy, launch, write_config

pytestmark = pytest.mark.slow  # every test here takes seconds

PRINCIPALS = {
    "a": (["alpha"], ["read", "write"]),
    "b": (["beta"], ["read", "write"]),
    "publisher": ([], ["publish"]),
}


def public_cluster_config(tmp_path: Path, cluster: LocalRedisCluster) -> Tenancy:
    """Tenants alpha and beta (both `read_public`), a publisher, a `[public]` scope
    and the cluster, with one shared secret: one config for every server."""
    tenancy = write_config(
        tmp_path, principals=PRINCIPALS, extra=cluster_config(tmp_path, cluster.seeds)
    )
    text = tenancy.path.read_text()
    for tenant in ("alpha", "beta"):
        text = text.replace(f'id = "{tenant}"\n', f'id = "{tenant}"\nread_public = true\n')
    tenancy.path.write_text(text + "[public]\nquota_bytes = 4194304\n")
    return tenancy


def two_servers(tmp_path: Path, cluster: LocalRedisCluster) -> Servers:
    tenancy = public_cluster_config(tmp_path, cluster)
    running = [launch(tenancy, data_dir=tmp_path / f"data{i}") for i in range(2)]
    return Servers(tenancy, running)


def test_reading_published_blocks_through_a_server_keeps_nothing_and_touches_nothing(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    servers = two_servers(tmp_path, cluster)
    try:
        digests, payloads = blocks(4, 32 * KiB)
        own, own_payloads = blocks(4, 32 * KiB)
        with (
            servers[0].client("publisher", transport="grpc") as publisher,
            servers[0].client("a", transport="grpc") as a_on_a,
            servers[1].client("a", transport="grpc") as a_on_b,
            servers[0].client("b", transport="grpc") as b_on_a,
            servers[1].client("b", transport="grpc") as b_on_b,
        ):
            assert publisher.put(PUBLIC, MODEL, digests, payloads) == [True] * 4
            assert a_on_a.put("alpha", MODEL, own, own_payloads) == [True] * 4
            servers.settle()
            before = cluster_contents(cluster)
            for _ in range(3):  # beta keeps reading the oldest published block
                assert b_on_b.lookup(PUBLIC, MODEL, digests[:1]) == 1
                assert b_on_b.get(PUBLIC, MODEL, digests[:1]) == payloads[:1]
                assert b_on_a.lookup(PUBLIC, MODEL, digests[:1]) == 1
                assert b_on_a.get(PUBLIC, MODEL, digests[:1]) == payloads[:1]
            servers.settle()
            # B holds no public block of its own: none was put through it.
            assert servers[1].store.tenant_usage(TenantId(PUBLIC)) == (0, 0)
            assert tier_of(servers[1]).counts()["promoted"] == 0
            assert cluster_contents(cluster) == before  # no touch, no reorder
            # Every published block is still served through B (from the cluster).
            assert b_on_b.get(PUBLIC, MODEL, digests) == payloads

            # Control: alpha's oldest block read through B is kept there and touched.
            for _ in range(3):
                assert a_on_b.lookup("alpha", MODEL, own[:1]) == 1
                assert a_on_b.get("alpha", MODEL, own[:1]) == own_payloads[:1]
            servers.settle()
            assert servers[1].store.tenant_usage(TenantId("alpha"))[0] == 1
            assert tier_of(servers[1]).counts()["promoted"] == 1
            assert cluster_contents(cluster) != before
    finally:
        for server in servers.running:
            server.stop()


def test_the_public_scopes_cluster_order_follows_put_order_alone(
    cluster: LocalRedisCluster, tmp_path: Path
) -> None:
    """The scope's order in the cluster (what its quota evicts first) after reads of
    its oldest block through both servers is the put order; a tenant's own order is
    moved by the same reads (control)."""
    servers = two_servers(tmp_path, cluster)
    try:
        digests, payloads = blocks(3, 16 * KiB)
        own, own_payloads = blocks(3, 16 * KiB)
        with (
            servers[0].client("publisher", transport="grpc") as publisher,
            servers[0].client("a", transport="grpc") as a_on_a,
        ):
            for digest, payload in zip(digests, payloads, strict=True):
                assert publisher.put(PUBLIC, MODEL, [digest], [payload]) == [True]
                servers.settle()
            for digest, payload in zip(own, own_payloads, strict=True):
                assert a_on_a.put("alpha", MODEL, [digest], [payload]) == [True]
                servers.settle()
        orders = _orders(cluster)
        for server in servers.running:
            with server.client("b", transport="grpc") as b, server.client("a") as a:
                assert b.get(PUBLIC, MODEL, digests[:1]) == payloads[:1]
                assert a.get("alpha", MODEL, own[:1]) == own_payloads[:1]
        servers.settle()
        after = _orders(cluster)
        moved = [name for name in orders if orders[name] != after.get(name)]
        assert len(moved) == 1  # alpha's order moved (the control); the scope's did not
        assert sorted(len(order) for order in orders.values()) == [3, 3]  # the two orders
    finally:
        for server in servers.running:
            server.stop()


def _orders(cluster: LocalRedisCluster) -> dict[bytes, list[bytes]]:
    """Every sorted set of the cluster: the tenants' recency orders."""
    return {
        name: value
        for name, value in cluster_contents(cluster).items()
        if isinstance(value, list) and value and isinstance(value[0], bytes)
    }
