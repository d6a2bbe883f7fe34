"""Receiving the sealed channel's frames (kvcommon.bulkio.recv_frame): a frame that
arrived whole is one receive, one that comes in pieces is still read whole, and what
does not fit the exchange breaks the channel."""

from __future__ import annotations

import socket
import threading

import pytest

from kvcommon.bulkio import recv_frame
from kvcommon.bulkwire import ChannelBroken, sealed_frame
from tests.support.counting_socket import CountingSocket

EXPECT = 29  # a reply's OK block header: status, BLOCK, tag


def test_a_frame_that_arrived_whole_is_one_receive(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    counted = CountingSocket(right)
    frame, payload = b"f" * EXPECT, b"p" * 4096
    left.sendall(sealed_frame(frame) + payload)  # a block header and the payload after it
    assert recv_frame(counted, 17, 64, expect=EXPECT) == frame  # type: ignore[arg-type]
    assert counted.receives == 1
    assert right.recv(8192) == payload  # nothing of what follows the frame was taken


def test_without_an_expected_length_a_frame_is_two_receives_as_before(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    counted = CountingSocket(right)
    left.sendall(sealed_frame(b"f" * 40))
    assert recv_frame(counted, 17, 64) == b"f" * 40  # type: ignore[arg-type]
    assert counted.receives == 2


@pytest.mark.parametrize("cut", [2, 4, 10, 4 + EXPECT - 1])
def test_a_frame_in_pieces_is_read_whole(
    pair: tuple[socket.socket, socket.socket], cut: int
) -> None:
    left, right = pair
    wire = sealed_frame(bytes(range(EXPECT)))
    left.sendall(wire[:cut])
    later = threading.Timer(0.05, lambda: left.sendall(wire[cut:]))
    later.start()
    assert recv_frame(right, 17, 64, expect=EXPECT) == bytes(range(EXPECT))
    later.join()


def test_a_shorter_or_longer_frame_is_read_as_it_is_said(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """An error frame of another length than the OK header expected."""
    left, right = pair
    left.sendall(sealed_frame(b"e" * 20))
    assert recv_frame(right, 17, 64, expect=EXPECT) == b"e" * 20
    left.sendall(sealed_frame(b"E" * 60))
    assert recv_frame(right, 17, 64, expect=EXPECT) == b"E" * 60


def test_bytes_beyond_a_shorter_frame_or_an_impossible_length_break_the_channel(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    left.sendall(sealed_frame(b"s" * 10))  # too short for this point of the exchange
    with pytest.raises(ChannelBroken, match="impossible length"):
        recv_frame(right, 17, 64, expect=EXPECT)
    left.sendall(b"\xff\xff\xff\xff")  # 4 GiB announced: refused, not allocated
    with pytest.raises(ChannelBroken, match="impossible length"):
        recv_frame(right, 17, 64, expect=EXPECT)
    left.sendall(sealed_frame(b"e" * 20) + b"stray bytes")  # out of step
    with pytest.raises(ChannelBroken, match="beyond a sealed bulk frame"):
        recv_frame(right, 17, 64, expect=EXPECT)
