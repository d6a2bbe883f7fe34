"""The bulk channel's wire format: frames built by kvcommon/bulkwire.py and read back
by their one parser in kvcommon/bulkio.py, over real socket pairs."""

from __future__ import annotations

import socket

import pytest

from kvcommon.bulkio import recv_error, recv_frame
from kvcommon.bulkwire import (
    ARENA_ALIGN,
    ERROR,
    MAX_MESSAGE_CHARS,
    ChannelBroken,
    arena_offsets,
    error_frame,
    sealed_frame,
)
from kvcommon.errors import WIRE_ERRORS, InvalidArgument, ResourceExhausted, error_class


def test_arena_offsets_are_back_to_back_and_page_aligned() -> None:
    assert arena_offsets([]) == ([], 0)
    assert arena_offsets([1]) == ([0], 1)
    offsets, end = arena_offsets([1, ARENA_ALIGN, ARENA_ALIGN + 1, 0, 5])
    assert offsets == [0, ARENA_ALIGN, 2 * ARENA_ALIGN, 4 * ARENA_ALIGN, 4 * ARENA_ALIGN]
    assert end == 4 * ARENA_ALIGN + 5
    assert all(o % ARENA_ALIGN == 0 for o in offsets)


@pytest.mark.parametrize("cls", WIRE_ERRORS)
def test_an_error_frame_round_trips_its_status_and_message(
    pair: tuple[socket.socket, socket.socket], cls: type[Exception]
) -> None:
    left, right = pair
    frame = error_frame(cls("raise [limits] max_block_bytes; café"))  # type: ignore[arg-type]
    left.sendall(frame)
    code, message = recv_error(right)
    assert error_class(code) is cls
    assert message == "raise [limits] max_block_bytes; café"


def test_an_error_frame_whose_start_was_read_already(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    frame = error_frame(ResourceExhausted("no room"))
    for split in (1, ERROR.size, ERROR.size + 3, len(frame)):  # the head, then more
        left.sendall(frame[split:])
        assert recv_error(right, frame[:split]) == (ResourceExhausted.wire_code, "no room")


def test_long_messages_are_cut_to_the_frames_limit(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    left.sendall(error_frame(InvalidArgument("é" * MAX_MESSAGE_CHARS)))  # 2 bytes each
    code, message = recv_error(right)
    assert code == InvalidArgument.wire_code
    assert message == "é" * (MAX_MESSAGE_CHARS // 2)
    right.setblocking(False)
    with pytest.raises(BlockingIOError):  # the frame was read whole, and nothing more
        right.recv(1)


def test_a_sealed_frame_of_a_length_the_exchange_does_not_allow_is_refused(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The length prefix is in clear: it is checked before anything is allocated."""
    left, right = pair
    left.sendall(sealed_frame(b"x" * 40) + sealed_frame(b"y" * 10)[:4])
    assert recv_frame(right, 17, 64) == b"x" * 40
    with pytest.raises(ChannelBroken):
        recv_frame(right, 17, 64)  # too short for this point of the exchange
    left.sendall(b"\xff\xff\xff\xff")
    with pytest.raises(ChannelBroken):
        recv_frame(right, 17, 64)  # 4 GiB announced: refused, not allocated
