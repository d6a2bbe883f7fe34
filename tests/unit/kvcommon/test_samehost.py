"""The same-host arena's helpers (kvcommon/samehost.py): copies into the arena, and
the user at the other end of a Unix socket."""

from __future__ import annotations

import os
import socket

import pytest

from kvcommon.samehost import GIL_FREE_COPY_BYTES, copy_into, peer_uid


@pytest.mark.parametrize(
    "size", [0, 1, 4096, GIL_FREE_COPY_BYTES - 1, GIL_FREE_COPY_BYTES, 3 << 20]
)
def test_copy_into_copies_every_kind_of_source_to_the_start_of_the_target(size: int) -> None:
    data = os.urandom(size)
    sources = [data, bytearray(data), memoryview(data), memoryview(bytearray(data))]
    for source in sources:
        target = bytearray(b"\xff" * (size + 10))
        copy_into(memoryview(target), source)
        assert target[:size] == data
        assert target[size:] == b"\xff" * 10  # nothing past the source's end


def test_copy_into_a_target_of_another_format_or_an_mmap() -> None:
    import mmap

    data = os.urandom(GIL_FREE_COPY_BYTES + 8)
    words = memoryview(bytearray(len(data))).cast("Q")
    copy_into(words, data)
    assert words.tobytes() == data
    with mmap.mmap(-1, len(data)) as mapped:
        copy_into(memoryview(mapped), bytearray(data))
        assert mapped[:] == data


def test_peer_uid_names_the_user_at_the_other_end(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    assert peer_uid(left) == peer_uid(right) == os.getuid()
