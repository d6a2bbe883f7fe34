"""`kvshare bench` end to end: real servers, real client processes, tiny sizes.

These are smoke runs of the harness and its JSON contract (docs/design.md §8), not timed
tests: no figure is asserted beyond being positive.
"""

from __future__ import annotations

import dataclasses
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from kvshare.bench.peers import kvshare_peer
from kvshare.bench.peers.base import BenchError
from kvshare.bench.peers.kvshare_peer import KvshareSystem
from kvshare.bench.peers.lmcache_peer import find_lmcache_python
from tests.support.bench import TINY, assert_contract, by_system, json_run, run_bench


def _assert_server_cpu(row: dict[str, Any]) -> None:
    """The server's CPU per call was read (not timed: only positive and finite)."""
    cpu = row["server_cpu_us_per_call"]
    assert cpu is not None and cpu > 0 and math.isfinite(cpu), row


@pytest.mark.slow
def test_json_contract_for_the_tcp_ceiling() -> None:
    document = json_run("--systems", "tcp")
    rows = by_system(document)
    assert set(rows) == {("tcp", "get"), ("tcp", "put"), ("tcp-batch", "get"), ("tcp", "lookup")}
    for row in document["results"]:
        assert_contract(row)
        _assert_server_cpu(row)
        assert row["value_bytes"] == 16 * 1024 or row["blocks_per_call"] > 1
        assert row["clients"] == 1
        assert row["ratio_to_tcp"] == 1.0
        assert row["topology"] == "loopback"  # docs/design.md §8: every row says where it ran
    assert rows[("tcp-batch", "get")]["blocks_per_call"] == 4
    assert document["failed"] == {}


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server not installed")
def test_redis_runs_beside_tcp_with_ratios() -> None:
    document = json_run("--systems", "tcp,redis", "--clients", "2")
    rows = by_system(document)
    assert {("redis", "get"), ("redis", "put"), ("redis-batch", "get")} <= set(rows)
    for row in document["results"]:
        assert_contract(row)
        _assert_server_cpu(row)
        assert row["clients"] == 2
    assert rows[("redis", "get")]["ratio_to_tcp"] > 0
    assert rows[("redis", "lookup")]["ratio_to_tcp"] > 0  # EXISTS beside the ceiling's


@pytest.mark.slow
def test_kvshare_its_transports_and_security_variants() -> None:
    document = json_run("--systems", "tcp,kvshare,kvshare-tcp,kvshare-tls-sealed")
    assert document["failed"] == {} and document["skipped"] == {}
    rows = by_system(document)
    for system in ("kvshare", "kvshare-tcp", "kvshare-tls-sealed"):
        for op in ("get", "put", "lookup"):
            assert_contract(rows[(system, op)])
            _assert_server_cpu(rows[(system, op)])
        assert rows[(f"{system}-batch", "get")]["blocks_per_call"] == 4
        _assert_server_cpu(rows[(f"{system}-batch", "get")])
    assert rows[("kvshare-tls-sealed", "get")]["ratio_to_kvshare-tcp"] > 0
    assert rows[("kvshare-tcp", "get")]["ratio_to_kvshare"] > 0
    notes = {check["note"] for check in document["checks"]}
    assert {"cost of TLS and sealing", "TCP instead of the same-host arena"} <= notes


@pytest.mark.slow
def test_more_clients_than_the_default_arena_cap_use_the_bulk_channel() -> None:
    """9 client processes: past the server's default 8 same-host arenas per principal.
    The run fails if a cell fell back to gRPC or a client was refused an arena."""
    document = json_run("--systems", "kvshare", "--clients", "9", "--batch-blocks", "0")
    assert document["failed"] == {}, document["failed"]
    rows = by_system(document)
    assert set(rows) == {("kvshare", "get"), ("kvshare", "put"), ("kvshare", "lookup")}
    for row in rows.values():
        assert row["clients"] == 9
        assert_contract(row)
        _assert_server_cpu(row)


def test_a_client_refused_an_arena_fails_its_cell(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Positive control of the check above: a server with one arena for the principal,
    two same-host clients; the second gets TCP, and its next cell's set-up refuses."""
    monkeypatch.setattr(kvshare_peer, "MAX_BULK_CONNECTIONS", 1)
    system = KvshareSystem()
    spec = system.start(tmp_path)
    clients = [spec.connect() for _ in range(2)]
    try:
        for client in clients:
            client.put([bytes(32)], [memoryview(b"x" * 1000)])
        clients[0].prepare(1000, 1)
        with pytest.raises(BenchError, match="refused an arena and used TCP"):
            clients[1].prepare(1000, 1)
    finally:
        for client in clients:
            client.close()
        system.stop()


@pytest.mark.skipif(find_lmcache_python(None) is None, reason="no LMCache venv (setup_lmcache.sh)")
def test_lmcache_server_speaks_its_protocol() -> None:
    document = json_run("--systems", "lmcache")
    assert document["failed"] == {}, document["failed"]
    rows = by_system(document)
    for op in ("get", "put", "lookup"):
        assert_contract(rows[("lmcache", op)])
        _assert_server_cpu(rows[("lmcache", op)])


def test_a_missing_peer_is_skipped_with_a_note() -> None:
    document = json_run("--systems", "tcp,lmcache", "--lmcache-python", "/nonexistent/python")
    assert "lmcache" in document["skipped"]
    assert {row["system"] for row in document["results"]} == {"tcp", "tcp-batch"}


def test_lookup_rows_can_be_left_out() -> None:
    document = json_run("--systems", "tcp", "--lookup-blocks", "0", "--batch-blocks", "0")
    assert {row["op"] for row in document["results"]} == {"get", "put"}


def test_table_on_stdout_and_progress_on_stderr() -> None:
    result = run_bench(*TINY, "--systems", "tcp", "--batch-blocks", "0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "MB/s" in result.stdout and "x tcp" in result.stdout
    assert "Targets:" in result.stdout
    assert "round 1/1 tcp: starting server" in result.stderr
    assert "tcp-batch" not in result.stdout


@pytest.mark.slow
def test_kvshare_cells_that_fell_back_to_grpc_fail_the_run(tmp_path: Path) -> None:
    system = KvshareSystem(same_host=False)
    spec = system.start(tmp_path)
    try:
        client = spec.connect()
        client.put([bytes(32)], [memoryview(b"x" * 1000)])
        assert len(client.get([bytes(32)])) == 1
        client.close()
        assert system.clear() is False  # positive control: the bulk channel carried it
        fallen_back = dataclasses.replace(spec, bulk=False).connect()  # as after a failure
        assert len(fallen_back.get([bytes(32)])) == 1
        fallen_back.close()
        with pytest.raises(BenchError, match="1 gets/puts went over gRPC"):
            system.clear()
    finally:
        system.stop()
