"""The sealed channel's server side reading requests (cacheserver/transport/bulk/
sealed.py) over a real socket pair, the test playing the client with the client's side
of the same keys: a request whose two frames are in the socket already is taken in one
receive after a peek; one that is not is read as it comes; every check stays."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from cacheserver.transport.bulk.handler import Pace
from cacheserver.transport.bulk.sealed import SealedHandler
from kvcommon import bulkwire as w
from policy.bulkchannel import TAG_BYTES, client_side, server_side
from policy.identity import Principal
from policy.tickets import Grant
from policy.types import TenantId
from replica_agent.bulk_sealed import SealedChannel
from replica_agent.deadline import SocketTimer
from tests.support.counting_socket import CountingSocket

SECRET, TICKET = os.urandom(32), os.urandom(32)
MODEL = "m"
DIGESTS = [os.urandom(32) for _ in range(3)]
BODY = len(MODEL) + 32 * len(DIGESTS)
ALPHA = TenantId("alpha")
GRANT = Grant(Principal("p", frozenset({ALPHA}), frozenset()), ALPHA, SECRET)


def _ends(conn: socket.socket) -> tuple[SealedChannel, SealedHandler, CountingSocket]:
    sender, receiver = client_side(SECRET, TICKET)
    client = SealedChannel(sender, receiver, traced=False, timer=SocketTimer(None))
    out, into = server_side(SECRET, TICKET)
    counted = CountingSocket(conn)
    pace = Pace(1 << 20, 300.0)
    handler = SealedHandler(None, counted, GRANT, out, into, pace)  # type: ignore[arg-type]
    return client, handler, counted


def _get_request(client: SealedChannel) -> bytes:
    return b"".join(client._request(w.OP_GET, MODEL, DIGESTS, b""))


def test_a_request_in_the_socket_whole_is_taken_in_one_receive_after_a_peek(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    client, handler, counted = _ends(right)
    for _ in range(2):  # and the next request on the same connection
        left.sendall(_get_request(client) + b"what follows the request")
        counted.receives = 0
        assert handler.recv_request() == (w.OP_GET, len(MODEL), len(DIGESTS), None)
        assert bytes(handler._recv(BODY)) == MODEL.encode() + b"".join(DIGESTS)
        assert counted.receives == 2
        assert right.recv(4096) == b"what follows the request"  # nothing more was taken


@pytest.mark.parametrize("cut", [3, 10, 27, 40])
def test_a_request_that_is_not_all_there_is_read_as_it_comes(
    pair: tuple[socket.socket, socket.socket], cut: int
) -> None:
    left, right = pair
    client, handler, _ = _ends(right)
    wire = _get_request(client)
    left.sendall(wire[:cut])
    later = threading.Timer(0.05, lambda: left.sendall(wire[cut:]))
    later.start()
    assert handler.recv_request() == (w.OP_GET, len(MODEL), len(DIGESTS), None)
    assert bytes(handler._recv(BODY)) == MODEL.encode() + b"".join(DIGESTS)
    later.join()


def test_a_tampered_or_misframed_body_taken_whole_is_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    client, handler, _ = _ends(right)
    wire = bytearray(_get_request(client))
    wire[-TAG_BYTES - 1] ^= 1  # inside the body frame's ciphertext
    left.sendall(wire)
    handler.recv_request()  # the header holds
    with pytest.raises(w.ChannelBroken, match="failed authentication"):
        handler._recv(BODY)
    client, handler, _ = _ends(right)
    left.sendall(_get_request(client))
    handler.recv_request()
    with pytest.raises(w.ChannelBroken, match="impossible length"):
        handler._recv(BODY + 1)  # the header said another size
