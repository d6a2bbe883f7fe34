"""Faults of the Redis Cluster tier (docs/scale-out.md): a Redis node down, a failover,
the whole cluster gone, a server that was down while a delete ran. No request fails
because the cluster did; what the cluster cannot answer is a miss, and the server says
so in health and metrics.

Each test kills nodes, so each starts its own cluster.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cacheserver.config import TelemetryConfig
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import BlockDigest, ModelName, TenantId
from replica_agent.client import BlockClient
from tests.support.cluster import (
    MODEL,
    NOT_SERVING,
    SERVING,
    Servers,
    blocks,
    cluster_config,
    eventually,
    health,
    make_cluster,
    tier_of,
)
from tests.support.scrape import parse, scrape_text, value
from tests.support.servers import TRANSPORT_OPTIONS, ServerProcess, launch, write_config

pytestmark = pytest.mark.slow  # every test here takes seconds

ALPHA = TenantId("alpha")
METRICS = TelemetryConfig(metrics_listen="127.0.0.1:0", health_interval_ms=200)


def _nodes_of(servers: Servers, digests: list[bytes]) -> list[str | None]:
    tier = tier_of(servers[0])
    policy = servers[0].policy
    keys = [policy.storage_key(ALPHA, ModelName(MODEL), BlockDigest(d)) for d in digests]
    return [tier.nodes.node_of(tier.keys.block(key)) for key in keys]


def _accounting_node(servers: Servers) -> str | None:
    tier = tier_of(servers[0])
    return tier.nodes.node_of(tier.keys.tenant(tier.tenants[ALPHA].tag).base)


def _metrics(servers: Servers, index: int) -> dict[str, float]:
    server = servers[index].server.server
    assert server is not None
    samples = parse(scrape_text(server.metrics_address))
    wanted = {"failures", "dropped", "hits"}
    out = {e: value(samples, "kvshare_cluster_events_total", event=e) for e in wanted}
    out["reachable"] = value(samples, "kvshare_cluster_reachable")
    return out


def test_a_killed_node_gives_misses_and_no_failed_request_then_local_tiers_serve_alone(
    tmp_path: Path, start_servers: Callable[..., Servers]
) -> None:
    with make_cluster(tmp_path / "redis") as cluster:
        servers = start_servers(cluster, telemetry=METRICS)
        a, b = (servers[i].client("a", transport="grpc") for i in (0, 1))
        digests, payloads = blocks(24)
        a.put("alpha", MODEL, digests, payloads)
        servers.settle()
        where = _nodes_of(servers, digests)
        assert len(set(where)) == 3  # spread over all nodes
        # Not the node with alpha's accounting (every write of alpha is admitted there:
        # with it down none is, which the whole-cluster-gone part below covers).
        dead = next(n for n in cluster.nodes if n.address != _accounting_node(servers))
        # The blocks put after the kill, named now: the slot map is read while every node
        # answers (after the kill a refreshed map no longer names the dead node), and
        # some of them must land on the dead node for the drops below to be seen.
        new_digests, new_payloads = blocks(12)
        while dead.address not in _nodes_of(servers, new_digests):
            new_digests, new_payloads = blocks(12)
        new_lost = [w == dead.address for w in _nodes_of(servers, new_digests)]
        cluster.kill(dead)
        lost = [w == dead.address for w in where]
        # B never held these: each is found in the cluster unless its node is dead.
        for digest, payload, gone in zip(digests, payloads, lost, strict=True):
            assert b.lookup("alpha", MODEL, [digest]) == (0 if gone else 1)
            assert b.get("alpha", MODEL, [digest]) == ([] if gone else [payload])
        leading = lost.index(True)
        assert b.lookup("alpha", MODEL, digests) == leading
        assert b.get("alpha", MODEL, digests) == payloads[:leading]
        assert a.get("alpha", MODEL, digests) == payloads  # A's local copies: all of them
        # Puts still succeed; the cluster takes those whose slots are alive.
        assert b.put("alpha", MODEL, new_digests, new_payloads) == [True] * 12
        servers.settle()
        for digest, gone in zip(new_digests, new_lost, strict=True):
            assert a.lookup("alpha", MODEL, [digest]) == (0 if gone else 1)
        assert eventually(lambda: health(servers[1].address, "kvshare.cluster") == NOT_SERVING)
        assert health(servers[1].address, "") == SERVING  # the server itself serves on
        figures = _metrics(servers, 1)
        assert figures["failures"] > 0 and figures["dropped"] >= sum(new_lost) > 0
        assert figures["reachable"] == 0
        # The whole cluster gone: each server serves what it holds, nothing fails.
        for node in cluster.running():
            cluster.kill(node)
        kept = [p for p, gone in zip(payloads, lost, strict=True) if not gone]
        kept_digests = [d for d, gone in zip(digests, lost, strict=True) if not gone]
        assert b.get("alpha", MODEL, kept_digests) == kept  # B kept what it read
        assert a.get("alpha", MODEL, digests) == payloads
        assert a.put("alpha", MODEL, *blocks(2)) == [True, True]
        assert health(servers[0].address, "") == SERVING


def _replicated(cluster: LocalRedisCluster) -> bool:
    """Whether every replica has all of its primary's writes (replication is async)."""
    for node in cluster.primary_nodes():
        info = dict(
            line.split(":", 1) for line in node.cli("info", "replication").split() if ":" in line
        )
        offset = info["master_repl_offset"]
        replicas = [v for k, v in info.items() if k.startswith("slave") and k[5:].isdigit()]
        if not replicas or any(f"offset={offset}," not in r for r in replicas):
            return False
    return True


