"""The bulk channel: tickets, policy on every request, fallback to gRPC, same bytes."""

from __future__ import annotations

import logging
import os
import socket
import time

import grpc
import pytest

from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import PermissionDenied, Unauthenticated
from policy.identity import Action, Principal
from policy.tickets import Route, TicketBook
from policy.types import TenantId
from replica_agent.client import BlockClient, BlockStoreError
from tests.support.bulk import MODEL, open_bulk
from tests.support.servers import Running, free_port

# The channel's two transports: a same-host arena, and TCP (the only one across hosts).
TRANSPORTS = pytest.mark.parametrize("same_host", [True, False], ids=["same-host", "tcp"])


def hello(address: str, ticket: bytes) -> int:
    host, _, port = address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(w.HELLO.pack(w.MAGIC, ticket))
        return bulkio.recv_bytes(sock, 1)[0]


def test_a_ticket_opens_one_connection_only(tenant_server: Running) -> None:
    response = open_bulk(tenant_server, "a", "alpha")
    assert len(response.ticket) == 32 and response.ttl_ms > 0
    assert hello(response.address, response.ticket) == w.OK  # positive control
    assert hello(response.address, response.ticket) == Unauthenticated.wire_code
    assert hello(response.address, os.urandom(32)) == Unauthenticated.wire_code


def test_tickets_are_issued_only_for_granted_tenants(tenant_server: Running) -> None:
    with pytest.raises(grpc.RpcError) as info:
        open_bulk(tenant_server, "a", "beta")
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_tickets_expire() -> None:
    now = [0.0]
    book = TicketBook(ttl_s=5, clock=lambda: now[0])
    principal = Principal("p", frozenset({TenantId("t")}), frozenset({Action.READ}))
    fresh, stale = book.issue(principal, TenantId("t")), book.issue(principal, TenantId("t"))
    assert book.redeem(fresh, Route.TLS).principal == principal
    now[0] = 6.0
    with pytest.raises(Exception, match="invalid, used, expired"):
        book.redeem(stale, Route.TLS)


@TRANSPORTS
def test_bulk_and_grpc_paths_return_the_same_bytes(tenant_server: Running, same_host: bool) -> None:
    digests = [os.urandom(32) for _ in range(6)]
    payloads = [os.urandom(n) for n in (1, 1000, 65536, 1 << 20, 5 << 20, 77)]
    with (
        tenant_server.client("a", same_host=same_host) as bulk,
        tenant_server.client("a", bulk=False) as plain,
    ):
        assert bulk.put("alpha", MODEL, digests[:3], payloads[:3]) == [True] * 3
        assert plain.put("alpha", MODEL, digests[3:], payloads[3:]) == [True] * 3
        assert bulk.put("alpha", MODEL, digests, payloads) == [False] * 6
        assert bulk.get("alpha", MODEL, digests) == payloads
        assert plain.get("alpha", MODEL, digests) == payloads
        assert [bytes(v) for v in bulk.get_views("alpha", MODEL, digests)] == payloads
        assert bulk.get("alpha", MODEL, [digests[0], os.urandom(32), digests[2]]) == payloads[:1]


@TRANSPORTS
def test_lookups_go_over_the_bulk_channel_and_agree_with_grpc(
    tenant_server: Running, same_host: bool
) -> None:
    """A lookup is the engine scheduler's per-request call: over the bulk channel (no
    fallback), with gRPC's answers and refusals; a thread that only looks up takes no
    same-host arena (a TCP connection serves it)."""
    digests = [os.urandom(32) for _ in range(64)]
    with (
        tenant_server.client("a", same_host=same_host) as bulk,
        tenant_server.client("a", bulk=False) as plain,
    ):
        assert bulk.lookup("alpha", MODEL, digests) == plain.lookup("alpha", MODEL, digests) == 0
        assert plain.put("alpha", MODEL, digests[:40], [b"kv"] * 40) == [True] * 40
        assert bulk.lookup("alpha", MODEL, digests) == plain.lookup("alpha", MODEL, digests) == 40
        assert bulk.lookup("alpha", MODEL, digests[1:]) == 39
        assert bulk.lookup("alpha", MODEL, []) == 0
        assert bulk.transport_stats.same_host_connections == 0  # lookups alone: TCP
        assert bulk.get("alpha", MODEL, digests[:1]) == [b"kv"]  # now a data connection
        assert bulk.lookup("alpha", MODEL, digests) == 40  # ... which lookups then share
        assert bulk.transport_stats.same_host_connections == int(same_host)
        with pytest.raises(PermissionDenied):
            bulk.lookup("beta", MODEL, digests)
        with pytest.raises(BlockStoreError) as info:
            bulk.lookup("alpha", MODEL, [b"short"])  # sent over gRPC, answered there
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert bulk.transport_stats.bulk_fallbacks == 0


