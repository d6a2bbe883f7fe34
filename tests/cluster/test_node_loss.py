"""A Redis node that dies under servers that have been talking to it (docs/scale-out.md,
"Faults"; threat model C75).

The servers hold pooled connections to every node when one of them dies. Whatever
comes first afterwards, a read that reaches for a pooled connection to the dead node,
one that connects afresh, a lookup, a put or a delete, the call must not fail because
the node did: reads and lookups answer misses for the dead node's blocks and hits for
the rest, puts are acknowledged by the local tiers, and a delete that could not reach
the node is UNAVAILABLE (retry it), never INTERNAL. Every transport: gRPC, the bulk
channel over TCP and the bulk channel's same-host arena.

The servers run with `retry_after_ms = 0`, so no call skips the dead node and every one
meets it (with the default, a call made within a second of another one's failure is
answered at once, which hides the order of events this file is about), and with
`local_copies = false`, so reading a block again reads it from the cluster again.

The first test does the same to the node client itself (`ClusterNodes`), path by path:
values, the delete stream (the follower's read), writes, deletes, scripts, the health
probe; one client that has pooled connections to the node, one made after it died.

Each test kills a node, so each starts its own cluster.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

from cacheserver.tiers.cluster.config import RedisClusterConfig
from cacheserver.tiers.cluster.nodes import ClusterNodes, Failed
from kvcommon.errors import Unavailable
from kvcommon.hostport import HostPort
from kvshare.bench.redis_cluster import LocalRedisCluster, RedisNode
from policy.types import BlockDigest, ModelName, TenantId
from replica_agent.client import BlockClient
from tests.support.cluster import MODEL, KiB, Servers, blocks, make_cluster, tier_of
from tests.support.servers import TRANSPORTS, Running, launch

pytestmark = pytest.mark.slow  # every test here takes seconds

ALPHA = TenantId("alpha")
EVERY_CALL_MEETS_IT = "retry_after_ms = 0\nlocal_copies = false"
ROUNDS_AFTER = 3  # rounds each background reader completes after the node died


def _node_of(server: Running, digest: bytes) -> str | None:
    tier = tier_of(server)
    key = server.policy.storage_key(ALPHA, ModelName(MODEL), BlockDigest(digest))
    return tier.nodes.node_of(tier.keys.block(key))


def _victim(cluster: LocalRedisCluster, server: Running) -> RedisNode:
    """A node that holds neither alpha's accounting nor the delete stream: with it down
    alpha's writes are still admitted and deletes can still be announced, so what this
    file checks is the dead node's own keys."""
    tier = tier_of(server)
    spared = {
        tier.nodes.node_of(tier.keys.tenant(tier.tenants[ALPHA].tag).base),
        tier.nodes.node_of(tier.keys.deletes),
    }
    return next(node for node in cluster.nodes if node.address not in spared)


def _spread(server: Running, dead: RedisNode, count: int) -> list[bytes]:
    """`count` random digests never stored, some on `dead` and some elsewhere."""
    while True:
        digests, _ = blocks(count, 1)
        on_dead = [_node_of(server, d) == dead.address for d in digests]
        if any(on_dead) and not all(on_dead):
            return digests


def _end(cluster: LocalRedisCluster, node: RedisNode, how: str) -> None:
    assert node.process is not None
    if how == "shutdown":  # what an operator does: redis-cli -p PORT shutdown nosave
        node.cli("shutdown", "nosave")
        node.process.wait(timeout=10)
    else:
        cluster.kill(node)  # SIGKILL: a crashed host
    assert node.process.poll() is not None
    assert "PONG" not in node.cli("ping")  # nothing answers on its port now


def _clients(server: Running) -> dict[str, BlockClient]:
    return {t: server.client("a", transport=t) for t in TRANSPORTS}


def _check_reads(
    client: BlockClient,
    stored: list[bytes],
    payloads: list[bytes],
    lost: list[bool],
    absent: list[bytes],
) -> None:
    """Every read of one round answers, and answers what the live nodes hold."""
    for digest in absent:  # never stored: a miss wherever its node is
        assert client.get("alpha", MODEL, [digest]) == []
        assert client.lookup("alpha", MODEL, [digest]) == 0
    for digest, payload, gone in zip(stored, payloads, lost, strict=True):
        assert client.get("alpha", MODEL, [digest]) == ([] if gone else [payload])
        assert client.lookup("alpha", MODEL, [digest]) == (0 if gone else 1)
    leading = lost.index(True)
    assert client.get("alpha", MODEL, stored) == payloads[:leading]
    assert client.lookup("alpha", MODEL, stored) == leading


