"""Prometheus metrics of a real `kvshare serve`: counters equal the operations performed."""

from __future__ import annotations

import os
import re
import socket
import time
from pathlib import Path

import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from cacheserver.config import ServerConfig, StorageConfig, TelemetryConfig
from cacheserver.telemetry import ServerTelemetry
from cacheserver.telemetry_export import MAX_METRICS_CONNECTIONS, METRICS_CONNECTION_TIMEOUT_S
from kvcommon.errors import ResourceExhausted
from replica_agent.client import BlockClient
from tests.support.datafiles import flip_stored_byte
from tests.support.scrape import Samples, Series, parse, scrape_text, settled, value
from tests.support.servers import ServerProcess, launch, write_config

MODEL = "obs/model@r1;fp32;L2;H2;D8;B4;tp0/1"
SIZES = (1000, 2000, 3000, 4000)  # 10000 payload bytes per workload
METRICS_RE = re.compile(r"metrics on (\S+)")


def workload(client: BlockClient) -> None:
    """4 stored, 2 already present; lookups: 4 hits, 3 misses; gets: 4 served, 6 misses."""
    digests = [os.urandom(32) for _ in SIZES]
    payloads = [bytes([i + 1]) * size for i, size in enumerate(SIZES)]
    assert client.put("dev", MODEL, digests, payloads) == [True] * 4
    assert client.put("dev", MODEL, digests[:2], payloads[:2]) == [False] * 2
    assert client.lookup("dev", MODEL, [*digests, os.urandom(32), os.urandom(32)]) == 4
    assert client.lookup("dev", MODEL, [os.urandom(32)]) == 0
    assert client.get("dev", MODEL, [*digests, os.urandom(32)]) == payloads
    assert client.get("dev", MODEL, [os.urandom(32), *digests]) == []


def expected_store_counters(runs: int) -> dict[Series, float]:
    per_run = {
        ("kvshare_put_blocks_total", (("outcome", "stored"),)): 4,
        ("kvshare_put_blocks_total", (("outcome", "already_present"),)): 2,
        ("kvshare_stored_blocks_total", (("tier", "lmdb"),)): 4,
        ("kvshare_stored_bytes_total", (("tier", "lmdb"),)): sum(SIZES),
        ("kvshare_stored_blocks_total", (("tier", "memory"),)): 4,
        ("kvshare_stored_bytes_total", (("tier", "memory"),)): sum(SIZES),
        ("kvshare_lookups_total", ()): 2,
        ("kvshare_lookup_blocks_total", (("result", "hit"),)): 4,
        ("kvshare_lookup_blocks_total", (("result", "miss"),)): 3,
        ("kvshare_get_blocks_total", (("result", "hit"),)): 4,
        ("kvshare_get_blocks_total", (("result", "miss"),)): 6,
        ("kvshare_served_blocks_total", (("tier", "memory"),)): 4,
        ("kvshare_served_bytes_total", (("tier", "memory"),)): sum(SIZES),
        ("kvshare_served_blocks_total", (("tier", "lmdb"),)): 0,
        ("kvshare_tier_blocks", (("tier", "lmdb"),)): 4,
        ("kvshare_tier_bytes", (("tier", "lmdb"),)): sum(SIZES),
    }
    return {key: count * runs for key, count in per_run.items()}


def rpcs(**counts: int) -> dict[Series, float]:
    names = {
        "Put": "kvshare.v1.BlockStore/Put",
        "Lookup": "kvshare.v1.BlockStore/Lookup",
        "Get": "kvshare.v1.BlockStore/Get",
        "OpenBulk": "kvshare.v1.BlockStore/OpenBulk",
        "BulkHello": "kvshare.bulk/Hello",
        "BulkPut": "kvshare.bulk/Put",
        "BulkGet": "kvshare.bulk/Get",
        "BulkLookup": "kvshare.bulk/Lookup",
    }
    return {
        ("kvshare_rpc_requests_total", (("method", names[k]), ("status", "OK"))): n
        for k, n in counts.items()
    }


def assert_counts(samples: Samples, expected: dict[Series, float]) -> None:
    actual = {key: value(samples, key[0], **dict(key[1])) for key in expected}
    assert actual == expected


def serving_metrics(tmp_path: Path) -> tuple[ServerProcess, str]:
    """A dev-mode `kvshare serve` with a metrics port, and that port's address."""
    server = ServerProcess(
        "--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"),
        "--metrics-listen", "127.0.0.1:0",
    )  # fmt: skip
    found = [m.group(1) for line in server.startup_lines if (m := METRICS_RE.search(line))]
    assert found, server.startup_lines
    return server, found[0]


