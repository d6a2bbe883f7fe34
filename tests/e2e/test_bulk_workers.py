"""Bulk workers (`[bulk] workers = N`): reads served by a second process, everything
else handed back to the server, with the guarantees of a single process: isolation,
one rate per principal, deletes, and a worker that dies replaced.

Connections are shared in turn: with 2 processes the server keeps the 1st, 3rd, ...
plain-TCP bulk connection and hands the 2nd, 4th, ... to the worker. Each test opens
two clients (one connection each, on the bulk channel over TCP) so one is the
worker's; `served_by_workers` says that the worker answered (its reports arrived)."""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from cacheserver.config import BulkConfig
from cacheserver.store.writer import HANDED_BACK_READS_HOLD_S
from cacheserver.transport.bulk.delegation import REPORT_INTERVAL_S
from kvcommon.errors import PermissionDenied, ResourceExhausted
from tests.support.bulk_workers import MODEL, assembly, pair, served_by_workers, wait_in_lmdb
from tests.support.servers import Running, run_cli

BLOCK = 64 << 10


def rate_limited(start_server: Callable[..., Running]) -> tuple[Running, bytes]:
    """Two processes, 10 requests/s (burst 1 s) per principal, one block stored in LMDB."""
    running = start_server(
        bulk=BulkConfig(workers=2), extra="[limits]\nrequests_per_s = 10\nrequest_burst_s = 1"
    )
    digest = os.urandom(32)
    with running.client("root", bulk=False) as root:
        root.put("alpha", MODEL, [digest], [b"x"])
    wait_in_lmdb(running)
    return running, digest


@pytest.fixture
def two(start_server: Callable[..., Running]) -> Running:
    return start_server(bulk=BulkConfig(workers=2))


def test_reads_are_served_by_the_worker_and_writes_handed_back(two: Running) -> None:
    digests = [os.urandom(32) for _ in range(4)]
    payloads = [os.urandom(BLOCK) for _ in digests]
    main, worker = pair(two, "a")
    with main, worker:
        # A put on the worker's connection is handed back: the server stores it.
        assert worker.put("alpha", MODEL, digests, payloads) == [True] * 4
        # Read at once: the blocks may be only in the journal, which the worker does
        # not read, so this is handed back too, and still hits.
        assert worker.get("alpha", MODEL, digests) == payloads
        wait_in_lmdb(two)
        before = assembly(two).processes.reports
        for _ in range(5):
            assert worker.lookup("alpha", MODEL, digests) == 4
            assert worker.get("alpha", MODEL, digests) == payloads
            assert worker.get("alpha", MODEL, digests[2:]) == payloads[2:]
        assert served_by_workers(two, before), "the worker served none of the reads"
        # Misses are handed back and answered by the server, exactly.
        assert worker.lookup("alpha", MODEL, [*digests, os.urandom(32)]) == 4
        assert worker.get("alpha", MODEL, [*digests[:1], os.urandom(32)]) == payloads[:1]
        assert main.get("alpha", MODEL, digests) == payloads
        assert worker.transport_stats.bulk_fallbacks == 0
    # What the worker served counts in the server's Stats, as its own reads do.
    with two.client("a", bulk=False) as grpc_only:
        alpha = next(t for t in grpc_only.stats().tenants if t.tenant == "alpha")
    assert alpha.blocks_served >= 5 * (4 + 2)
    assert alpha.lookups >= 5


@pytest.mark.slow
def test_another_tenant_misses_on_the_worker_while_the_owner_hits(two: Running) -> None:
    digests = [os.urandom(32) for _ in range(3)]
    payloads = [os.urandom(BLOCK) for _ in digests]
    a_main, a_worker = pair(two, "a")
    b_main, b_worker = pair(two, "b")  # the 4th connection: the worker's too
    with a_main, a_worker, b_main, b_worker:
        a_main.put("alpha", MODEL, digests, payloads)
        wait_in_lmdb(two)
        before = assembly(two).processes.reports
        # Positive control: the owner's reads hit on the worker's connection.
        assert a_worker.get("alpha", MODEL, digests) == payloads
        assert a_worker.lookup("alpha", MODEL, digests) == 3
        assert served_by_workers(two, before)
        # The same digests in tenant beta: other names, an ordinary miss, on both.
        for client in (b_worker, b_main):
            assert client.lookup("beta", MODEL, digests) == 0
            assert client.get("beta", MODEL, digests) == []
        # A principal bound to beta cannot name alpha at all.
        with pytest.raises(PermissionDenied):
            b_worker.get("alpha", MODEL, digests)


