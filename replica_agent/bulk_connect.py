"""Opening a bulk-channel connection: TCP/TLS, the sealed-payload channel, or the same-host arena.

A connection is opened with a one-time ticket from OpenBulk. On the server's host (the
ticket names a same-host listener in this very network namespace, owned by the
server's user), the connection gets a shared-memory arena from the server; anywhere
else, or when the server has no arena to spare, it is a TCP (or TLS) connection to the
address OpenBulk announced — or, when that address names no host (a wildcard), to the
host this client dialed for gRPC (kvcommon.hostport, applied when the ticket is read).
A ticket that carries a channel secret opens the sealed-payload channel there instead
of TLS (replica_agent.bulk_sealed).

Every step of opening a connection takes what is left of the call's deadline
(replica_agent.deadline), so a listener that drips its handshake holds the call no
longer than its `timeout_s`.

Each connection keeps its receive buffers (replica_agent.bulk_buffers).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import select
import socket
import ssl
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvcommon import bulkio, samehost
from kvcommon import bulkwire as w
from policy.tickets import is_local_binding
from replica_agent.bulk_buffers import Buffers
from replica_agent.bulk_sealed import SealedChannel
from replica_agent.deadline import CallDeadline, SocketTimer
from replica_agent.errors import store_error
from replica_agent.grpc_calls import Ticket

log = logging.getLogger(__name__)


@dataclass
class Connection:
    sock: socket.socket
    traced: bool  # the server reads TRACED requests
    arena: mmap.mmap | None  # same host: the server's shared-memory arena for payloads
    buffers: Buffers
    timer: SocketTimer  # its socket's timeout, within the current call's deadline
    sealed: SealedChannel | None = None  # the sealed-payload channel's frames
    _poller: select.poll | None = field(default=None, repr=False)

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
    timer = _timer(deadline)
    sock = socket.create_connection((host, int(port)), timeout=timer.timeout_s)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if ticket.channel_secret:
            channel = SealedChannel.hello(
                sock, ticket.channel_secret, ticket.ticket, ticket.traced, timer
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
    return Connection(sock, ticket.traced, None, Buffers(), timer)


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


def _timer(deadline: CallDeadline) -> SocketTimer:
    """The timer of a connection opened now, its timeout what is left of `deadline`."""
    timer = SocketTimer(deadline.left_s())
    timer.deadline = deadline
    return timer


def can_use_local(ticket: Ticket) -> bool:
    """Whether to try the same-host listener at all: the server offers one, bound to
    where it counts (an older server binds nothing: TCP), and this process knows its
    own namespace."""
    return bool(ticket.local_address and ticket.local_binding and samehost.host_namespace())


def is_the_servers(ticket: Ticket, sock: socket.socket) -> bool:
    """Only in the server's own namespace, and only while the server's user holds it,
    is the listener's name the server's: a listener of that name anywhere else, or of
    another user (the name is free once the server dies), is an impostor that would
    get the ticket and the payloads. OpenBulk bound both to the ticket."""
    uid = samehost.peer_uid(sock)
    if uid is None:
        return False
    return is_local_binding(ticket.ticket, samehost.host_namespace(), uid, ticket.local_binding)


def connect_local(ticket: Ticket, deadline: CallDeadline) -> tuple[Connection | None, bool]:
    """The same-host connection and its arena; (None, whether the ticket was
    presented) when there is none to be had: another host or network namespace, or
    the server's arenas are all taken. Errors of policy are raised."""
    timer = _timer(deadline)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timer.timeout_s)
        try:
            sock.connect("\0" + ticket.local_address)
        except OSError:
            sock.close()
            return None, False  # not this server's host: TCP, same ticket
        if not is_the_servers(ticket, sock):
            # Another namespace's listener, or a process of another user that took the
            # name after the server went away. It gets no ticket (and no payloads).
            log.warning("the same-host bulk listener is not the server's; using TCP")
            sock.close()
            return None, False
        bulkio.send_parts(sock, [w.HELLO.pack(w.MAGIC, ticket.ticket)], timer)
        arena, data = _receive_arena(sock, timer)
        if arena is None and data[:1] == bytes([w.OK]):
            log.warning("same-host bulk channel gave no usable arena; using TCP")
            sock.close()
            return None, True
        if arena is None:
            if not data:
                raise w.ConnectionClosed("the same-host listener closed the connection")
            error = store_error(*bulkio.recv_error(sock, data, timer))
            if error.status != "RESOURCE_EXHAUSTED":
                raise error
            log.warning("same-host bulk channel refused (%s); using TCP", error.details())
            sock.close()
            return None, True
    except BaseException:
        sock.close()
        raise
    return Connection(sock, ticket.traced, arena, Buffers(), timer), True


def _receive_arena(sock: socket.socket, timer: SocketTimer) -> tuple[mmap.mmap | None, bytes]:
    """The arena the server sent with its reply (mapped), and the reply's bytes."""
    timer.arm(sock)
    data, fds, _flags, _addr = socket.recv_fds(sock, w.ARENA_REPLY.size, 1)
    try:
        if data[:1] != bytes([w.OK]):
            return None, data
        data += bulkio.recv_bytes(sock, w.ARENA_REPLY.size - len(data), timer)  # if split
        return _map_arena(fds, w.ARENA_REPLY.unpack(data)[1]), data
    finally:
        for fd in fds:
            os.close(fd)  # the mapping keeps the memory


def _map_arena(fds: Sequence[int], size: int) -> mmap.mmap | None:
    """Map the arena the server sent, if it is one: a memfd of `size` bytes sealed
    against shrinking and growing (else a later shrink would fault this process)."""
    if len(fds) != 1:
        return None
    try:
        needed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        sealed = fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & needed == needed
        if not sealed or os.fstat(fds[0]).st_size != size or size <= 0:
            return None
        return mmap.mmap(fds[0], size)
    except (OSError, ValueError, AttributeError):  # AttributeError: no seals here
        return None


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