@pytest.mark.slow
def test_scraped_counters_equal_the_workload_over_grpc_and_bulk(tmp_path: Path) -> None:
    server, metrics = serving_metrics(tmp_path)
    try:

        def scrape() -> Samples:
            return parse(scrape_text(metrics))

        token = (tmp_path / "data" / "dev.token").read_text().strip()

        with BlockClient(server.address, token, bulk=False) as client:
            workload(client)
        expected = expected_store_counters(1) | rpcs(Put=2, Lookup=2, Get=2)
        assert_counts(settled(scrape, expected), expected)

        with BlockClient(server.address, token) as client:  # the bulk channel
            workload(client)
            arenas: dict[Series, float] = {
                ("kvshare_bulk_arenas", ()): 1.0
            }  # its same-host connection
            assert_counts(settled(scrape, arenas), arenas)
        deadline = time.monotonic() + 5  # given back when it closes (a thread notices)
        while value(scrape(), "kvshare_bulk_arenas") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert value(scrape(), "kvshare_bulk_arenas") == 0
        expected = expected_store_counters(2) | rpcs(
            Put=2, Lookup=2, Get=2, OpenBulk=1, BulkHello=1, BulkPut=2, BulkGet=2, BulkLookup=2
        )
        samples = settled(scrape, expected)
        assert_counts(samples, expected)
        assert value(samples, "kvshare_rpc_duration_seconds_count",
                     method="kvshare.bulk/Get", status="OK") == 2  # fmt: skip
        assert value(samples, "kvshare_health_serving") == 1
        assert not any(name.startswith("kvshare") and "tenant" in dict(labels)
                       for name, labels in samples)  # fmt: skip
    finally:
        server.terminate()


def test_evictions_rejections_and_integrity_failures_are_counted(tmp_path: Path) -> None:
    kib = 1 << 10
    tenancy = write_config(tmp_path, quotas={"beta": 8 * kib})
    storage = StorageConfig(memory_budget_bytes=32 * kib, disk_budget_bytes=64 * kib)
    telemetry_config = TelemetryConfig(per_tenant_labels=True)
    reader = InMemoryMetricReader()

    def counts() -> dict[Series, float]:
        out: dict[Series, float] = {}
        for resource in reader.get_metrics_data().resource_metrics:  # type: ignore[union-attr]
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    for point in metric.data.data_points:
                        attributes = point.attributes or {}
                        labels = tuple(sorted((k, str(v)) for k, v in attributes.items()))
                        out[(metric.name, labels)] = getattr(point, "value", 0)
        return out

    digests = [os.urandom(32) for _ in range(12)]
    payloads = [os.urandom(8 * kib) for _ in digests]  # 96 KiB into a 64 KiB disk budget
    telemetry = ServerTelemetry(telemetry_config, metric_readers=[reader])
    with launch(
        tenancy, server_telemetry=telemetry, storage=storage, telemetry=telemetry_config
    ) as running:
        with running.client("a", bulk=False) as a, running.client("b", bulk=False) as b:
            for i in range(12):
                a.put("alpha", MODEL, digests[i : i + 1], payloads[i : i + 1])
            with pytest.raises(ResourceExhausted):
                b.put("beta", MODEL, [os.urandom(32)], [os.urandom(9 * kib)])  # over beta's quota
            assert a.get("alpha", MODEL, digests[4:6]) == payloads[4:6]  # from disk
        got = counts()
    assert got[("kvshare.evictions", (("reason", "budget"), ("tier", "lmdb")))] == 4
    assert got[("kvshare.evicted.bytes", (("reason", "budget"), ("tier", "lmdb")))] == 32 * kib
    assert got[("kvshare.evictions", (("reason", "budget"), ("tier", "memory")))] >= 8
    assert got[("kvshare.quota.rejections", (("tenant", "beta"),))] == 1
    assert got[("kvshare.served.blocks", (("tenant", "alpha"), ("tier", "lmdb")))] == 2
    assert got[("kvshare.tenant.quota.bytes", (("tenant", "beta"),))] == 8 * kib
    assert got[("kvshare.tenant.bytes", (("tenant", "alpha"),))] == 64 * kib

    flip_stored_byte(running.data_dir / "lmdb" / "data.mdb", payloads[-1][:4096], 100)
    reader = InMemoryMetricReader()
    telemetry = ServerTelemetry(telemetry_config, metric_readers=[reader])
    with launch(
        tenancy, server_telemetry=telemetry, storage=storage, telemetry=telemetry_config
    ) as running:
        with running.client("a") as a:
            assert a.get("alpha", MODEL, digests[-1:]) == []  # corrupt: a miss
        assert (
            counts()[("kvshare.integrity.failures", (("tenant", "alpha"), ("tier", "lmdb")))] == 1
        )


def test_no_exporter_by_default() -> None:
    telemetry = ServerTelemetry(ServerConfig().telemetry)
    assert telemetry.start() == ""  # nothing listens
    telemetry.shutdown()


@pytest.mark.slow
def test_idle_connections_to_the_metrics_port_hold_no_threads(tmp_path: Path) -> None:
    """The metrics port answers without authentication: idle connections are let go
    after a few seconds and at most a few are served at once, so a flood of them
    cannot pile up server threads (it kept one thread per idle connection before)."""
    server, metrics = serving_metrics(tmp_path)
    try:
        assert "kvshare_" in scrape_text(metrics)  # positive control: the port serves
        threads = len(list(Path(f"/proc/{server.proc.pid}/task").iterdir()))
        host, _, port = metrics.rpartition(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(100)]
        time.sleep(1.0)
        during = len(list(Path(f"/proc/{server.proc.pid}/task").iterdir()))
        assert during <= threads + MAX_METRICS_CONNECTIONS + 4  # + the server's own churn
        deadline = time.monotonic() + METRICS_CONNECTION_TIMEOUT_S + 10
        for sock in idle:  # each is closed by the server (at once, or at its timeout)
            sock.settimeout(max(0.1, deadline - time.monotonic()))
            assert sock.recv(1) == b""
            sock.close()
        assert "kvshare_" in scrape_text(metrics)  # and scrapes go on
    finally:
        server.terminate()
