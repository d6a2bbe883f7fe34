"""Several kvshare servers over a real Redis Cluster on loopback
(kvshare.bench.redis_cluster): the servers of one config (`Servers`), a cluster a test
kills nodes of (`make_cluster`), the cluster's own view of what it holds, health checks."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheserver.tiers.cluster.tier import ClusterTier
from kvshare.bench.redis_cluster import LocalRedisCluster, unavailable_reason
from tests.support.servers import Running, Tenancy

MODEL = "cluster/model"


KiB = 1024


def make_cluster(directory: Path, *, replicas: int = 0) -> LocalRedisCluster:
    reason = unavailable_reason()
    if reason is not None:
        pytest.fail(f"the cluster tests need Redis: {reason}")  # CI installs it (.ci/run)
    return LocalRedisCluster(directory, primaries=3, replicas=replicas)


@dataclass
class Servers:
    tenancy: Tenancy
    running: list[Running]

    def __getitem__(self, index: int) -> Running:
        return self.running[index]

    def settle(self) -> None:
        """Every server's writes and touches have reached the cluster."""
        for server in self.running:
            if not server.stopped:
                assert tier_of(server).sharing.flush(30)


def tier_of(running: Running) -> ClusterTier:
    server = running.server.server
    assert server is not None
    (tier,) = (t for t in server.tier_stack.behind if isinstance(t, ClusterTier))
    return tier


def cluster_config(tmp_path: Path, seeds: list[str], extra: str = "") -> str:
    """Top-level lines naming a shared secret and the cluster (for write_config)."""
    secret = tmp_path / "server.secret"
    if not secret.exists():
        secret.write_bytes(os.urandom(32))
        secret.chmod(0o600)
    nodes = ", ".join(f'"{seed}"' for seed in seeds)
    return f'secret_file = "{secret}"\n[redis_cluster]\nnodes = [{nodes}]\n{extra}\n'


def blocks(count: int, size: int = 64 * KiB) -> tuple[list[bytes], list[bytes]]:
    """`count` random digests and payloads."""
    return [secrets.token_bytes(32) for _ in range(count)], [os.urandom(size) for _ in range(count)]


def direct(cluster: LocalRedisCluster) -> redis.RedisCluster:
    """redis-py's own cluster client: what a Redis operator's tools do."""
    return redis.RedisCluster(host="127.0.0.1", port=cluster.nodes[0].port)


def primaries(cluster: LocalRedisCluster) -> list[redis.Redis]:
    """A plain client of each primary node (to look at what the cluster holds)."""
    return [redis.Redis(port=node.port) for node in cluster.primary_nodes()]


def cluster_contents(cluster: LocalRedisCluster) -> dict[bytes, object]:
    """Every key in the cluster and its value (strings, sets, zsets, hashes, streams)."""
    out: dict[bytes, object] = {}
    for client in primaries(cluster):
        for name in client.scan_iter(count=1000):
            kind = client.type(name)
            if kind == b"string":
                out[name] = client.get(name)
            elif kind == b"zset":
                out[name] = client.zrange(name, 0, -1)
            elif kind == b"hash":
                out[name] = client.hgetall(name)
            elif kind == b"set":
                out[name] = client.smembers(name)
            elif kind == b"stream":
                out[name] = client.xrange(name)
        client.close()
    return out


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


def health(address: str, service: str) -> int:
    """The health status the server reports for `service` ("" is the server's own)."""
    with grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        return int(check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)


SERVING = health_pb2.HealthCheckResponse.SERVING


NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
