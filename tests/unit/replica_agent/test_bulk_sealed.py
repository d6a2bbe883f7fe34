"""The sealed channel's client (replica_agent/bulk_sealed.py) over a real socket pair,
the test playing the server with the server's side of the same keys: each reply frame
that arrived whole is one receive."""

from __future__ import annotations

import os
import socket

import pytest

from kvcommon import bulkwire as w
from policy.bulkchannel import client_side, server_side
from replica_agent.bulk_buffers import Buffers
from replica_agent.bulk_sealed import SealedChannel
from replica_agent.deadline import SocketTimer
from replica_agent.errors import BlockStoreError
from tests.support.counting_socket import CountingSocket

SECRET, TICKET = os.urandom(32), os.urandom(32)
PAYLOADS = [os.urandom(4096), os.urandom(5000)]


def _channel() -> SealedChannel:
    sender, receiver = client_side(SECRET, TICKET)
    return SealedChannel(sender, receiver, traced=False, timer=SocketTimer(None))


def _block(index: int, size: int) -> bytes:
    return bytes([w.OK]) + w.BLOCK.pack(index, size)


def test_a_get_takes_one_receive_per_frame_and_one_per_payload(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    server, client = pair
    out, _ = server_side(SECRET, TICKET)
    reply = b"".join(
        w.sealed_frame(out.seal_header(_block(i, len(p)))) + p for i, p in enumerate(PAYLOADS)
    )
    server.sendall(reply + w.sealed_frame(out.seal_header(_block(len(PAYLOADS), 0))))
    counted = CountingSocket(client)
    views = _channel().get(counted, Buffers(), "m", [bytes(32)] * 3, keep=True)  # type: ignore[arg-type]
    assert [bytes(v) for v in views] == PAYLOADS
    assert counted.receives == 2 * len(PAYLOADS) + 1  # frame and payload each, the end


def test_an_error_frame_in_place_of_a_block_header_is_the_servers_error(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """Shorter or longer than the OK header the receive asked for: read as it is said."""
    server, client = pair
    out, _ = server_side(SECRET, TICKET)
    channel = _channel()
    for message in ("", "a longer message than a block header is, from the server"):
        frame = w.ERROR.pack(13, len(message)) + message.encode()
        server.sendall(w.sealed_frame(out.seal_header(frame)))
        with pytest.raises(BlockStoreError) as info:
            list(channel.get(client, Buffers(), "m", [bytes(32)], keep=False))
        assert info.value.details() == message