def test_with_replicas_a_failover_completes_and_service_continues(
    tmp_path: Path, start_servers: Callable[..., Servers]
) -> None:
    with make_cluster(tmp_path / "redis", replicas=1) as cluster:
        servers = start_servers(cluster)
        a, b = (servers[i].client("a", transport="grpc") for i in (0, 1))
        digests, payloads = blocks(24)
        a.put("alpha", MODEL, digests, payloads)
        servers.settle()
        assert eventually(lambda: _replicated(cluster))  # each replica has every block
        victim = next(
            n for n in cluster.primary_nodes() if n.address in _nodes_of(servers, digests)
        )
        cluster.kill(victim)
        cluster.wait_promoted(victim)

        # Each server re-reads the slot map and says the cluster is whole again...
        def whole(address: str) -> Callable[[], bool]:
            return lambda: health(address, "kvshare.cluster") == SERVING

        for server in servers.running:
            assert eventually(whole(server.address), timeout_s=20)
        # ...reads through B (no local copies) find every block on the promoted replica...
        assert b.lookup("alpha", MODEL, digests) == 24
        assert b.get("alpha", MODEL, digests) == payloads
        # ...and writes continue there: put via A, read via B.
        new_digests, new_payloads = blocks(12)
        assert a.put("alpha", MODEL, new_digests, new_payloads) == [True] * 12
        servers.settle()
        assert b.get("alpha", MODEL, new_digests) == new_payloads


def test_deletes_reach_a_server_that_was_down_when_they_were_made(
    tmp_path: Path, start_servers: Callable[..., Servers]
) -> None:
    with make_cluster(tmp_path / "redis") as cluster:
        servers = start_servers(cluster)
        digests, payloads = blocks(6)
        servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
        servers.settle()
        reader = servers[1]
        assert reader.client("a", transport="grpc").get("alpha", MODEL, digests) == payloads
        servers.settle()
        assert reader.store.tenant_usage(ALPHA)[0] == 6  # B's own copies
        reader.stop()
        assert servers[0].client("a", transport="grpc").delete("alpha", MODEL, digests[:3]) == 3
        again = launch(servers.tenancy, data_dir=reader.data_dir)
        try:
            assert again.store.tenant_usage(ALPHA)[0] == 3  # caught up before serving
            client = again.client("a", transport="grpc")
            assert client.get("alpha", MODEL, digests[:3]) == []
            assert client.get("alpha", MODEL, digests[3:]) == payloads[3:]  # control
        finally:
            again.stop()


def test_clients_move_to_the_other_server_when_one_dies(
    cluster: LocalRedisCluster, tmp_path: Path, transport: str
) -> None:
    tenancy = write_config(tmp_path, extra=cluster_config(tmp_path, cluster.seeds))
    processes = [
        ServerProcess("--config", str(tenancy.path), "--data-dir", str(tmp_path / f"d{i}"))
        for i in range(2)
    ]
    try:
        options = TRANSPORT_OPTIONS[transport]
        client = BlockClient(
            [p.address for p in processes],
            tenancy.tokens["a"],
            bulk=options.get("bulk", True),
            same_host=options.get("same_host", True),
        )
        digests, payloads = blocks(8)
        for i in range(8):  # round robin: through both servers
            client.put("alpha", MODEL, digests[i : i + 1], payloads[i : i + 1])
        # Written behind: wait until the survivor finds every block in the cluster (a
        # block only the killed server held would go with it, as a cache entry does).
        with BlockClient(processes[1].address, tenancy.tokens["a"], bulk=False) as survivor:
            assert eventually(lambda: survivor.lookup("alpha", MODEL, digests) == 8)
        processes[0].kill9()
        for _ in range(10):  # each call reaches the server that is left
            assert client.lookup("alpha", MODEL, digests) == 8
            assert client.get("alpha", MODEL, digests) == payloads
        assert client.put("alpha", MODEL, *blocks(2)) == [True, True]
        client.close()
    finally:
        for process in processes:
            if process.proc.poll() is None:
                process.terminate()


def test_a_server_whose_cluster_never_answers_serves_its_local_tiers_and_says_so(
    start_servers: Callable[..., Servers],
) -> None:
    servers = start_servers(["127.0.0.1:1"], count=1, telemetry=METRICS)  # nothing listens
    client = servers[0].client("a", transport="grpc")
    digests, payloads = blocks(4)
    assert client.put("alpha", MODEL, digests, payloads) == [True] * 4
    assert client.lookup("alpha", MODEL, digests) == 4
    assert client.get("alpha", MODEL, digests) == payloads
    assert health(servers[0].address, "") == SERVING
    assert health(servers[0].address, "kvshare.cluster") == NOT_SERVING
    assert _metrics(servers, 0)["reachable"] == 0
