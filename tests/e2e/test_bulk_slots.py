"""Bulk-channel connection slots: strangers cannot hold them.

A peer without a ticket gets a total deadline to present one, however slowly it sends;
each listener's strangers are counted apart (a local user flooding the same-host
listener leaves TCP alone, and the reverse); a full pool of strangers makes room by
closing its oldest, so a real client still gets in; and one principal cannot take
every authenticated slot.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheserver.transport.bulk.listener import BulkServer
from cacheserver.transport.bulk.slots import ConnectionSlots
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import ResourceExhausted
from tests.support.bulk import open_bulk
from tests.support.certs import Certs
from tests.support.isolation import isolation_config
from tests.support.servers import Running, launch

MODEL = "m;fp32;L2"


def bulk_server(running: Running) -> BulkServer:
    assert running.server.server is not None and running.server.server.bulk is not None
    return running.server.server.bulk


def closed_within(sock: socket.socket, seconds: float, trickle: bytes = b"") -> bool:
    """Whether the server closes `sock` within `seconds`, while we send `trickle` one
    byte every 0.3 s (a slowloris that never finishes its HELLO in time)."""
    deadline = time.monotonic() + seconds
    sock.settimeout(0.3)
    sent = 0
    while time.monotonic() < deadline:
        try:
            if sock.recv(1) == b"":
                return True
        except TimeoutError:
            pass
        except (ConnectionResetError, ssl.SSLError):
            return True
        if sent < len(trickle):
            try:
                sock.sendall(trickle[sent : sent + 1])
            except OSError:
                return True
            sent += 1
    return False


def test_a_trickling_stranger_is_cut_off_at_the_total_deadline(dev_server: Running) -> None:
    bulk_server(dev_server).handshake_timeout_s = 1.0
    response = open_bulk(dev_server, "dev", "dev")
    host, _, port = response.address.rpartition(":")
    hello = w.HELLO.pack(w.MAGIC, response.ticket)
    with socket.create_connection((host, int(port)), timeout=10) as slow:
        # one byte per 0.3 s: each receive is quick, the whole would take ~11 s
        assert closed_within(slow, 5.0, trickle=hello)
    fresh = open_bulk(dev_server, "dev", "dev")
    with socket.create_connection((host, int(port)), timeout=10) as quick:  # control
        quick.sendall(w.HELLO.pack(w.MAGIC, fresh.ticket))
        assert bulkio.recv_bytes(quick, 1)[0] == w.OK


def test_a_stranger_that_completes_tls_then_trickles_is_cut_off_too(
    tmp_path: Path, certs: Certs
) -> None:
    """Wrapping a connection in TLS detaches the accepted socket: the reaper must shut
    the wrapped one, or a peer that finishes the TLS handshake and then drips its hello
    holds a slot and a server thread for as long as it likes."""
    with launch(isolation_config(tmp_path, certs), certs) as running:
        bulk = bulk_server(running)
        bulk.handshake_timeout_s = 1.0
        host, _, port = bulk.address.rpartition(":")
        tls = running.tls()
        assert tls is not None
        context = tls.ssl_context()
        context.check_hostname = False
        raw = socket.create_connection((host, int(port)), timeout=10)
        with raw, context.wrap_socket(raw) as slow:  # the TLS handshake completes
            assert closed_within(slow, 5.0, trickle=w.HELLO.pack(w.MAGIC, os.urandom(32)))
        with running.client("b", transport="bulk-tcp") as client:  # control
            digest, payload = os.urandom(32), os.urandom(4096)
            assert client.put("beta", MODEL, [digest], [payload]) == [True]
            assert client.get("beta", MODEL, [digest]) == [payload]
            assert client.transport_stats.bulk_fallbacks == 0


@contextlib.contextmanager
def strangers(address: str, count: int) -> Iterator[list[socket.socket]]:
    """`count` idle connections that never present a ticket (TCP, or the same-host
    listener when `address` is an abstract socket name)."""
    socks = []
    try:
        for _ in range(count):
            if ":" in address:
                host, _, port = address.rpartition(":")
                sock = socket.create_connection((host, int(port)), timeout=10)
            else:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect("\0" + address)
            socks.append(sock)
        yield socks
    finally:
        for sock in socks:
            sock.close()


@pytest.mark.slow
@pytest.mark.parametrize("flooded", ["tcp", "same-host"])
def test_a_flood_of_strangers_leaves_real_clients_their_slots(
    dev_server: Running, flooded: str
) -> None:
    response = open_bulk(dev_server, "dev", "dev")
    target = response.address if flooded == "tcp" else response.local_address
    digest, payload = os.urandom(32), os.urandom(4096)
    with strangers(target, 300):  # more than every slot the server has
        time.sleep(0.2)  # let the server accept them all
        for transport in ("bulk-tcp", "bulk-same-host"):
            with dev_server.client(transport=transport) as client:
                client.put("dev", MODEL, [digest], [payload])
                assert client.get("dev", MODEL, [digest]) == [payload]
                assert client.transport_stats.bulk_fallbacks == 0  # the bulk channel took it


def test_strangers_beyond_the_pool_push_out_the_oldest() -> None:
    now = [0.0]
    shut: list[socket.socket] = []
    slots = ConnectionSlots(5.0, max_handshaking=2, shut=shut.append, clock=lambda: now[0])
    a, b, c, d = (socket.socket() for _ in range(4))
    try:
        slots.accept(a, "tcp")
        slots.accept(b, "tcp")
        slots.accept(d, "local")  # another listener's pool: not counted with tcp's
        slots.accept(c, "tcp")
        assert shut == [a]
    finally:
        for sock in (a, b, c, d):
            sock.close()


def test_one_principal_cannot_take_every_authenticated_slot() -> None:
    slots = ConnectionSlots(5.0, max_per_principal=2, max_authenticated=3)
    socks = [socket.socket() for _ in range(5)]
    try:
        for sock in socks:
            slots.accept(sock, "tcp")
        slots.authenticated(socks[0], "greedy")
        slots.authenticated(socks[1], "greedy")
        with pytest.raises(ResourceExhausted, match="holds 2 bulk connections"):
            slots.authenticated(socks[2], "greedy")
        slots.authenticated(socks[3], "other")  # another principal still gets one
        with pytest.raises(ResourceExhausted, match="holds 3 connections"):
            slots.authenticated(socks[4], "third")
        slots.release(socks[0])
        slots.authenticated(socks[2], "greedy")  # a released slot is free again
    finally:
        for sock in socks:
            sock.close()
