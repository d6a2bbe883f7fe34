"""`[limits]` changed by a live reload, end to end: a real server with a bulk read
worker (`[bulk] workers = 2`), real LMDB, real clients. A lowered max_digests_per_call
is refused on the next request of every transport (gRPC, bulk TCP, same-host, and a
connection a worker serves, delegated before the reload: the server sends each worker
the new limits); a principal a reload adds draws from one rate bucket in every process.
What stays restart-only: tests/unit/cacheserver/test_reload_checks.py."""

from __future__ import annotations

import time
from pathlib import Path

import grpc
import pytest

from kvcommon.errors import InvalidArgument, ResourceExhausted
from replica_agent.client import BlockClient
from tests.support.bulk_workers import assembly, served_by_workers, wait_in_lmdb
from tests.support.reload import MODEL, Grant, LiveConfig, digest, reload, seconds_until, start
from tests.support.servers import Running

WITHIN_S = 1.0  # the bound for a reload to hold on every path
BLOCKS = 8
WORKERS = "[bulk]\nworkers = 2\n"


def config(directory: Path, limits: str = "") -> LiveConfig:
    return LiveConfig(
        directory,
        {"alpha": 0},
        {
            "a": Grant(["alpha"], ["read", "write"]),
            "root": Grant(["alpha"], ["read", "write", "admin"]),
        },
        WORKERS + limits,
    )


@pytest.fixture
def live(tmp_path: Path) -> LiveConfig:
    return config(tmp_path)


def stored(running: Running) -> list[bytes]:
    """BLOCKS blocks of alpha, committed in LMDB (so a worker answers their reads)."""
    digests = [digest("limits", i) for i in range(BLOCKS)]
    with running.client("root", transport="grpc") as root:
        root.put("alpha", MODEL, digests, [bytes([i]) * 4096 for i in range(BLOCKS)])
    wait_in_lmdb(running)
    return digests


def worker_pair(running: Running, who: str = "a") -> tuple[BlockClient, BlockClient]:
    """Two bulk TCP clients of `who`, each connection open: the first the server's, the
    second a worker's (connections go to the processes in turn)."""
    first = running.client(who, transport="bulk-tcp", timeout_s=10)
    second = running.client(who, transport="bulk-tcp", timeout_s=10)
    for client in (first, second):  # a GET opens the connection every later call uses
        assert client.get("alpha", MODEL, [digest("miss", 0)]) == []
    return first, second


def refused_for_digests(client: BlockClient, digests: list[bytes]) -> bool:
    """The lookup is refused for its digest count (INVALID_ARGUMENT naming the limit);
    False: answered."""
    try:
        client.lookup("alpha", MODEL, digests)
    except InvalidArgument as error:
        assert "max_digests_per_call" in str(error), error
        return True
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
        assert "max_digests_per_call" in str(error.details()), error
        return True
    return False


def lower_max_digests(running: Running, live: LiveConfig, to: int) -> None:
    live.extra = f"{WORKERS}[limits]\nmax_digests_per_call = {to}\n"
    live.write()
    reply = reload(running, live)
    assert reply.applied, reply.message