@TRANSPORTS
def test_policy_still_applies_per_request(tenant_server: Running, same_host: bool) -> None:
    with tenant_server.client("a", same_host=same_host) as client:
        client.put("alpha", MODEL, [b"x" * 32], [b"payload"])  # positive control
        with pytest.raises(PermissionDenied):
            client.get("beta", MODEL, [b"x" * 32])
        with pytest.raises(BlockStoreError) as info:
            client.get("alpha", MODEL, [b"short"])  # sent over gRPC, answered there
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert client.get("alpha", MODEL, [b"x" * 32]) == [b"payload"]


@TRANSPORTS
def test_a_read_only_principal_cannot_put_over_the_bulk_channel(
    tmp_path: object, same_host: bool
) -> None:
    from pathlib import Path

    from tests.support.servers import launch, write_config

    tenancy = write_config(
        Path(str(tmp_path)),
        principals={"reader": (["alpha"], ["read"]), "writer": (["alpha"], ["write"])},
    )
    with (
        launch(tenancy) as running,
        running.client("writer", same_host=same_host) as writer,
        running.client("reader", same_host=same_host) as reader,
    ):
        assert writer.put("alpha", MODEL, [b"k" * 32], [b"v"]) == [True]
        assert reader.get("alpha", MODEL, [b"k" * 32]) == [b"v"]
        with pytest.raises(PermissionDenied):
            reader.put("alpha", MODEL, [b"j" * 32], [b"v"])
        with pytest.raises(PermissionDenied):
            writer.get("alpha", MODEL, [b"k" * 32])


@TRANSPORTS
def test_a_dead_bulk_listener_falls_back_to_grpc(tmp_path: object, same_host: bool) -> None:
    from pathlib import Path

    from cacheserver.config import ServerConfig
    from cacheserver.embedded import EmbeddedServer

    data_dir = Path(str(tmp_path)) / "data"
    with EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=data_dir)) as server:
        token = (data_dir / "dev.token").read_text().strip()
        with BlockClient(server.address, token, same_host=same_host) as client:
            assert client.put("dev", MODEL, [b"d" * 32], [b"bytes"]) == [True]
            assert server.server is not None and server.server.bulk is not None
            server.server.bulk.stop()  # the listener and its connections go away
            assert client.get("dev", MODEL, [b"d" * 32]) == [b"bytes"]  # over gRPC


@TRANSPORTS
def test_the_rate_limit_counts_every_bulk_request(tmp_path: object, same_host: bool) -> None:
    from pathlib import Path

    from kvcommon.errors import ResourceExhausted
    from tests.support.servers import launch, write_config

    tenancy = write_config(
        Path(str(tmp_path)), extra="[limits]\nrequests_per_s = 5\nrequest_burst_s = 2\n"
    )
    with launch(tenancy) as running, running.client("a", same_host=same_host) as client:
        assert client.get("alpha", MODEL, [b"k" * 32]) == []  # positive control
        with pytest.raises(ResourceExhausted, match="over its rate"):
            for _ in range(60):  # one OpenBulk, then requests; stops at the refusal
                client.get("alpha", MODEL, [b"k" * 32])


@pytest.mark.slow
def test_an_unauthenticated_peer_cannot_hold_a_connection(dev_server: Running) -> None:
    response = open_bulk(dev_server, "dev", "dev")
    host, _, port = response.address.rpartition(":")
    with socket.create_connection((host, int(port)), timeout=30) as idle:
        idle.settimeout(30)
        started = time.monotonic()
        assert idle.recv(1) == b""  # the server closed it: no ticket within the deadline
        assert time.monotonic() - started < 15
    assert hello(response.address, response.ticket) == w.OK  # positive control


