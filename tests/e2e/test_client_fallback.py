"""The client's one fallback rule (replica_agent.fallback) against a real server that stops
and comes back on the same ports.

A call that gRPC could not carry either (the server was down) says nothing against the
bulk channel: once the server is back, every kind of call, lookups included, goes over
the bulk channel again at once, not over gRPC for the rest of a backoff window (up to a
minute). The server's own request counters say which transport carried each call.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

import replica_agent.client as client_module
from cacheserver.config import BulkConfig
from cacheserver.telemetry import ServerTelemetry
from replica_agent.client import BlockClient, BlockStoreError
from tests.support.servers import Running, Tenancy, free_port, launch, write_config

MODEL = "m;fp32;L2"
TENANT = "alpha"
WAIT_S = 60  # for a restarted server and gRPC's reconnect: a bound, never a measure
# What each kind of call is, and the server's name for it on each transport.
BULK_KINDS = ["lookup", "get", "get_views", "iter_views", "put"]
METHODS = {
    "lookup": ("kvshare.bulk/Lookup", "kvshare.v1.BlockStore/Lookup"),
    "get": ("kvshare.bulk/Get", "kvshare.v1.BlockStore/Get"),
    "get_views": ("kvshare.bulk/Get", "kvshare.v1.BlockStore/Get"),
    "iter_views": ("kvshare.bulk/Get", "kvshare.v1.BlockStore/Get"),
    "put": ("kvshare.bulk/Put", "kvshare.v1.BlockStore/Put"),
}


def call(client: BlockClient, kind: str, digest: bytes) -> object:
    """One call of `kind` for one block."""
    if kind == "lookup":
        return client.lookup(TENANT, MODEL, [digest])
    if kind == "get":
        return client.get(TENANT, MODEL, [digest])
    if kind == "get_views":
        return [bytes(v) for v in client.get_views(TENANT, MODEL, [digest])]
    if kind == "iter_views":
        return [bytes(v) for v in client.iter_views(TENANT, MODEL, [digest])]
    if kind == "put":
        return client.put(TENANT, MODEL, [os.urandom(32)], [b"put after"])
    if kind == "delete":
        return client.delete(TENANT, MODEL, [os.urandom(32)])
    raise AssertionError(kind)


class HoldingRelay:
    """A TCP relay in front of the bulk listener that, like an L4 load balancer, keeps
    the client's side of a connection open after the server's side closed, and resets
    it when the client sends on it again: the client learns the server went away only
    from a request that fails, as across a real network."""

    def __init__(self, upstream_port: int) -> None:
        self._upstream = ("127.0.0.1", upstream_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        self.held = threading.Semaphore(0)  # released for each server side that closed
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._sockets += [client, server]
            pair = _Pair(client, server)
            threading.Thread(target=self._to_server, args=(pair,), daemon=True).start()
            threading.Thread(target=self._to_client, args=(pair,), daemon=True).start()

    def _to_server(self, pair: _Pair) -> None:
        with contextlib.suppress(OSError):
            while chunk := pair.client.recv(1 << 16):
                with pair.lock:
                    if pair.gone:
                        _reset(pair.client)  # a request on a connection the server closed
                        return
                    pair.asked = True
                pair.server.sendall(chunk)
        _close(pair.server)
        _close(pair.client)

    def _to_client(self, pair: _Pair) -> None:
        with contextlib.suppress(OSError):
            while chunk := pair.server.recv(1 << 16):
                with pair.lock:
                    pair.asked = False
                pair.client.sendall(chunk)
        with pair.lock:
            pair.gone = True
            if pair.asked:  # a request the server took with it: the client hears of it
                _reset(pair.client)
        self.held.release()  # else the client's side stays open

    def close(self) -> None:
        _close(self._listener)
        with self._lock:
            for sock in self._sockets:
                _close(sock)


@dataclass
class _Pair:
    """One relayed connection: `gone` once the server's side closed, `asked` while a
    request the client sent has had no reply yet."""

    client: socket.socket
    server: socket.socket
    lock: threading.Lock = field(default_factory=threading.Lock)
    gone: bool = False
    asked: bool = False


def _reset(sock: socket.socket) -> None:
    """End the connection with a reset. shutdown() first: it wakes a thread blocked in
    recv() on this socket, which close() alone does not (nor would it send anything
    while that thread holds the socket)."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    _close(sock)


