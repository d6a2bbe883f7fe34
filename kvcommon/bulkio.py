"""Moving the bulk channel's bytes over a socket, within a time limit (the frames
themselves: kvcommon.bulkwire).

Payloads cross with no per-message framing, so each side moves them with as few
`sendmsg`/`recv_into` calls as the kernel allows and without copies: on a blocking
plain socket the kernel's own timeouts (`kernel_timeouts`) and MSG_WAITALL, elsewhere
Python's timeouts. A `Timer` bounds each transfer however slowly its bytes come; a
thread that serves other connections too hands off before it waits (kvcommon.handoff).
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from collections.abc import Callable
from typing import Protocol

from kvcommon import handoff
from kvcommon.bulkwire import ERROR, FRAME, ChannelBroken, ConnectionClosed

# OpenSSL's SSL_OP_ENABLE_KTLS (Python 3.12 names it ssl.OP_ENABLE_KTLS; 3.11 passes the
# bit through): record encryption moves into the kernel where it has the `tls` module,
# else OpenSSL stays in user space, silently. Set on both ends of the TLS bulk channel.
SSL_OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)
MAX_IOV = 512  # below Linux's IOV_MAX (1024) per sendmsg


def recv_frame(
    sock: socket.socket,
    min_size: int,
    max_size: int,
    deadline: Timer | None = None,
    *,
    expect: int = 0,
) -> bytearray:
    """The next sealed header's bytes (still sealed). A length outside what this point
    of the exchange allows is refused before anything is allocated for it.

    `expect`: the length the frame has when the exchange goes as planned (a reply's OK
    header), where a frame of any other length (an error frame) is the last thing the
    peer sends before it waits for this side. Then the length and up to `expect` bytes
    are asked for in one receive (`recv_some`): a frame that arrived whole costs one
    system call, not two. Bytes received beyond a shorter frame mean the peer is out of
    step: ChannelBroken."""
    if not expect:
        (size,) = FRAME.unpack(recv_bytes(sock, FRAME.size, deadline))
        check_frame_size(size, min_size, max_size)
        return recv_bytes(sock, size, deadline)
    head = bytearray(FRAME.size + expect)
    got = recv_some(sock, memoryview(head), deadline)
    if got < FRAME.size:
        recv_exact(sock, memoryview(head)[got : FRAME.size], deadline)
        got = FRAME.size
    (size,) = FRAME.unpack_from(head)
    check_frame_size(size, min_size, max_size)
    if got > FRAME.size + size:
        raise ChannelBroken("bytes beyond a sealed bulk frame")
    frame = bytearray(size)
    frame[: got - FRAME.size] = memoryview(head)[FRAME.size : got]
    if got < FRAME.size + size:  # the rest of a frame that came in pieces
        recv_exact(sock, memoryview(frame)[got - FRAME.size :], deadline)
    return frame


def check_frame_size(size: int, min_size: int, max_size: int) -> None:
    """ChannelBroken unless a sealed frame's length is one this point of the exchange
    allows (checked before anything is allocated or opened for it)."""
    if not min_size <= size <= max_size:
        raise ChannelBroken("a sealed bulk frame of an impossible length")


class Timer(Protocol):
    """What `recv_exact` and `send_parts` call around each system call to bound a
    transfer: `Deadline` (the server's, per transfer) or the client's per-call timer
    (replica_agent.deadline.SocketTimer)."""

    def arm(self, sock: socket.socket) -> None: ...

    def disarm(self, sock: socket.socket) -> None: ...


class Deadline:
    """A total time limit on one transfer, however slowly its bytes trickle in or are
    taken: before each system call the socket's timeout is set to what is left, and
    afterwards back to `idle_s` (the connection's timeout between requests).

    On a blocking plain socket `recv_exact` and `send_parts` first move what can move
    without waiting, and arm only for the rest: a small reply or request then costs no
    setsockopt, while a peer that drips or stops reading is bounded as before. (Only
    this timer: the client's `SocketTimer` sets no timeout on its fast path anyway.)"""

    def __init__(self, seconds: float, idle_s: float) -> None:
        self.at = time.monotonic() + seconds
        self.idle_s = idle_s

    def left_s(self) -> float:
        """Seconds left; TimeoutError, as a timed-out socket would raise, once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer did not complete within its deadline")
        return left

    def arm(self, sock: socket.socket) -> None:
        set_timeout(sock, self.left_s())

    def disarm(self, sock: socket.socket) -> None:
        set_timeout(sock, self.idle_s)


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """The socket's timeout, whichever kind it has: kernel timeouts on a blocking socket
    (`kernel_timeouts`), Python's own on a TLS or non-blocking one."""
    if sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket):
        _kernel_timeouts(sock, seconds)
    else:
        sock.settimeout(seconds)


def recv_exact(sock: socket.socket, view: memoryview, deadline: Timer | None = None) -> None:
    """Fill `view` completely from `sock` (within `deadline`, when given).

    On a blocking plain socket (timeouts set with SO_RCVTIMEO, see `kernel_timeouts`),
    MSG_WAITALL has the kernel fill the whole view in one call: one wake-up per block
    instead of one per ~64 KiB that arrived. There a `Deadline` is armed only for bytes
    that have not arrived yet (`_recv_now`). A thread that serves other connections too
    hands off before it waits for bytes (kvcommon.handoff)."""
    flags = 0
    if _waits_in_kernel(sock):
        flags = socket.MSG_WAITALL
        timed = isinstance(deadline, Deadline)
        if view.nbytes and (timed or handoff.armed()):
            if isinstance(deadline, Deadline):
                deadline.left_s()  # a spent deadline fails before any byte moves, as arm does
            view = view[_recv_now(sock, view) :]
            if not view.nbytes:
                return
            handoff.before_blocking()  # a thread serving other connections goes on
    elif handoff.armed():
        handoff.before_blocking()
    try:
        while view.nbytes:
            if deadline is not None:
                deadline.arm(sock)
            received = sock.recv_into(view, 0, flags)
            if received == 0:
                raise ConnectionClosed("peer closed the bulk connection")
            view = view[received:]
    finally:
        if deadline is not None:
            deadline.disarm(sock)


# `recv_exact_fed`: a block is received in pieces of this size, each handed on as it is
# in (while the next arrives, and while it is still in the cache); a socket timeout set
# for the rest of a transfer is set again once it is this much longer than what is left.
FEED_CHUNK_BYTES = 256 << 10
REARM_SLACK_S = 0.05


def recv_exact_fed(
    sock: socket.socket,
    view: memoryview,
    tail: memoryview,
    feed: Callable[[memoryview], None],
    deadline: Deadline | None = None,
) -> None:
    """Fill `view`, then `tail` (a few bytes that follow it: a tag), as `recv_exact_parts`
    would, calling `feed` with each piece of `view` as soon as it is in, in order: what
    had arrived already first, then pieces of FEED_CHUNK_BYTES. On a blocking plain
    socket the pieces are MSG_WAITALL receives, and the last takes `tail` with it; a
    `Deadline` is armed once for the rest (not per piece), checked before each piece and
    armed again only when the timeout set is REARM_SLACK_S longer than what is left.
    Elsewhere `view` is received whole, then fed, then `tail`."""
    if not _waits_in_kernel(sock):
        recv_exact(sock, view, deadline)
        feed(view)
        recv_exact(sock, tail, deadline)
        return
    if deadline is not None:
        deadline.left_s()  # a spent deadline fails before any byte moves, as arm does
    views = [part for part in (view, tail) if part.nbytes]
    fed = _recv_parts_now(sock, views)  # what has arrived, without waiting
    if fed:
        feed(view[: min(fed, view.nbytes)])
    view = view[min(fed, view.nbytes) :]
    if not views:
        return
    handoff.before_blocking()  # a thread serving other connections goes on
    armed_s = None
    try:
        while views:
            if deadline is not None:
                left = deadline.left_s()
                if armed_s is None or armed_s - left > REARM_SLACK_S:
                    set_timeout(sock, left)
                    armed_s = left
            batch = [views[0][:FEED_CHUNK_BYTES]]
            if views[0].nbytes <= FEED_CHUNK_BYTES and len(views) > 1:
                batch.append(views[1])  # the last piece of the block and its tail together
            received = sock.recvmsg_into(batch, 0, socket.MSG_WAITALL)[0]
            if received == 0:
                raise ConnectionClosed("peer closed the bulk connection")
            piece = min(received, view.nbytes)
            if piece:
                feed(view[:piece])
                view = view[piece:]
            _drop_sent(views, received)  # a short receive (a signal): the loop goes on
    finally:
        if deadline is not None and armed_s is not None:
            deadline.disarm(sock)


def _recv_parts_now(sock: socket.socket, views: list[memoryview]) -> int:
    """How many bytes of `views` were filled (and dropped from it) from what had arrived
    already, without waiting. ConnectionClosed if the peer has closed."""
    if not views:
        return 0
    try:
        received = sock.recvmsg_into(views[:MAX_IOV], 0, socket.MSG_DONTWAIT)[0]
    except BlockingIOError:
        return 0
    if received == 0:
        raise ConnectionClosed("peer closed the bulk connection")
    _drop_sent(views, received)
    return received


def recv_exact_parts(
    sock: socket.socket, views: list[memoryview], deadline: Timer | None = None
) -> None:
    """Fill every view of `views` in turn, as `recv_exact` fills one: on a blocking plain
    socket in one `recvmsg_into` (MSG_WAITALL) where the bytes have arrived, so a block
    and the size that follows it cost one system call, not two."""
    if not _waits_in_kernel(sock) or isinstance(deadline, Deadline) or handoff.armed():
        for view in views:
            recv_exact(sock, view, deadline)
        return
    views = [view for view in views if view.nbytes]
    try:
        while views:
            if deadline is not None:
                deadline.arm(sock)
            received = sock.recvmsg_into(views[:MAX_IOV], 0, socket.MSG_WAITALL)[0]
            if received == 0:
                raise ConnectionClosed("peer closed the bulk connection")
            _drop_sent(views, received)
    finally:
        if deadline is not None:
            deadline.disarm(sock)


def recv_some(sock: socket.socket, view: memoryview, deadline: Timer | None = None) -> int:
    """Receive what has arrived into `view`, at least one byte (waiting for it within
    `deadline`), at most `view`'s size: a reply whose length its first byte tells (an
    error frame, or OK and what follows) is then read in one call when it came whole.
    ConnectionClosed if the peer closed."""
    if handoff.armed():
        handoff.before_blocking()
    try:
        if deadline is not None:
            deadline.arm(sock)
        received = sock.recv_into(view)
    finally:
        if deadline is not None:
            deadline.disarm(sock)
    if received == 0:
        raise ConnectionClosed("peer closed the bulk connection")
    return received


def recv_fed(
    sock: socket.socket,
    view: memoryview,
    feed: Callable[[memoryview], None],
    deadline: Timer | None = None,
) -> None:
    """Fill `view` from `sock`, calling `feed` with each piece of FEED_CHUNK_BYTES (the
    last one shorter) as soon as it is in, in order: a reader works on a block's first
    pieces (opens them) while the rest is still on the wire. Whole pieces, not what
    happened to have arrived: fewer, larger calls to `feed` (and one wake-up a piece)
    cost the reader less. A client's `recv_exact_fed`: no tail, and any socket."""
    for start in range(0, view.nbytes, FEED_CHUNK_BYTES):
        piece = view[start : start + FEED_CHUNK_BYTES]
        recv_exact(sock, piece, deadline)
        feed(piece)


def _waits_in_kernel(sock: socket.socket) -> bool:
    """A blocking plain socket: its timeouts are the kernel's (`kernel_timeouts`), so
    arming a `Deadline` costs two setsockopt calls and restoring it two more. A TLS
    socket takes no flags on its calls; one with Python's timeout is polled anyway."""
    return sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket)


def _recv_now(sock: socket.socket, view: memoryview) -> int:
    """How many bytes of `view` were filled from what had arrived already, without
    waiting (MSG_DONTWAIT): a small request's body or a block in the receive buffer
    then needs no timeout set around it. ConnectionClosed if the peer has closed."""
    try:
        received = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0  # nothing there yet
    if received == 0:
        raise ConnectionClosed("peer closed the bulk connection")
    return received


def send_now(sock: socket.socket, views: list[memoryview]) -> None:
    """Send from the front of `views` (dropping what went) as much as the socket buffer
    takes at once (MSG_DONTWAIT): a reply that fits then needs no timeout set around it.
    Stops at the first send that takes less than it was offered: the buffer is full."""
    while views:
        batch = views[:MAX_IOV]
        try:
            sent = sock.sendmsg(batch, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return  # the buffer is full
        offered = len(views)
        _drop_sent(views, sent)
        if offered - len(views) < len(batch):  # a view it was offered is left: full
            return


def _drop_sent(views: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes of `views`, without copying the payloads."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views.pop(0)
    if views and sent:
        views[0] = views[0][sent:]


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make `sock` blocking with `seconds` as the kernel's send and receive timeouts
    (a call that waits longer fails with an OSError), so receives can use MSG_WAITALL,
    which Python's own timeouts (a non-blocking socket underneath) rule out."""
    sock.settimeout(None)
    _kernel_timeouts(sock, seconds)


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    timeval = struct.pack("ll", whole, max(1, int((seconds - whole) * 1_000_000)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def send_parts(
    sock: socket.socket,
    parts: list[bytes | bytearray | memoryview],
    deadline: Timer | None = None,
) -> None:
    """Send every byte of `parts` with as few `sendmsg` calls as the kernel allows
    (within `deadline`, when given: a peer that stops reading cannot hold the sender).

    A socket with a timeout is non-blocking underneath, so one `sendmsg` may send only a
    prefix: resume from where it stopped, without copying the payloads. On a blocking
    plain socket a `Deadline` is armed only for what the socket buffer did not take at
    once (`send_now`). A thread that serves other connections too hands off before it
    waits (kvcommon.handoff).
    """
    views = [memoryview(p).cast("B") for p in parts]
    if isinstance(deadline, Deadline) and views and _waits_in_kernel(sock):
        deadline.left_s()  # a spent deadline fails before any byte moves, as arm does
        send_now(sock, views)
        if not views:
            return
        handoff.before_blocking()  # a thread serving other connections goes on
    elif handoff.armed():
        handoff.before_blocking()
    try:
        while views:
            if deadline is not None:
                deadline.arm(sock)
            if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
                sock.sendall(views.pop(0))
                continue
            sent = sock.sendmsg(views[:MAX_IOV])  # the kernel takes at most IOV_MAX buffers
            _drop_sent(views, sent)
    finally:
        if deadline is not None:
            deadline.disarm(sock)


def recv_bytes(sock: socket.socket, size: int, deadline: Timer | None = None) -> bytearray:
    buffer = bytearray(size)
    recv_exact(sock, memoryview(buffer), deadline)
    return buffer


def recv_error(
    sock: socket.socket, start: bytes = b"", deadline: Timer | None = None
) -> tuple[int, str]:
    """The status code and message of an error frame whose first bytes, `start`, were
    read already (the rest is received here). The one parser of the frame."""
    head = start[: ERROR.size]
    if len(head) < ERROR.size:
        head += bytes(recv_bytes(sock, ERROR.size - len(head), deadline))
    code, length = ERROR.unpack(head)
    message = start[ERROR.size :]
    if len(message) < length:
        message += bytes(recv_bytes(sock, length - len(message), deadline))
    return code, bytes(message[:length]).decode("utf-8", "replace")
