"""The bulk listener's ready loop (cacheserver.transport.bulk.readyloop): one thread
serves the plain-TCP requests that are whole in their socket, and no peer holds it up.

Each test pairs a hostile raw connection (a request sent in halves, or a reply left
unread) with a well-behaved client whose calls must all complete meanwhile: were the
loop waiting on the hostile peer, they would hang until its deadline (the test's own
timeout catches that). The loop's counters are the positive control: whole requests
were served on the loop itself, so the tests are not passing on threads alone.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Callable

import pytest

from cacheserver.transport.bulk.handler import BulkHandler
from cacheserver.transport.bulk.readyloop import ReadyLoop
from kvcommon import bulkio
from kvcommon import bulkwire as w
from tests.support.bulk import MODEL, open_bulk
from tests.support.servers import TEST_BULK_WORKERS, Running

pytestmark = pytest.mark.skipif(
    TEST_BULK_WORKERS > 1, reason="with bulk workers, connections start on a worker"
)
KiB, MiB = 1 << 10, 1 << 20


def ready_loop(running: Running) -> ReadyLoop[BulkHandler]:
    assert running.server.server is not None
    bulk = running.server.server.bulk
    assert bulk is not None and bulk.ready is not None
    loop = bulk.ready
    return loop


def raw_connection(running: Running, who: str = "a", tenant: str = "alpha") -> socket.socket:
    """A bulk connection past its hello, as a client would hold it (plain TCP)."""
    response = open_bulk(running, who, tenant)
    host, _, port = response.address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(w.HELLO.pack(w.MAGIC, response.ticket))
    assert bulkio.recv_bytes(sock, 1)[0] == w.OK
    return sock


def get_request(digest: bytes) -> bytes:
    model = MODEL.encode()
    return w.REQUEST.pack(w.OP_GET, len(model), 1) + model + digest


def read_get_reply(sock: socket.socket) -> bytes:
    """The one block of a one-digest GET's reply."""
    assert bulkio.recv_bytes(sock, 1)[0] == w.OK
    (size,) = w.SIZE.unpack(bulkio.recv_bytes(sock, w.SIZE.size))
    payload = bytes(bulkio.recv_bytes(sock, size))
    assert bytes(bulkio.recv_bytes(sock, len(w.END))) == w.END
    return payload


def calls_complete(running: Running, calls: int = 20) -> Callable[[], None]:
    """A well-behaved client's puts and gets, checked for their bytes."""

    def run() -> None:
        with running.client("a", same_host=False) as client:
            digests = [os.urandom(32) for _ in range(calls)]
            payloads = [os.urandom(64 * KiB) for _ in range(calls)]
            for digest, payload in zip(digests, payloads, strict=True):
                assert client.put("alpha", MODEL, [digest], [payload]) == [True]
                assert client.get("alpha", MODEL, [digest]) == [payload]
            assert client.transport_stats.bulk_fallbacks == 0

    return run


def test_a_request_sent_in_halves_holds_up_no_one(tenant_server: Running) -> None:
    loop = ready_loop(tenant_server)
    digest, payload = os.urandom(32), os.urandom(64 * KiB)
    with tenant_server.client("a", same_host=False) as client:
        assert client.put("alpha", MODEL, [digest], [payload]) == [True]
    inline_before = loop.inline_requests
    request = get_request(digest)
    with raw_connection(tenant_server) as sock:
        sock.sendall(request[:5])  # the header's first bytes only: not whole
        calls_complete(tenant_server)()  # served meanwhile, on the loop
        # The positive control: at least its 20 GETs (small, whole at once) were served
        # on the loop itself (a put whose payload arrives in pieces goes to a follower).
        assert loop.inline_requests >= inline_before + 20
        sock.sendall(request[5:])
        assert read_get_reply(sock) == payload  # a follower finished it
    assert loop.follower_requests >= 1


def test_a_peer_that_stops_reading_holds_up_only_itself(
    start_server: Callable[..., Running],
) -> None:
    """A GET whose reply the socket buffer cannot take: the loop hands the lead on
    before it waits, the reply goes out once the peer reads, and everyone else's calls
    complete meanwhile."""
    running = start_server()
    # A slow minimum rate: the unread reply is not cut off while the others run.
    bulk = dataclasses.replace(running.config.bulk, min_transfer_bytes_per_s=256 * KiB)
    running.stop()
    running = start_server(bulk=bulk)
    loop = ready_loop(running)
    digest, payload = os.urandom(32), os.urandom(16 * MiB)
    with running.client("a", same_host=False) as client:
        assert client.put("alpha", MODEL, [digest], [payload]) == [True]
    with raw_connection(running) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 * KiB)
        handoffs = loop.handoffs
        sock.sendall(get_request(digest))  # and reads nothing yet
        calls_complete(running)()
        assert loop.handoffs >= handoffs + 1  # the loop did not wait on this peer
        assert read_get_reply(sock) == payload
        sock.sendall(get_request(digest))  # the connection serves on
        assert read_get_reply(sock) == payload


def test_closed_peers_leave_the_loop(tenant_server: Running) -> None:
    """Connections that close, between requests or within one, end quietly and give
    their slots back; the loop serves new ones."""
    loop = ready_loop(tenant_server)
    for half in (False, True):
        for _ in range(5):
            with raw_connection(tenant_server) as sock:
                if half:
                    sock.sendall(get_request(os.urandom(32))[:7])
    calls_complete(tenant_server, calls=3)()
    assert loop.inline_requests >= 3  # its GETs at least, on the loop
