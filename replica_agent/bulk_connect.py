"""Bulk-channel connections over TCP, TLS or the sealed-payload channel: opening one,
its GET and PUT with the payloads on the socket (`read_streamed`, `put_request`), and
the request framing every bulk connection shares (`send_request`, `recv_reply`).

A connection is opened with a one-time ticket from OpenBulk: a TCP (or TLS) connection
to the address OpenBulk announced — or, when that address names no host (a wildcard),
to the host this client dialed for gRPC (kvcommon.hostport, applied when the ticket is
read). A ticket that carries a channel secret opens the sealed-payload channel there
instead of TLS (replica_agent.bulk_sealed). On the server's host the connection may be
a same-host one instead, with a shared-memory arena (replica_agent.bulk_samehost):
the same `Connection`, the same request header and replies.

Every step of opening a connection takes what is left of the call's deadline
(replica_agent.deadline), so a listener that drips its handshake holds the call no
longer than its `timeout_s`.

Each connection keeps its receive buffers (replica_agent.bulk_buffers).
"""

from __future__ import annotations

import contextlib
import mmap
import select
import socket
import ssl
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.tracing import binary_context
from replica_agent.bulk_buffers import Buffers
from replica_agent.bulk_sealed import SealedChannel
from replica_agent.deadline import CallDeadline, SocketTimer
from replica_agent.errors import store_error
from replica_agent.grpc_calls import MAX_BLOCK_BYTES, Ticket
from replica_agent.transport import Payload


@dataclass
class Connection:
    sock: socket.socket
    traced: bool  # the server reads TRACED requests
    arena: mmap.mmap | None  # same host: the server's shared-memory arena for payloads
    buffers: Buffers
    timer: SocketTimer  # its socket's timeout, within the current call's deadline
    sealed: SealedChannel | None = None  # the sealed-payload channel's frames
    # GET replies come padded (bulkwire.ALIGNED): payloads at multiples of PAYLOAD_ALIGN.
    aligned: bool = False
    _poller: select.poll | None = field(default=None, repr=False)
    padding: memoryview = field(  # where a reply's padding is received, then dropped
        default_factory=lambda: memoryview(bytearray(w.PAYLOAD_ALIGN)), repr=False
    )

    def is_closed_by_peer(self) -> bool:
        """Whether this idle connection can no longer carry a request: the server closed
        it (it restarted, or its listener stopped) or sent bytes nobody asked for. One
        poll that does not wait; a kept connection is checked before each use."""
        if self.sock.fileno() < 0:
            return True
        if isinstance(self.sock, ssl.SSLSocket) and self.sock.pending():
            return True
        if self._poller is None:  # made once: the check runs before every call
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        return bool(self._poller.poll(0))  # readable (end of stream, stray bytes) or hung up

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            self.buffers.close()
            if self.arena is not None:
                with contextlib.suppress(BufferError):  # views still held: freed with them
                    self.arena.close()