def test_a_delete_is_seen_by_the_worker_at_once(two: Running) -> None:
    digests = [os.urandom(32) for _ in range(2)]
    payloads = [os.urandom(BLOCK) for _ in digests]
    main, worker = pair(two, "a")
    with main, worker:
        main.put("alpha", MODEL, digests, payloads)
        wait_in_lmdb(two)
        assert worker.get("alpha", MODEL, digests) == payloads  # control
        with two.client("root", bulk=False) as root:
            assert root.delete("alpha", MODEL, digests) == 2
        assert worker.lookup("alpha", MODEL, digests) == 0
        assert worker.get("alpha", MODEL, digests) == []


@pytest.mark.slow
def test_one_rate_holds_across_the_server_and_its_worker(
    start_server: Callable[..., Running],
) -> None:
    running, digest = rate_limited(start_server)
    time.sleep(1.2)  # the bucket refills after the clients' OpenBulks and first lookups
    main, worker = pair(running, "a")
    with main, worker:
        time.sleep(1.2)
        served = 0
        started = time.monotonic()
        with pytest.raises(ResourceExhausted):
            for _ in range(100):
                for client in (main, worker):
                    assert client.lookup("alpha", MODEL, [digest]) == 1
                    served += 1
        elapsed = time.monotonic() - started
    # One bucket of 10 (burst 1 s) refilling at 10/s: two unshared buckets would serve
    # about twice as many before the first refusal.
    assert served <= 10 + 10 * elapsed + 2, (served, elapsed)


@pytest.mark.slow
def test_a_killed_worker_is_replaced_and_its_clients_reconnect(two: Running) -> None:
    digests = [os.urandom(32) for _ in range(2)]
    payloads = [os.urandom(BLOCK) for _ in digests]
    workers = assembly(two).processes
    [old] = workers.pids()
    main, worker = pair(two, "a")
    with main, worker:
        main.put("alpha", MODEL, digests, payloads)
        wait_in_lmdb(two)
        assert worker.get("alpha", MODEL, digests) == payloads
        os.kill(old, signal.SIGKILL)
        # The client on the dead worker's connection gets its blocks anyway (a retry on
        # a new connection, or gRPC): inference never fails because a worker died.
        assert worker.get("alpha", MODEL, digests) == payloads
        deadline = time.monotonic() + 10
        while workers.pids() in ([], [old]) and time.monotonic() < deadline:
            time.sleep(0.05)
        [new] = workers.pids()
        assert new != old
    # The new worker serves new connections.
    time.sleep(0.2)
    before = workers.reports
    main, worker = pair(two, "a")
    with main, worker:
        for client in (main, worker):
            assert client.get("alpha", MODEL, digests) == payloads
    assert served_by_workers(two, before)


def test_workers_is_checked(tmp_path: Path) -> None:
    for bad in ("-1", "65"):
        result = run_cli(
            "serve", "--data-dir", str(tmp_path / "data"), "--listen", "127.0.0.1:0",
            "--bulk-workers", bad,
        )  # fmt: skip
        assert result.returncode != 0
        assert "--bulk-workers" in result.stderr, result.stderr


