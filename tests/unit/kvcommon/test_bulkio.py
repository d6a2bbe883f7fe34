"""Moving the bulk channel's bytes within a deadline, over real socket pairs
(kvcommon/bulkio.py)."""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from kvcommon import bulkio, bulkwire, handoff
from kvcommon.bulkio import (
    MAX_IOV,
    Deadline,
    kernel_timeouts,
    recv_bytes,
    recv_exact,
    recv_exact_parts,
    send_parts,
)
from kvcommon.bulkwire import OK, ConnectionClosed, error_frame
from kvcommon.errors import ResourceExhausted
from replica_agent.bulk_connect import recv_reply
from replica_agent.errors import BlockStoreError


def in_thread(work: Callable[[], object]) -> threading.Thread:
    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    return thread


def send_in_pieces(sock: socket.socket, data: bytes, piece: int) -> threading.Thread:
    """Send `data` from a thread, `piece` bytes a send: the receiver sees it arrive in
    pieces."""

    def trickle() -> None:
        for start in range(0, len(data), piece):
            sock.sendall(data[start : start + piece])

    return in_thread(trickle)


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["blocking", "timeout"])
def test_recv_exact_fills_the_view_from_pieces(
    pair: tuple[socket.socket, socket.socket], timeout: float | None
) -> None:
    left, right = pair
    right.settimeout(timeout)
    data = os.urandom(3 << 20)
    sender = send_in_pieces(left, data, 700_001)
    buffer = bytearray(len(data))
    recv_exact(right, memoryview(buffer))
    sender.join()
    assert buffer == data


def test_a_peer_closing_mid_frame_is_connection_closed(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    left.sendall(b"12345")
    left.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionClosed):
        recv_bytes(right, 10)


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["blocking", "timeout"])
def test_send_parts_sends_many_parts_in_order(
    pair: tuple[socket.socket, socket.socket], timeout: float | None
) -> None:
    """More parts than one sendmsg takes (MAX_IOV), several MiB in all, so sends stop
    part-way through a part and resume there."""
    left, right = pair
    left.settimeout(timeout)
    parts: list[bytes | bytearray | memoryview] = []
    for n in range(3 * MAX_IOV + 7):
        raw = os.urandom(n % 5000 + (1 << 20 if n % 500 == 0 else 0))
        kinds = (
            raw,
            bytearray(raw),
            memoryview(raw),
            memoryview(bytearray(raw) + b"\0" * 3)[: len(raw)],
        )
        parts.append(kinds[n % 4])
    expected = b"".join(bytes(p) for p in parts)
    received = bytearray(len(expected))
    reader = in_thread(lambda: recv_exact(right, memoryview(received)))
    send_parts(left, parts)
    reader.join(30)
    assert bytes(received) == expected


def test_send_parts_takes_views_of_any_format(pair: tuple[socket.socket, socket.socket]) -> None:
    left, right = pair
    words = memoryview(bytearray(range(16))).cast("I")  # 4 items of 4 bytes
    send_parts(left, [words, b"!"])
    assert recv_bytes(right, 17) == bytes(range(16)) + b"!"


