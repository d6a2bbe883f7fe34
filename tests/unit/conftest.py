"""Fixtures the unit tests of the wire and socket helpers share."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    """Two connected sockets, closed after the test."""
    left, right = socket.socketpair()
    yield left, right
    left.close()
    right.close()