def connect_tcp(
    ticket: Ticket, tls: ssl.SSLContext | None, server_name: str | None, deadline: CallDeadline
) -> Connection:
    """A connection to the TCP listener: the sealed-payload channel when the ticket
    carries its secret (plain TCP, replica_agent.bulk_sealed), else TLS when `tls`."""
    host, _, port = ticket.address.rpartition(":")
    host = host.strip("[]")  # an IPv6 literal, as a socket and TLS want it
    timer = call_timer(deadline)
    sock = socket.create_connection((host, int(port)), timeout=timer.timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ticket.channel_secret:
            channel = SealedChannel.hello(
                sock,
                ticket.channel_secret,
                ticket.ticket,
                ticket.traced,
                timer,
                batched=ticket.sealed_batches,
            )
            _wait_in_kernel(sock, deadline, timer)
            return Connection(sock, ticket.traced, None, Buffers(), timer, channel)
        if tls is not None:
            timer.arm(sock)  # the handshake gets what is left
            sock = tls.wrap_socket(sock, server_hostname=server_name or host)
        bulkio.send_parts(sock, [w.HELLO.pack(w.MAGIC, ticket.ticket)], timer)
        expect_ok(sock, timer)
        if tls is None:
            _wait_in_kernel(sock, deadline, timer)
    except BaseException:
        sock.close()
        raise
    return Connection(sock, ticket.traced, None, Buffers(), timer, aligned=ticket.aligned)


def _wait_in_kernel(sock: socket.socket, deadline: CallDeadline, timer: SocketTimer) -> None:
    """A plain TCP connection's timeouts become the kernel's (SO_RCVTIMEO/SO_SNDTIMEO on a
    blocking socket), still kept within each call's deadline by `timer`: a receive then
    waits for a whole block in one call (MSG_WAITALL), and no call polls before it
    moves bytes (Python's own timeouts poll before every send and receive: a 64 KiB
    GET made 6 polls beside its 5 sends and receives). TLS keeps Python's timeouts."""
    left = deadline.left_s()
    if left is not None:
        bulkio.kernel_timeouts(sock, left)
        timer.timeout_s = left


def call_timer(deadline: CallDeadline) -> SocketTimer:
    """The timer of a connection opened now, its timeout what is left of `deadline`."""
    timer = SocketTimer(deadline.left_s())
    timer.deadline = deadline
    return timer


def send_request(
    conn: Connection,
    op: int,
    model: str,
    digests: Sequence[bytes],
    then: Sequence[Payload] = (),
) -> None:
    """Send a request header, and `then` (a put's sizes and payloads) in the same
    `sendmsg`: the server wakes once, with the header and the first bytes at hand."""
    encoded = model.encode("utf-8")
    trace = binary_context() if conn.traced else None
    if trace is not None:
        op |= w.TRACED
    header = w.REQUEST.pack(op, len(encoded), len(digests))
    # The header, trace context, model and digests joined into one buffer (a few dozen
    # bytes per digest): send_parts makes a view of, and steps over, each part it gets.
    if trace is None:
        request = b"".join([header, encoded, *digests])
    else:
        request = b"".join([header, trace, encoded, *digests])
    try:
        bulkio.send_parts(conn.sock, [request, *then], conn.timer)
    except (BrokenPipeError, ConnectionResetError):
        # The server refused the request from its header and closed (a Unix socket
        # then fails the send at once): its error frame may be waiting to be read.
        expect_ok(conn.sock, conn.timer)
        raise


def put_request(
    conn: Connection,
    model: str,
    digests: Sequence[bytes],
    sizes: Sequence[int],
    payloads: Sequence[Payload],
) -> list[bool]:
    """One PUT: the payloads follow on the socket, or are in the arena already (none
    given); per block, whether it was newly stored."""
    raw_sizes = b"".join(w.SIZE.pack(size) for size in sizes)
    send_request(conn, w.OP_PUT, model, digests, [raw_sizes, *payloads])
    outcomes = recv_reply(conn.sock, len(digests), conn.timer)
    return [o == w.OUTCOME_STORED for o in outcomes]


def read_streamed(
    conn: Connection,
    model: str,
    digests: Sequence[bytes],
    *,
    keep: bool,
    drop: Callable[[], None],
) -> Iterator[memoryview]:
    """One GET whose payloads follow on the socket: each leading present payload as a
    view of the connection's buffers, as soon as it arrived. A read stopped before the
    reply's end (by the caller, a deadline or a bad size) leaves the connection out of
    step: `drop` closes it."""
    finished = False
    aligned = conn.aligned
    sock, timer, take = conn.sock, conn.timer, conn.buffers.take  # looked up once
    last = len(digests) - 1
    try:
        send_request(conn, w.OP_GET | (w.ALIGNED if aligned else 0), model, digests)
        size_buf = recv_reply(sock, w.SIZE.size, timer)  # the first size
        position = 1 + w.SIZE.size  # into the reply, past the status and that size
        for index in range(last + 2):
            (size,) = w.SIZE.unpack(size_buf)
            if size == 0:
                finished = True
                return
            if size > MAX_BLOCK_BYTES:
                raise store_error("DATA_LOSS", f"the server announced a {size}-byte block")
            pad = w.payload_padding(position) if aligned else 0
            position += pad + size + w.SIZE.size
            view = take(size, keep=keep)
            parts = [conn.padding[:pad], view] if pad else [view]
            if index < last:
                # yielded before the next size
                bulkio.recv_exact_parts(sock, parts, timer)
                yield view
                bulkio.recv_exact(sock, size_buf, timer)
            else:  # the last block asked for: the end follows it at once, read with it
                parts.append(size_buf)
                bulkio.recv_exact_parts(sock, parts, timer)
                yield view
        raise store_error("DATA_LOSS", "the server sent more blocks than were asked for")
    finally:
        if not finished:
            drop()  # stopped mid-stream: out of step


def expect_ok(sock: socket.socket, timer: bulkio.Timer | None = None) -> None:
    """Read a status byte; raise the server's error if it is not OK."""
    recv_reply(sock, 0, timer)


def recv_reply(sock: socket.socket, size: int, timer: bulkio.Timer | None = None) -> memoryview:
    """The `size` bytes that follow an OK status byte, received with it in one call when
    they arrived together (a reply's first bytes come in one segment); the server's
    error raised if the status is not OK."""
    head = memoryview(bytearray(1 + size))
    got = bulkio.recv_some(sock, head, timer)
    if head[0] != w.OK:
        raise store_error(*bulkio.recv_error(sock, bytes(head[:got]), timer))
    if got < head.nbytes:
        bulkio.recv_exact(sock, head[got:], timer)
    return head[1:]
