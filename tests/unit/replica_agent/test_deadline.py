"""The client's per-call deadline (replica_agent.deadline), without a server: a socket
pair whose peer drips, and a count of the timeouts the timer sets."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from kvcommon import bulkio
from replica_agent.deadline import CallDeadline, SocketTimer
from replica_agent.errors import BlockStoreError


@pytest.fixture
def pair() -> Iterator[tuple[socket.socket, socket.socket]]:
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def drip(sock: socket.socket, data: bytes, every_s: float) -> None:
    def run() -> None:
        try:
            for byte in data:
                time.sleep(every_s)
                sock.sendall(bytes([byte]))
        except OSError:
            return

    threading.Thread(target=run, daemon=True).start()


@pytest.mark.parametrize("kind", ["python", "kernel"])
def test_a_dripped_receive_times_out_at_the_calls_deadline_not_per_byte(
    pair: tuple[socket.socket, socket.socket], kind: str
) -> None:
    """Each byte comes well within a single receive's timeout; the call's still ends."""
    ours, peer = pair
    if kind == "kernel":
        bulkio.kernel_timeouts(ours, 1.0)  # MSG_WAITALL receives, as on the sealed channel
    else:
        ours.settimeout(1.0)
    timer = SocketTimer(1.0)
    timer.deadline = CallDeadline(0.5)
    drip(peer, bytes(40), every_s=0.05)  # 2 s in all
    started = time.monotonic()
    with pytest.raises(OSError):  # TimeoutError, or EAGAIN from a kernel timeout
        bulkio.recv_bytes(ours, 40, timer)
    assert time.monotonic() - started < 1.0


def test_the_timer_sets_the_socket_only_when_the_deadline_needs_it(
    pair: tuple[socket.socket, socket.socket], timeouts_set: list[float]
) -> None:
    """The fast path makes no extra system call: a call that is done within the slack
    leaves the socket's timeout as it is; a slow one re-arms it at most once per slack;
    one after a slow call restores it once."""
    ours, peer = pair
    ours.settimeout(2.0)
    sets = timeouts_set
    timer = SocketTimer(2.0)
    timer.deadline = CallDeadline(2.0)
    peer.sendall(bytes(64))
    for _ in range(8):  # a fast call: eight receives
        bulkio.recv_bytes(ours, 8, timer)
    assert sets == []
    time.sleep(timer.deadline.slack_s * 1.5)  # slower than the slack: re-armed once
    peer.sendall(bytes(16))
    bulkio.recv_bytes(ours, 8, timer)
    bulkio.recv_bytes(ours, 8, timer)
    assert len(sets) == 1 and sets[0] < 2.0
    timer.deadline = CallDeadline(2.0)  # the next call starts with the shrunk timeout
    peer.sendall(bytes(8))
    bulkio.recv_bytes(ours, 8, timer)
    assert len(sets) == 2 and sets[1] > sets[0]  # restored, so nothing times out early


def test_a_spent_deadline_is_a_timeout_below_and_deadline_exceeded_above() -> None:
    spent = CallDeadline(0.001)
    time.sleep(0.01)
    assert spent.is_spent()
    with pytest.raises(TimeoutError):
        spent.left_s()
    with pytest.raises(BlockStoreError) as info:
        spent.grpc_timeout_s()
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    unbounded = CallDeadline(None)
    assert unbounded.left_s() is None and not unbounded.is_spent()
    left = CallDeadline(5.0).left_s()
    assert left is not None and 4.0 < left <= 5.0