def test_a_lowered_max_digests_is_refused_on_every_transport_and_a_worker_connection(
    running: Running, live: LiveConfig
) -> None:
    digests = stored(running)
    main, worker = worker_pair(running)
    grpc_client = running.client("a", transport="grpc", timeout_s=10)
    same_host = running.client("a", transport="bulk-same-host", timeout_s=10)
    clients = {"grpc": grpc_client, "bulk-tcp": main, "same-host": same_host, "worker": worker}
    try:
        # Positive control: 8 digests are served on every path, the worker's included
        # (its report reaches the server).
        before = assembly(running).processes.reports
        for name, client in clients.items():
            assert client.lookup("alpha", MODEL, digests) == BLOCKS, name
        assert served_by_workers(running, before)
        lower_max_digests(running, live, BLOCKS // 2)
        for name in ("grpc", "bulk-tcp", "same-host"):  # the server's own: at once
            assert refused_for_digests(clients[name], digests), name
        # The worker's connection was delegated with the old limit; the server's update
        # reaches the worker's control socket within the bound.
        assert seconds_until(lambda: refused_for_digests(worker, digests)) < WITHIN_S
        # Within the new limit, each path serves on (fresh connections: a refusal
        # closes a bulk connection).
        with running.client("a", transport="bulk-tcp") as again:
            assert again.lookup("alpha", MODEL, digests[: BLOCKS // 2]) == BLOCKS // 2
        assert grpc_client.lookup("alpha", MODEL, digests[: BLOCKS // 2]) == BLOCKS // 2
    finally:
        for client in clients.values():
            client.close()


def test_a_delegated_connection_takes_a_lowered_limit_within_a_second(
    running: Running, live: LiveConfig
) -> None:
    """The worker itself applies the new limit: the connection stays the worker's, and
    a request within the new limit is still served there, not handed back."""
    digests = stored(running)
    main, worker = worker_pair(running)
    with main, worker:
        before = assembly(running).processes.reports
        assert worker.lookup("alpha", MODEL, digests) == BLOCKS  # the old limit: served
        assert served_by_workers(running, before)
        lower_max_digests(running, live, 2)
        elapsed = seconds_until(lambda: refused_for_digests(worker, digests[:3]))
        assert elapsed < WITHIN_S
    # A new worker connection is delegated with the new limit; 2 digests it serves.
    main, worker = worker_pair(running)
    with main, worker:
        time.sleep(0.5)  # earlier reports are in
        before = assembly(running).processes.reports
        assert worker.lookup("alpha", MODEL, digests[:2]) == 2
        assert served_by_workers(running, before)
        assert refused_for_digests(worker, digests[:3])


@pytest.mark.slow
def test_a_principal_added_by_a_reload_has_one_rate_across_the_server_and_its_worker(
    tmp_path: Path,
) -> None:
    live = config(tmp_path, "[limits]\nrequests_per_s = 10\nrequest_burst_s = 1\n")
    with start(live) as running:
        [block] = stored(running)[:1]
        live.principals["newcomer"] = Grant(["alpha"], ["read"])
        live.write()
        reply = reload(running, live)
        assert reply.applied, reply.message
        main, worker = worker_pair(running, "newcomer")
        with main, worker:
            time.sleep(1.2)  # its bucket refills after the OpenBulks and first GETs
            served = 0
            started = time.monotonic()
            with pytest.raises(ResourceExhausted):
                for _ in range(100):
                    for client in (main, worker):
                        assert client.lookup("alpha", MODEL, [block]) == 1
                        served += 1
            elapsed = time.monotonic() - started
    # One bucket of 10 (burst 1 s) refilling at 10/s; a bucket per process would serve
    # about twice as many before the first refusal.
    assert served <= 10 + 10 * elapsed + 2, (served, elapsed)


def test_a_lowered_max_block_bytes_refuses_a_larger_put_on_every_transport(
    running: Running, live: LiveConfig
) -> None:
    big = bytes(8192)
    transports = ("grpc", "bulk-tcp", "bulk-same-host")
    for index, transport in enumerate(transports):  # positive control: 8 KiB stored
        with running.client("a", transport=transport, timeout_s=10) as client:
            assert client.put("alpha", MODEL, [digest("big", index)], [big]) == [True]
    live.extra = f"{WORKERS}[limits]\nmax_block_bytes = 4096\n"
    live.write()
    reply = reload(running, live)
    assert reply.applied, reply.message
    for index, transport in enumerate(transports, start=len(transports)):
        with (
            running.client("a", transport=transport, timeout_s=10) as client,
            pytest.raises(InvalidArgument, match="over max_block_bytes 4096"),
        ):
            client.put("alpha", MODEL, [digest("big", index)], [big])
        with running.client("a", transport=transport, timeout_s=10) as client:
            assert client.put("alpha", MODEL, [digest("small", index)], [bytes(4096)]) == [True]