def _close(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.close()


@dataclass
class Store:
    """A server that can be stopped and started again on the same gRPC and bulk ports,
    with the same data dir; each start counts its own requests."""

    tenancy: Tenancy
    bulk: BulkConfig
    listen: str = "127.0.0.1:0"
    running: Running | None = None
    reader: InMemoryMetricReader | None = None

    def start(self) -> Running:
        self.reader = InMemoryMetricReader()
        telemetry = ServerTelemetry(metric_readers=[self.reader])
        self.running = launch(
            self.tenancy, server_telemetry=telemetry, listen=self.listen, bulk=self.bulk
        )
        self.listen = self.running.address
        return self.running

    def stop(self) -> None:
        if self.running is not None:
            self.running.stop()

    def requests(self) -> Counter[str]:
        """Requests this start of the server counted, by method (both transports)."""
        assert self.reader is not None
        counts: Counter[str] = Counter()
        data = self.reader.get_metrics_data()
        for resource in data.resource_metrics if data else ():
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name != "kvshare.rpc.requests":
                        continue
                    for point in metric.data.data_points:
                        method = str((point.attributes or {})["method"])
                        counts[method] += int(getattr(point, "value", 0))
        return counts

    def counted(self, method: str) -> Counter[str]:
        """The counts once `method` shows (a bulk worker reports its requests in turn)."""
        deadline = time.monotonic() + WAIT_S
        while not (counts := self.requests())[method] and time.monotonic() < deadline:
            time.sleep(0.05)
        return counts


@pytest.fixture
def bulk_port() -> int:
    return free_port()


@pytest.fixture
def relay(bulk_port: int) -> Iterator[HoldingRelay]:
    relay = HoldingRelay(bulk_port)
    yield relay
    relay.close()


@pytest.fixture
def store(tmp_path: Path, bulk_port: int, relay: HoldingRelay) -> Iterator[Store]:
    # A fixed bulk port for every start (by default it is the gRPC port + 1, which the
    # client's own connections may hold as their local port), announced as the relay.
    bulk = BulkConfig(listen=f"127.0.0.1:{bulk_port}", advertise=relay.address)
    store = Store(write_config(tmp_path), bulk)
    store.start()
    yield store
    store.stop()


@pytest.fixture
def long_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backoff window as it is after repeated failures (it doubles up to a minute):
    longer than the test, so a call after the restart is inside it unless forgiven."""
    monkeypatch.setattr(client_module, "FIRST_BACKOFF_S", 600.0)
    monkeypatch.setattr(client_module, "MAX_BACKOFF_S", 600.0)


def client_of(store: Store) -> BlockClient:
    assert store.running is not None
    return store.running.client("a", transport="bulk-tcp", timeout_s=10)


def restart_and_look_up(store: Store, client: BlockClient, digest: bytes) -> None:
    """Start the server again on the same ports; look up until gRPC has reconnected
    (OpenBulk goes over it) and the lookup is answered."""
    store.start()
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            assert client.lookup(TENANT, MODEL, [digest]) == 1
            return
        except BlockStoreError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
            assert time.monotonic() < deadline, "the client did not reconnect"
            time.sleep(0.1)


def assert_over_the_bulk_channel(store: Store, kind: str) -> None:
    bulk_method, grpc_method = METHODS[kind]
    counts = store.counted(bulk_method)
    assert counts[bulk_method] >= 1, counts
    assert counts[grpc_method] == 0, counts  # no call of this kind went over gRPC


@pytest.mark.usefixtures("long_backoff")
@pytest.mark.parametrize("kind", BULK_KINDS)
def test_a_call_whose_grpc_fallback_finds_the_store_down_leaves_the_bulk_channel_on(
    store: Store, relay: HoldingRelay, kind: str
) -> None:
    """The store stops while the client holds a bulk connection (a load balancer keeps
    it open); the next call fails on it, falls back to gRPC, and gRPC cannot reach the
    server either: the server was down, not the channel. Lookups kept the channel off
    for the backoff window after such a failure (gets and puts did not), so after
    every restart an engine's scheduler looked up over gRPC for up to a minute."""
    digest = os.urandom(32)
    with client_of(store) as client:
        assert client.put(TENANT, MODEL, [digest], [b"v"]) == [True]
        assert client.lookup(TENANT, MODEL, [digest]) == 1  # on the kept connection
        assert_over_the_bulk_channel(store, "lookup")  # positive control
        store.stop()
        assert relay.held.acquire(timeout=WAIT_S)  # the relay holds the client's side
        with pytest.raises(BlockStoreError) as info:
            call(client, kind, digest)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert client.transport_stats.bulk_fallbacks == 1  # the bulk channel failed first

        restart_and_look_up(store, client, digest)
        assert call(client, kind, digest) in (1, [b"v"], [True])
        assert_over_the_bulk_channel(store, "lookup")
        assert_over_the_bulk_channel(store, kind)
        assert client.transport_stats.bulk_fallbacks == 1  # no fallback since


@pytest.mark.usefixtures("long_backoff")
@pytest.mark.parametrize("kind", [*BULK_KINDS, "delete"])
def test_a_call_that_finds_the_store_down_ends_a_bulk_backoff_window(
    store: Store, kind: str
) -> None:
    """The bulk listener failed while gRPC answered: the channel is off for its window
    and calls go over gRPC (positive control). Then the whole server stops, and a call
    of any kind, over gRPC, finds it unreachable: whatever failed before, a restarted
    server gets the bulk channel again at once."""
    digest = os.urandom(32)
    with client_of(store) as client:
        assert client.put(TENANT, MODEL, [digest], [b"v"]) == [True]
        running = store.running
        assert running is not None and running.server.server is not None
        bulk_listener = running.server.server.bulk
        assert bulk_listener is not None
        bulk_listener.stop()  # its listener and connections go away; gRPC still answers
        assert client.get(TENANT, MODEL, [digest]) == [b"v"]  # over gRPC
        assert client.transport_stats.bulk_fallbacks == 1
        assert client.lookup(TENANT, MODEL, [digest]) == 1
        assert store.requests()["kvshare.v1.BlockStore/Lookup"] == 1  # the window is on
        store.stop()
        with pytest.raises(BlockStoreError) as info:
            call(client, kind, digest)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

        restart_and_look_up(store, client, digest)
        assert_over_the_bulk_channel(store, "lookup")
        if kind != "delete":
            assert call(client, kind, digest) in (1, [b"v"], [True])
            assert_over_the_bulk_channel(store, kind)
        assert client.transport_stats.bulk_fallbacks == 1  # no fallback since


@pytest.mark.usefixtures("long_backoff")
def test_without_a_restart_the_window_holds_while_grpc_answers(store: Store) -> None:
    """The other side of the rule: a bulk channel that failed while the server answered
    over gRPC stays off for its window; calls that gRPC answers do not end it."""
    digest = os.urandom(32)
    with client_of(store) as client:
        assert client.put(TENANT, MODEL, [digest], [b"v"]) == [True]
        running = store.running
        assert running is not None and running.server.server is not None
        assert running.server.server.bulk is not None
        running.server.server.bulk.stop()
        for kind in [*BULK_KINDS, "delete"]:
            call(client, kind, digest)
        assert client.transport_stats.bulk_fallbacks == 1  # tried once, then the window
        counts = store.requests()
        assert counts["kvshare.v1.BlockStore/Lookup"] == 1
        assert counts["kvshare.v1.BlockStore/Get"] == 3
        assert counts["kvshare.v1.BlockStore/Put"] == 1