@pytest.mark.slow
def test_a_connection_that_only_puts_is_given_back_to_the_server(two: Running) -> None:
    from cacheserver.transport.bulk.delegation import GIVE_BACK_AFTER_PUTS

    digests = [os.urandom(32) for _ in range(GIVE_BACK_AFTER_PUTS + 2)]
    payloads = [os.urandom(4096) for _ in digests]
    main, worker = pair(two, "a")
    with main, worker:
        main.put("alpha", MODEL, digests[:1], payloads[:1])
        wait_in_lmdb(two)
        before = assembly(two).processes.reports
        assert worker.get("alpha", MODEL, digests[:1]) == payloads[:1]  # control: the worker's
        assert served_by_workers(two, before)
        for digest, payload in zip(digests[1:], payloads[1:], strict=True):
            assert worker.put("alpha", MODEL, [digest], [payload]) == [True]
        wait_in_lmdb(two)
        time.sleep(2 * REPORT_INTERVAL_S)  # any report of the control's read has arrived
        before = assembly(two).processes.reports
        loop = (
            two.server.server.bulk.ready if two.server.server and two.server.server.bulk else None
        )
        assert loop is not None
        inline_before = loop.inline_requests
        # Puts in a row: the worker gave the connection back; the server serves it now,
        # on its ready loop (not a thread of its own: a connection that writes is served
        # as one that never went to a worker is).
        for _ in range(3):
            assert worker.get("alpha", MODEL, digests) == payloads
            assert worker.lookup("alpha", MODEL, digests) == len(digests)
        assert not served_by_workers(two, before, timeout_s=1.0)
        assert loop.inline_requests >= inline_before + 6
        assert worker.transport_stats.bulk_fallbacks == 0


def test_a_connection_given_back_goes_to_a_worker_again_once_it_reads(two: Running) -> None:
    from cacheserver.transport.bulk.delegation import GIVE_BACK_AFTER_PUTS, REDELEGATE_AFTER_READS

    digests = [os.urandom(32) for _ in range(GIVE_BACK_AFTER_PUTS)]
    payloads = [os.urandom(4096) for _ in digests]
    main, worker = pair(two, "a")
    with main, worker:
        for digest, payload in zip(digests, payloads, strict=True):  # given back
            assert worker.put("alpha", MODEL, [digest], [payload]) == [True]
        wait_in_lmdb(two)
        for _ in range(REDELEGATE_AFTER_READS):  # served by the server; then handed over
            assert worker.get("alpha", MODEL, digests) == payloads
        time.sleep(2 * REPORT_INTERVAL_S)
        before = assembly(two).processes.reports
        for _ in range(3):
            assert worker.get("alpha", MODEL, digests) == payloads
        assert served_by_workers(two, before)
        assert worker.transport_stats.bulk_fallbacks == 0


@pytest.mark.slow
def test_puts_reach_lmdb_while_busy_once_the_worker_hands_a_read_back(two: Running) -> None:
    """Puts alone wait for a pause, as without workers (draining them while they
    arrive costs the server CPU that no worker asked for); once the worker hands back
    a read of a block still in the journal, journaled puts move into LMDB within the
    bound although requests never pause."""
    digests = [os.urandom(32) for _ in range(4)]
    payloads = [os.urandom(4096) for _ in digests]
    stop, going = threading.Event(), threading.Event()

    def keep_busy() -> None:  # gRPC lookups: the server's own, never a worker's
        with two.client("a", bulk=False) as busy:
            while not stop.is_set():
                busy.lookup("alpha", MODEL, digests[:1])
                going.set()

    main, worker = pair(two, "a")  # its reads missed and were handed back: wait that out
    time.sleep(HANDED_BACK_READS_HOLD_S + 0.2)
    busy = threading.Thread(target=keep_busy)
    # The server runs in this process, whose heap every earlier test grew: a full
    # collection (~0.3 s here) would stall its requests and make the store look idle.
    gc.collect()
    gc.disable()
    try:
        busy.start()
        assert going.wait(10)  # its first call (the channel's set-up) is behind it
        with main, worker:
            assert main.put("alpha", MODEL, digests, payloads) == [True] * 4
            time.sleep(0.5)
            assert two.store.undrained_blocks == 4  # puts alone: the server is never idle
            assert worker.get("alpha", MODEL, digests[:1]) == payloads[:1]  # handed back
            deadline = time.monotonic() + 5
            while two.store.undrained_blocks and time.monotonic() < deadline:
                time.sleep(0.01)
            assert two.store.undrained_blocks == 0
            assert busy.is_alive()  # still busy all along
    finally:
        gc.enable()
        stop.set()
        busy.join()


