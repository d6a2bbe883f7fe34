"""A server slow to answer a new connection (a busy host: its TLS handshake takes a
second) is still reached: BlockClient's channel gives a connection attempt gRPC's own
time (20 s), not its 250 ms reconnect backoff (replica_agent.client)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from replica_agent.client import BlockClient
from tests.support.certs import Certs
from tests.support.isolation import MODEL, isolation_config, serve
from tests.support.servers import Running

SLOW_S = 1.0  # how long the server seems to take before its first byte


class SlowStart:
    """A loopback relay to `upstream` that holds each connection SLOW_S before it
    connects on: the client's handshake waits that long for the server's answer."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.rsplit(":", 1)
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = self._listener.accept()
                self.connections += 1
                threading.Thread(target=self._relay, args=(conn,), daemon=True).start()

    def _relay(self, conn: socket.socket) -> None:
        time.sleep(SLOW_S)  # the handshake's wait, not a test's timing
        with conn, socket.create_connection(self._upstream) as up:
            pumps = [
                threading.Thread(target=_pump, args=(conn, up), daemon=True),
                threading.Thread(target=_pump, args=(up, conn), daemon=True),
            ]
            for pump in pumps:
                pump.start()
            for pump in pumps:
                pump.join()

    def close(self) -> None:
        self._listener.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(65536):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)


@pytest.fixture
def tls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Running]:
    running = serve(isolation_config(tmp_path_factory.mktemp("tls"), certs), certs)
    yield running
    running.stop()


def test_a_tls_handshake_that_takes_a_second_still_connects(tls_server: Running) -> None:
    relay = SlowStart(tls_server.address)
    try:
        token = tls_server.tokens["a"]
        with BlockClient(relay.address, token, tls=tls_server.tls(), bulk=False) as slow:
            assert slow.put("alpha", MODEL, [b"d" * 32], [b"payload"]) == [True]
            assert slow.lookup("alpha", MODEL, [b"d" * 32]) == 1
        assert relay.connections >= 1  # the calls did go through the slow path
    finally:
        relay.close()
    # Control: the same calls straight to the server.
    with tls_server.client("a", transport="grpc") as direct:
        assert direct.get("alpha", MODEL, [b"d" * 32]) == [b"payload"]