def _name_on(nodes: ClusterNodes, node: RedisNode, *, on: bool, prefix: bytes) -> bytes:
    """A key name whose slot is on `node` (`on`) or on another node."""
    for index in range(10_000):
        name = prefix + str(index).encode()
        if (nodes.node_of(name) == node.address) == on:
            return name
    raise AssertionError("no such key name in 10,000 tries")


@pytest.mark.parametrize("death", ["shutdown", "sigkill"])
def test_every_path_of_the_node_client_answers_failed_for_a_dead_node(
    tmp_path: Path, death: str
) -> None:
    with make_cluster(tmp_path / "redis") as cluster:
        seeds = tuple(HostPort("127.0.0.1", node.port) for node in cluster.nodes)
        config = RedisClusterConfig(nodes=seeds, retry_after_ms=0)  # every call tries it
        pooled = ClusterNodes(config)
        assert pooled.connect()
        dead = cluster.nodes[1]
        gone = _name_on(pooled, dead, on=True, prefix=b"v")
        kept = _name_on(pooled, dead, on=False, prefix=b"v")
        stream = _name_on(pooled, dead, on=True, prefix=b"s")
        script = pooled.register("return redis.call('EXISTS', KEYS[1])")
        for name in (gone, kept):  # a connection to each node, left in its pool
            assert pooled.run([(name, ("SET", name, b"value"))]) == [True]
        assert pooled.get([gone, kept], 1024) == [b"value", b"value"]
        assert pooled.run([(stream, ("XADD", stream, "*", "f", "v"))])[0] is not None
        entries = pooled.read_stream(stream, b"0-0", 8, 1, 1024)
        assert not isinstance(entries, Failed) and len(entries) == 1
        assert pooled.script(script, [gone], []) == 1
        assert pooled.problem() is None

        _end(cluster, dead, death)
        fresh = ClusterNodes(config)  # no connection to the dead node yet
        assert fresh.connect()
        try:
            for nodes in (pooled, fresh, pooled):  # the last: after its pooled one broke
                value, other = nodes.get([gone, kept], 1024)
                assert isinstance(value, Failed) and other == b"value"
                assert isinstance(nodes.read_stream(stream, b"0-0", 8, 1, 1024), Failed)
                written = nodes.run([(gone, ("SET", gone, b"x")), (kept, ("SET", kept, b"value"))])
                assert isinstance(written[0], Failed) and written[1] is True
                deleted = nodes.run([(gone, ("DEL", gone)), (kept, ("EXISTS", kept))])
                assert isinstance(deleted[0], Failed) and deleted[1] == 1
                assert isinstance(nodes.script(script, [gone], []), Failed)
                assert nodes.call(kept, "GET", kept) == b"value"  # the live nodes serve on
                problem = nodes.problem()
                assert problem is not None and dead.address in problem
        finally:
            fresh.close()
            pooled.close()