@TRANSPORTS
def test_a_dropped_connection_is_replaced_not_accumulated(
    dev_server: Running, same_host: bool
) -> None:
    with dev_server.client(same_host=same_host) as client:
        assert client.put("dev", MODEL, [b"r" * 32], [b"v"]) == [True]
        bulk = client._bulk
        assert bulk is not None and len(bulk._all) == 1
        too_many = [b"r" * 32] * 8193  # over max_digests_per_call: the server answers
        for _ in range(3):  # with an error frame and closes the connection
            with pytest.raises(BlockStoreError):
                bulk.get("dev", MODEL, too_many)
            assert client.get("dev", MODEL, [b"r" * 32]) == [b"v"]
        assert len(bulk._all) <= 1


@TRANSPORTS
def test_one_bulk_request_carries_thousands_of_digests(
    dev_server: Running, same_host: bool
) -> None:
    digests = [os.urandom(32) for _ in range(1500)]
    payloads = [os.urandom(64) for _ in digests]
    with dev_server.client(same_host=same_host) as client:
        bulk = client._bulk
        assert bulk is not None
        assert bulk.put("dev", MODEL, digests, payloads) == [True] * 1500  # no gRPC fallback
        assert bulk.get("dev", MODEL, digests) == payloads


def test_a_failed_bulk_channel_is_retried_after_a_backoff_not_on_every_call(
    dev_server: Running, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A failed bulk channel used to be retried (OpenBulk and a connect) on every call.
    Now calls go over gRPC for a backoff window, each fallback is counted, one warning
    is logged per window, and the channel is tried again after it."""
    import replica_agent.client as client_module

    monkeypatch.setattr(client_module, "FIRST_BACKOFF_S", 0.5)
    assert dev_server.server.server is not None and dev_server.server.server.bulk is not None
    tickets = dev_server.server.server.tickets
    with dev_server.client(transport="bulk-tcp") as client:
        digest = os.urandom(32)
        assert client.put("dev", MODEL, [digest], [b"v"]) == [True]  # the bulk channel
        dev_server.server.server.bulk.stop()  # the listener and its connections go away
        issued = len(tickets)
        with caplog.at_level(logging.WARNING):
            for _ in range(10):
                assert client.get("dev", MODEL, [digest]) == [b"v"]  # answered over gRPC
        assert client.transport_stats.bulk_fallbacks == 1  # the rest never tried it
        assert len(tickets) <= issued + 1  # at most one more OpenBulk in the window
        assert caplog.text.count("bulk channel failed") == 1
        time.sleep(0.6)  # the window passes: the channel is tried again (and fails again)
        assert client.get("dev", MODEL, [digest]) == [b"v"]
        assert client.transport_stats.bulk_fallbacks == 2


@TRANSPORTS
def test_after_a_server_restart_the_bulk_channel_is_used_again_at_once(
    tmp_path: object, same_host: bool
) -> None:
    """A restart closes the client's kept bulk connections while they are idle. The next
    call opens a fresh one: no fallback to gRPC and no backoff window (which would send
    every call of the window over gRPC), as if the channel had failed."""
    from pathlib import Path

    from cacheserver.config import BulkConfig, ServerConfig
    from cacheserver.embedded import EmbeddedServer

    data_dir = Path(str(tmp_path)) / "data"
    # A fixed bulk port for both starts: by default it would be the gRPC port + 1 on the
    # restart, which the client's own idle connection may hold as its local port.
    bulk_config = BulkConfig(listen=f"127.0.0.1:{free_port()}")
    first = EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=data_dir, bulk=bulk_config))
    address = first.start()
    token = (data_dir / "dev.token").read_text().strip()
    digest = os.urandom(32)
    with BlockClient(address, token, same_host=same_host) as client:
        try:
            assert client.put("dev", MODEL, [digest], [b"v"]) == [True]
            assert client.get("dev", MODEL, [digest]) == [b"v"]  # the connection is kept
        finally:
            first.stop()
        with EmbeddedServer(ServerConfig(listen=address, data_dir=data_dir, bulk=bulk_config)):
            deadline = time.monotonic() + 30
            while True:  # gRPC reconnects by itself (OpenBulk goes over it)
                try:
                    assert client.lookup("dev", MODEL, [digest]) == 1
                    break
                except BlockStoreError:
                    assert time.monotonic() < deadline, "gRPC did not reconnect"
                    time.sleep(0.1)
            assert client.get("dev", MODEL, [digest]) == [b"v"]
            assert client.put("dev", MODEL, [os.urandom(32)], [b"w"]) == [True]
            assert client.transport_stats.bulk_fallbacks == 0  # both went over the channel
            bulk = client._bulk
            assert bulk is not None and len(bulk._all) == 1  # the closed one was let go
