"""Several kvshare servers over a real Redis Cluster on loopback (kvshare.bench.redis_cluster).

`redis_cluster`: 3 primaries, started once per module and emptied before each test;
tests that kill nodes start their own (`make_cluster`). `start_servers` writes one config
(tenants `alpha`, `beta`, principals `a`, `b`, `root`; one shared `secret_file`; the
cluster) and starts servers from it, each with its own data dir, as real deployments
do: same tenants, principals and secret, one store.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshare.bench.redis_cluster import LocalRedisCluster
from tests.support.cluster import (
    Servers,
    cluster_config,
    make_cluster,
)
from tests.support.servers import Running, launch, write_config


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    with make_cluster(tmp_path_factory.mktemp("redis")) as cluster:
        yield cluster


@pytest.fixture
def cluster(redis_cluster: LocalRedisCluster) -> LocalRedisCluster:
    redis_cluster.flushall()
    return redis_cluster


@pytest.fixture
def start_servers(tmp_path: Path) -> Iterator[Callable[..., Servers]]:
    """`start_servers(cluster, count=2, quotas=..., extra=...)`: servers of one config."""
    started: list[Running] = []

    def start(
        cluster: LocalRedisCluster | list[str],
        count: int = 2,
        *,
        quotas: dict[str, int] | None = None,
        extra: str = "",
        **replace: Any,
    ) -> Servers:
        seeds = cluster if isinstance(cluster, list) else cluster.seeds
        tenancy = write_config(
            tmp_path, quotas=quotas, extra=cluster_config(tmp_path, seeds, extra)
        )
        running = []
        for _ in range(count):
            server = launch(tenancy, data_dir=tmp_path / f"data{len(started)}", **replace)
            started.append(server)
            running.append(server)
        return Servers(tenancy, running)

    yield start
    for server in started:
        server.stop()