def test_kernel_timeouts_make_an_idle_receive_fail(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    left, right = pair
    kernel_timeouts(right, 0.05)
    assert right.gettimeout() is None  # blocking, so MSG_WAITALL can be used
    with pytest.raises(OSError):
        recv_bytes(right, 1)
    left.sendall(b"x")
    assert recv_bytes(right, 1) == b"x"  # positive control: data still arrives


# -- the server's per-transfer Deadline on a blocking plain socket ---------------------

IDLE_S = 300.0  # the connection's timeout between requests (the listener's)


def tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of a loopback TCP connection, with small fixed buffers (no autotuning),
    so a few MiB cannot all fit in flight."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        left = socket.create_connection(server.getsockname())
        right, _ = server.accept()
    for sock in (left, right):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
    return left, right


@pytest.fixture(params=["unix", "tcp"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[socket.socket, socket.socket]]:
    """(the server's end, with kernel timeouts as the listener sets them; the peer)."""
    ours, peer = socket.socketpair() if request.param == "unix" else tcp_pair()
    kernel_timeouts(ours, IDLE_S)
    yield ours, peer
    ours.close()
    peer.close()


def send_timeout_s(sock: socket.socket) -> float:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.calcsize("ll"))
    seconds, micros = struct.unpack("ll", raw)
    return float(seconds + micros / 1e6)


def test_a_transfer_that_moves_at_once_sets_no_timeout(
    served: tuple[socket.socket, socket.socket], timeouts_set: list[float]
) -> None:
    """A reply that fits the socket buffer, and a request body already received, cost no
    setsockopt: the deadline is only checked."""
    ours, peer = served
    reply: list[bytes | bytearray | memoryview] = [
        b"\0",
        bulkwire.SIZE.pack(4000),
        os.urandom(4000),
        bulkwire.END,
    ]
    send_parts(ours, reply, Deadline(2.0, IDLE_S))
    assert recv_bytes(peer, 4017) == b"".join(bytes(p) for p in reply)
    body = os.urandom(3000)
    peer.sendall(body)
    time.sleep(0.05)  # all of it has arrived
    assert recv_bytes(ours, 3000, Deadline(2.0, IDLE_S)) == body
    assert timeouts_set == []  # neither armed nor restored


def test_the_rest_of_a_transfer_is_armed_and_restored(
    served: tuple[socket.socket, socket.socket], timeouts_set: list[float]
) -> None:
    """What does not move at once (a send larger than the buffers, a receive of bytes
    still on their way) waits within the deadline, then the idle timeout is back."""
    ours, peer = served
    data = os.urandom(8 << 20)
    received = bytearray(len(data))

    def read_later() -> None:
        time.sleep(0.1)  # the buffers fill up first
        recv_exact(peer, memoryview(received))

    reader = in_thread(read_later)
    send_parts(ours, [data[:1000], memoryview(data)[1000:]], Deadline(10.0, IDLE_S))
    reader.join(10)
    assert received == data
    assert timeouts_set[-1] == IDLE_S and all(0 < s <= 10.0 for s in timeouts_set[:-1])
    timeouts_set.clear()
    peer.sendall(data[:100])  # the first part is there, the rest follows later

    def rest() -> None:
        time.sleep(0.1)
        peer.sendall(data[100:])

    in_thread(rest)
    assert recv_bytes(ours, len(data), Deadline(10.0, IDLE_S)) == data
    assert timeouts_set[-1] == IDLE_S and len(timeouts_set) >= 2
    assert send_timeout_s(ours) == pytest.approx(IDLE_S, abs=0.05)


def test_a_peer_that_never_reads_fails_a_large_send_by_its_deadline(
    served: tuple[socket.socket, socket.socket],
) -> None:
    ours, _peer = served
    started = time.monotonic()
    with pytest.raises(OSError):  # EAGAIN from the kernel's timeout, or TimeoutError
        send_parts(ours, [bytes(32 << 20)], Deadline(0.3, IDLE_S))
    assert 0.25 < time.monotonic() - started < 2.0  # the deadline, not the idle timeout
    assert send_timeout_s(ours) == pytest.approx(IDLE_S, abs=0.05)


def test_a_dripping_sender_makes_recv_exact_hit_its_deadline(
    served: tuple[socket.socket, socket.socket],
) -> None:
    """Every byte comes well within one receive's timeout; the transfer still ends."""
    ours, peer = served
    peer.sendall(b"ab")  # moves at once; the rest drips

    def drip() -> None:
        with contextlib.suppress(OSError):
            for _ in range(40):
                time.sleep(0.05)
                peer.sendall(b"x")

    in_thread(drip)
    started = time.monotonic()
    with pytest.raises(OSError):
        recv_bytes(ours, 42, Deadline(0.4, IDLE_S))
    assert time.monotonic() - started < 1.0  # 2 s of drip in all


def test_a_spent_deadline_raises_before_any_byte_moves(
    served: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = served
    spent = Deadline(0.0, IDLE_S)
    with pytest.raises(TimeoutError):
        send_parts(ours, [b"reply"], spent)
    peer.setblocking(False)
    with pytest.raises(BlockingIOError):
        peer.recv(1)  # nothing was sent
    peer.setblocking(True)
    peer.sendall(b"body")
    time.sleep(0.05)
    with pytest.raises(TimeoutError):
        recv_bytes(ours, 4, spent)
    assert recv_bytes(ours, 4) == b"body"  # nothing was taken


def test_a_closed_peer_fails_a_transfer_as_before(
    served: tuple[socket.socket, socket.socket],
) -> None:
    ours, peer = served
    peer.sendall(b"12345")
    peer.shutdown(socket.SHUT_WR)
    time.sleep(0.05)
    with pytest.raises(ConnectionClosed):  # the bytes that came, then the end
        recv_bytes(ours, 10, Deadline(2.0, IDLE_S))
    with pytest.raises(ConnectionClosed):  # only the end
        recv_bytes(ours, 10, Deadline(2.0, IDLE_S))
    peer.close()
    time.sleep(0.05)
    with pytest.raises((BrokenPipeError, ConnectionResetError)):
        for _ in range(3):  # TCP: the first send may only draw the peer's reset
            send_parts(ours, [b"reply"], Deadline(2.0, IDLE_S))
            time.sleep(0.05)


def test_a_receive_that_would_wait_hands_off_first_and_one_that_would_not_does_not() -> None:
    """On the bulk ready loop's thread (kvcommon.handoff armed), a receive whose bytes
    are all in hands nothing off (the positive control), and one that must wait for
    the rest hands off once before it waits, then still gets every byte."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        bulkio.kernel_timeouts(ours, 10.0)
        calls: list[str] = []
        with handoff.hands_off(lambda: calls.append("handed off")):
            theirs.sendall(b"x" * 100)
            assert bytes(bulkio.recv_bytes(ours, 100)) == b"x" * 100
            assert calls == []
            theirs.sendall(b"y" * 50)
            threading.Timer(0.05, theirs.sendall, (b"z" * 50,)).start()
            assert bytes(bulkio.recv_bytes(ours, 100)) == b"y" * 50 + b"z" * 50
            assert calls == ["handed off"]


@pytest.mark.parametrize("timeout", [None, 5.0], ids=["blocking", "timeout"])
def test_recv_exact_parts_fills_a_block_and_the_size_after_it_from_pieces(
    pair: tuple[socket.socket, socket.socket], timeout: float | None
) -> None:
    left, right = pair
    right.settimeout(timeout)
    data = os.urandom(300_001) + struct.pack(">Q", 0)
    sender = send_in_pieces(left, data, 70_001)
    block, size = bytearray(300_001), bytearray(8)
    recv_exact_parts(right, [memoryview(block), memoryview(size)])
    sender.join()
    assert bytes(block) + bytes(size) == data
    left.sendall(b"1234")
    left.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionClosed):
        recv_exact_parts(right, [memoryview(bytearray(2)), memoryview(bytearray(8))])


def test_a_reply_head_reads_a_short_error_frame_without_waiting_for_more(
    pair: tuple[socket.socket, socket.socket],
) -> None:
    """The client reads a status byte with the bytes an OK reply has after it; an error
    frame can be shorter than those (an empty message is 3 bytes), and must be read at
    once, not wait for bytes that never come."""
    left, right = pair
    kernel_timeouts(right, 5.0)
    left.sendall(error_frame(ResourceExhausted("")))
    started = time.monotonic()
    with pytest.raises(BlockStoreError) as raised:
        recv_reply(right, 64)
    assert raised.value.status == "RESOURCE_EXHAUSTED"
    assert time.monotonic() - started < 4.0  # not the receive timeout
    reply = os.urandom(8)
    left.sendall(bytes([OK]) + reply[:3])

    def rest() -> None:
        time.sleep(0.05)
        left.sendall(reply[3:])

    in_thread(rest)
    assert bytes(recv_reply(right, 8)) == reply  # and an OK reply that came in pieces
