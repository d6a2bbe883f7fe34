"""The bulk channel's same-host connections: payloads through a shared-memory arena.

On the server's host (the ticket names a same-host listener in this very network
namespace, owned by the server's user), a connection to the server's abstract Unix
socket gets a shared-memory arena of its own in the hello's reply: the server writes a
GET's blocks into it and reads a PUT's blocks from it, one copy each way instead of two,
and no TCP stack. `connect_local` opens such a connection (or says why there is none:
TCP then); `read_arena` and `put_arena` are its GET and PUT, which `BulkChannel`
(replica_agent.bulk) calls for a connection that has an arena.

Requests bigger than the arena are split; a block bigger than the whole arena goes over
TCP (the channel's, `over_tcp`). Sizes the server announces are checked against the
arena before any view of it is made: a hostile or broken server gets DATA_LOSS.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import socket
from collections.abc import Callable, Iterator, Sequence

from kvcommon import bulkio, samehost
from kvcommon import bulkwire as w
from policy.tickets import is_local_binding
from replica_agent.bulk_buffers import Buffers
from replica_agent.bulk_connect import (
    Connection,
    call_timer,
    put_request,
    recv_reply,
    send_request,
)
from replica_agent.deadline import CallDeadline, SocketTimer
from replica_agent.errors import store_error
from replica_agent.grpc_calls import Ticket
from replica_agent.transport import Payload

log = logging.getLogger(__name__)

OverTcp = Callable[[Sequence[bytes]], Iterator[memoryview]]  # the rest of a GET, over TCP


# -- opening -------------------------------------------------------------------------


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
    timer = call_timer(deadline)
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


# -- requests ------------------------------------------------------------------------


def read_arena(
    conn: Connection,
    model: str,
    digests: Sequence[bytes],
    *,
    keep: bool,
    drop: Callable[[], None],
    over_tcp: OverTcp,
) -> Iterator[memoryview]:
    """The leading present payloads as views of the arena, a GET per arenaful; the
    rest over TCP from a block bigger than the whole arena on. `drop`: closes this
    connection, out of step after a failed request."""
    served = 0
    while served < len(digests):
        views, truncated = _get_arena(conn, model, digests[served:], drop)
        if truncated and not views:  # the next block is bigger than the whole arena
            yield from over_tcp(digests[served:])
            return
        served += len(views)
        if truncated and keep:  # the arena is written again by the next request
            views = [_kept(conn, v) for v in views]
        yield from views
        if not truncated:
            return


def _get_arena(
    conn: Connection, model: str, digests: Sequence[bytes], drop: Callable[[], None]
) -> tuple[list[memoryview], bool]:
    """One same-host GET: views of the blocks the server put in the arena, and
    whether it filled up before the next present block."""
    arena = conn.arena
    assert arena is not None
    try:
        send_request(conn, w.OP_GET, model, digests)
        reply = recv_reply(conn.sock, w.LOCAL_GET.size, conn.timer)
        count, truncated = w.LOCAL_GET.unpack(reply)
        if count > len(digests):
            raise store_error("DATA_LOSS", "the server described more blocks than asked")
        raw = bulkio.recv_bytes(conn.sock, count * w.SIZE.size, conn.timer)
        sizes = [size for (size,) in w.SIZE.iter_unpack(raw)]
        offsets, end = w.arena_offsets(sizes)
        if end > len(arena):
            raise store_error("DATA_LOSS", "the server described blocks outside the arena")
    except Exception:
        drop()
        raise
    view = memoryview(arena)
    return [view[o : o + n] for o, n in zip(offsets, sizes, strict=True)], bool(truncated)


def put_arena(
    conn: Connection,
    model: str,
    digests: Sequence[bytes],
    sizes: Sequence[int],
    payloads: Sequence[Payload],
    drop: Callable[[], None],
) -> list[bool]:
    """Store blocks that each fit the arena, an arenaful per PUT: the payloads are
    copied into the arena, then the request names their sizes."""
    arena = conn.arena
    assert arena is not None
    outcomes: list[bool] = []
    for start, end in _arena_batches(sizes, len(arena)):
        offsets, _ = w.arena_offsets(sizes[start:end])
        view = memoryview(arena)
        for offset, payload in zip(offsets, payloads[start:end], strict=True):
            samehost.copy_into(view[offset:], payload)
        view.release()
        try:
            outcomes += put_request(conn, model, digests[start:end], sizes[start:end], ())
        except Exception:
            drop()
            raise
    return outcomes


def _kept(conn: Connection, view: memoryview) -> memoryview:
    """`view` copied into the connection's buffers (valid until the next call)."""
    copy = conn.buffers.take(view.nbytes, keep=True)
    samehost.copy_into(copy, view)
    return copy


def _arena_batches(sizes: Sequence[int], capacity: int) -> Iterator[tuple[int, int]]:
    """Index ranges of consecutive blocks that each fit an arena of `capacity` bytes."""
    start, used = 0, 0  # used: where the next block would start
    for index, size in enumerate(sizes):
        if index > start and used + size > capacity:
            yield start, index
            start, used = index, 0
        used += size + (-size % w.ARENA_ALIGN)
    if start < len(sizes):
        yield start, len(sizes)