@pytest.mark.slow
def test_a_large_get_is_handed_back_and_a_small_one_is_the_workers(two: Running) -> None:
    from cacheserver.transport.bulk.readworker import MAX_GET_BYTES

    large = [os.urandom(32) for _ in range(2)]
    large_payloads = [os.urandom(MAX_GET_BYTES // 2 + 4096) for _ in large]
    small, small_payload = os.urandom(32), os.urandom(4096)
    main, worker = pair(two, "a")
    with main, worker:
        main.put("alpha", MODEL, [*large, small], [*large_payloads, small_payload])
        wait_in_lmdb(two)
        time.sleep(2 * REPORT_INTERVAL_S)
        before = assembly(two).processes.reports
        for _ in range(3):  # more than MAX_GET_BYTES together: the server's
            assert worker.get("alpha", MODEL, large) == large_payloads
        assert not served_by_workers(two, before, timeout_s=1.0)
        assert worker.get("alpha", MODEL, large[:1]) == large_payloads[:1]  # one fits
        assert worker.get("alpha", MODEL, [small]) == [small_payload]
        assert served_by_workers(two, before)


def test_calls_a_worker_served_are_counted_in_the_servers_metrics(
    start_server: Callable[..., Running],
) -> None:
    from cacheserver.config import TelemetryConfig
    from tests.support.scrape import parse, scrape_text, value

    running = start_server(
        bulk=BulkConfig(workers=2), telemetry=TelemetryConfig(metrics_listen="127.0.0.1:0")
    )
    assert running.server.server is not None
    metrics = running.server.server.metrics_address

    def calls(method: str) -> float:
        samples = parse(scrape_text(metrics))
        return value(samples, "kvshare_rpc_requests_total", method=method, status="OK")

    digests = [os.urandom(32) for _ in range(2)]
    payloads = [os.urandom(4096) for _ in digests]
    main, worker = pair(running, "a")
    with main, worker:
        main.put("alpha", MODEL, digests, payloads)
        wait_in_lmdb(running)
        time.sleep(2 * REPORT_INTERVAL_S)
        before_get, before_lookup = calls("kvshare.bulk/Get"), calls("kvshare.bulk/Lookup")
        reports = assembly(running).processes.reports
        for _ in range(5):
            assert worker.get("alpha", MODEL, digests) == payloads
            assert worker.lookup("alpha", MODEL, digests) == 2
        assert served_by_workers(running, reports)  # control: the worker answered them
        deadline = time.monotonic() + 10  # until every report of them arrived
        while calls("kvshare.bulk/Get") - before_get < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(2 * REPORT_INTERVAL_S)  # nothing more arrives: each call counted once
        assert calls("kvshare.bulk/Get") - before_get == 5
        assert calls("kvshare.bulk/Lookup") - before_lookup == 5


@pytest.mark.slow
def test_a_rate_refusal_met_first_by_the_worker_is_still_audited(
    start_server: Callable[..., Running],
) -> None:
    from policy.audit import read_records

    running, digest = rate_limited(start_server)
    main, worker = pair(running, "a")
    with main, worker:
        time.sleep(1.2)  # a full bucket
        reports = assembly(running).processes.reports
        with pytest.raises(ResourceExhausted):
            for _ in range(100):  # only the worker's connection: the worker draws first
                assert worker.lookup("alpha", MODEL, [digest]) == 1
        assert served_by_workers(running, reports)  # control: the worker drew them
    running.stop()
    limited = [
        r for r in read_records(running.config.audit_log_path) if r["event"] == "rate_limited"
    ]
    assert [r["principal"] for r in limited] == ["a"]  # the episode's one record