@pytest.mark.parametrize("death", ["shutdown", "sigkill"])
def test_a_node_dying_under_pooled_connections_costs_only_misses(
    tmp_path: Path, start_servers: Callable[..., Servers], death: str
) -> None:
    with make_cluster(tmp_path / "redis") as cluster:
        servers = start_servers(cluster, extra=EVERY_CALL_MEETS_IT)
        writer, reader = servers[0], servers[1]
        stored, payloads = blocks(24, 16 * KiB)
        put = writer.client("a", transport="grpc").put("alpha", MODEL, stored, payloads)
        assert put == [True] * 24
        servers.settle()
        dead = _victim(cluster, reader)
        lost = [_node_of(reader, d) == dead.address for d in stored]
        assert any(lost) and not all(lost)
        absent = _spread(reader, dead, 12)
        clients = _clients(reader)
        # Before: the reader (which holds none of these) reads everything through every
        # transport, so it holds pooled connections to every node, the dead one's too.
        for client in clients.values():
            assert client.get("alpha", MODEL, stored) == payloads
            assert all(client.get("alpha", MODEL, [d]) == [] for d in absent)

        # Mid-run: readers keep reading through each transport while the node dies.
        failed: list[str] = []
        rounds = dict.fromkeys(TRANSPORTS, 0)
        died, stop = threading.Event(), threading.Event()

        def keep_reading(transport: str) -> None:
            client = reader.client("a", transport=transport)
            try:
                while not stop.is_set():
                    after = died.is_set()
                    client.get("alpha", MODEL, stored)
                    client.lookup("alpha", MODEL, stored)
                    for digest in absent:
                        client.get("alpha", MODEL, [digest])
                    rounds[transport] += after
            except Exception as error:  # any failed call is what this test is about
                failed.append(f"{transport}: {type(error).__name__}: {error}")
            finally:
                client.close()

        threads = [threading.Thread(target=keep_reading, args=(t,)) for t in TRANSPORTS]
        for thread in threads:
            thread.start()
        _end(cluster, dead, death)
        died.set()
        while (
            not failed
            and min(rounds.values()) < ROUNDS_AFTER
            and any(t.is_alive() for t in threads)
        ):
            stop.wait(0.05)
        stop.set()
        for thread in threads:
            thread.join(timeout=120)
        assert failed == []
        assert min(rounds.values()) >= ROUNDS_AFTER

        # After: the reader's pooled connections (and the fresh ones that replace them),
        # and a server started after the death, whose pools for the dead node are empty.
        late = launch(servers.tenancy, data_dir=tmp_path / "late")
        try:
            for server in (reader, late):
                for transport, client in _clients(server).items():
                    fresh = _spread(server, dead, 6)  # never read by anyone
                    for _ in range(2):
                        _check_reads(client, stored, payloads, lost, absent + fresh)
                    new, new_payloads = blocks(6, 4 * KiB)
                    assert client.put("alpha", MODEL, new, new_payloads) == [True] * 6
                    assert client.get("alpha", MODEL, new) == new_payloads  # its local tiers
                    assert client.transport_stats.bulk_fallbacks == 0, transport
                    client.close()
            # Deletes: those whose blocks live on the other nodes succeed; one whose
            # block was on the dead node is UNAVAILABLE (the documented contract: retry
            # once the node is back), not INTERNAL.
            grpc_client = clients["grpc"]
            kept = next(d for d, gone in zip(stored, lost, strict=True) if not gone)
            assert grpc_client.delete("alpha", MODEL, [kept]) == 1
            assert grpc_client.get("alpha", MODEL, [kept]) == []
            on_dead = next(d for d, gone in zip(stored, lost, strict=True) if gone)
            with pytest.raises(Unavailable):
                grpc_client.delete("alpha", MODEL, [on_dead])
            assert tier_of(reader).counts()["failures"] > 0  # counted, as misses
        finally:
            late.stop()
        for client in clients.values():
            client.close()


def test_a_stopped_node_that_cannot_answer_costs_only_misses(
    tmp_path: Path, start_servers: Callable[..., Servers]
) -> None:
    """SIGSTOP: the node's port still takes connections but nothing answers on them;
    each call waits `timeout_ms` for it (twice when it connects: redis-py tries a
    connect twice), then answers a miss."""
    with make_cluster(tmp_path / "redis") as cluster:
        servers = start_servers(cluster, extra=EVERY_CALL_MEETS_IT + "\ntimeout_ms = 500")
        writer, reader = servers[0], servers[1]
        stored, payloads = blocks(12, 16 * KiB)
        put = writer.client("a", transport="grpc").put("alpha", MODEL, stored, payloads)
        assert put == [True] * 12
        servers.settle()
        dead = _victim(cluster, reader)
        lost = [_node_of(reader, d) == dead.address for d in stored]
        assert any(lost) and not all(lost)
        absent = _spread(reader, dead, 4)
        clients = _clients(reader)
        for client in clients.values():
            assert client.get("alpha", MODEL, stored) == payloads  # pooled connections
        assert dead.process is not None
        dead.process.send_signal(signal.SIGSTOP)
        try:
            for transport, client in clients.items():
                for digest in absent:
                    assert client.get("alpha", MODEL, [digest]) == []
                on_dead = [d for d, gone in zip(stored, lost, strict=True) if gone]
                assert client.get("alpha", MODEL, on_dead[:1]) == []
                assert client.lookup("alpha", MODEL, on_dead[:1]) == 0
                assert client.put("alpha", MODEL, *blocks(2, 4 * KiB)) == [True, True]
                assert client.transport_stats.bulk_fallbacks == 0, transport
        finally:
            dead.process.send_signal(signal.SIGCONT)
        for client in clients.values():
            client.close()
