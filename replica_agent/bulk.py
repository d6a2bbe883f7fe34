"""Client side of the bulk channel (framing in `kvcommon.bulkwire`).

One connection per thread and tenant, opened with a one-time ticket from `OpenBulk`
and kept for reuse. GETs receive into a reused, page-aligned buffer that grows to the
largest reply seen, so steady-state transfers touch no fresh memory (a fresh buffer
per call caps near 1 GB/s on these machines: PERF-BASELINES). `get_views` hands out
memoryviews into that buffer — valid until the same thread's next bulk call — for
callers that decode at once; `get` returns copies.

On the server's host (OpenBulk names a same-host listener and it answers), a
connection instead gets a shared-memory arena from the server: a put's payloads are
copied into the arena and the request names their sizes; a get's blocks arrive in the
arena and are handed out as views of it, with the same lifetime. Bigger requests are
split to fit the arena; a block bigger than the whole arena goes over TCP.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence

from kvcommon import bulkwire as w
from kvcommon.tracing import binary_context

log = logging.getLogger(__name__)


class Ticket:
    """What OpenBulk answered: a one-time ticket and where to present it."""

    def __init__(
        self,
        ticket: bytes,
        address: str,
        traced: bool,
        local_address: str = "",
        local_namespace: str = "",
        local_owner: str = "",
    ) -> None:
        self.ticket = ticket
        self.address = address  # "host:port" of the TCP (or TLS) listener
        self.traced = traced  # the listener reads requests that carry a trace context
        self.local_address = local_address  # the same-host listener's name; "": none
        self.local_namespace = local_namespace  # where that name is the server's
        self.local_owner = local_owner  # the uid the server runs as ("": unknown)


OpenTicket = Callable[[str], Ticket]  # tenant -> a fresh ticket
RaiseStatus = Callable[[str, str], Exception]  # (status name, message) -> exception
PAGE = mmap.PAGESIZE
LOCAL_RETRY_S = 30.0  # after the same-host listener refused or failed, use TCP this long


class _Connection:
    def __init__(self, sock: socket.socket, traced: bool, arena: mmap.mmap | None) -> None:
        self.sock = sock
        self.traced = traced  # the server reads TRACED requests
        self.arena = arena  # same host: the server's shared-memory arena for payloads
        self.buffer = mmap.mmap(-1, 1 << 20)  # anonymous, page-aligned, grown on demand

    def ensure(self, size: int) -> memoryview:
        if len(self.buffer) < size:
            old = self.buffer
            self.buffer = mmap.mmap(-1, (size + PAGE - 1) // PAGE * PAGE)
            with contextlib.suppress(BufferError):  # views still held: freed with them
                old.close()
        return memoryview(self.buffer)

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            for mapping in (self.buffer, self.arena):
                with contextlib.suppress(BufferError):  # views still held: freed with them
                    if mapping is not None:
                        mapping.close()


class BulkChannel:
    def __init__(
        self,
        open_ticket: OpenTicket,
        raise_status: RaiseStatus,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        timeout_s: float | None = 30.0,
        *,
        same_host: bool = True,
    ) -> None:
        self._open_ticket = open_ticket
        self._same_host = same_host
        self._local_retry_at = 0.0
        self._raise = raise_status
        self._tls = tls
        self._server_name = server_name
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._all: list[_Connection] = []
        self._lock = threading.Lock()

    def _connection(self, tenant: str, *, tcp: bool = False) -> _Connection:
        """This thread's connection for `tenant`: same-host when it can be had, unless
        `tcp` asks for the TCP listener (a block too big for the arena)."""
        conns: dict[tuple[str, bool], _Connection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((tenant, tcp))
        if conn is None:
            conn = conns[(tenant, tcp)] = self._connect(tenant, tcp)
            with self._lock:
                self._all.append(conn)
        return conn

    def _connect(self, tenant: str, tcp: bool) -> _Connection:
        ticket = self._open_ticket(tenant)
        if (
            not tcp
            and self._same_host
            and ticket.local_address
            # Only in the server's own namespace is the name surely the server's: a
            # listener of that name anywhere else is an impostor (it would get the
            # ticket, and the payloads). An older server names no namespace: TCP.
            and ticket.local_namespace
            and ticket.local_namespace == w.host_namespace()
            and time.monotonic() >= self._local_retry_at
        ):
            conn, ticket_spent = self._connect_local(ticket)
            if conn is not None:
                return conn
            self._local_retry_at = time.monotonic() + LOCAL_RETRY_S
            if ticket_spent:
                ticket = self._open_ticket(tenant)
        host, _, port = ticket.address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self._server_name or host)
        sock.sendall(w.HELLO.pack(w.MAGIC, ticket.ticket))
        self._expect_ok(sock)
        return _Connection(sock, ticket.traced, None)

    def _connect_local(self, ticket: Ticket) -> tuple[_Connection | None, bool]:
        """The same-host connection and its arena; (None, whether the ticket was
        presented) when there is none to be had: another host or network namespace,
        or the server's arenas are all taken. Errors of policy are raised."""
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(self._timeout_s)
            try:
                sock.connect("\0" + ticket.local_address)
            except OSError:
                sock.close()
                return None, False  # not this server's host: TCP, same ticket
            if str(w.peer_uid(sock)) != ticket.local_owner:
                # Not the server's user: a process that took the name after the server
                # went away. It gets no ticket (and no payloads); TCP, same ticket.
                log.warning("the same-host bulk listener is not the server's user; using TCP")
                sock.close()
                return None, False
            sock.sendall(w.HELLO.pack(w.MAGIC, ticket.ticket))
            data, fds, _flags, _addr = socket.recv_fds(sock, w.ARENA_REPLY.size, 1)
            arena = None
            try:
                if data[:1] == bytes([w.OK]):
                    data += w.recv_bytes(sock, w.ARENA_REPLY.size - len(data))  # if split
                    arena = _map_arena(fds, w.ARENA_REPLY.unpack(data)[1])
                    if arena is None:  # no usable descriptor came (at our fd limit?)
                        log.warning("same-host bulk channel gave no usable arena; using TCP")
                        sock.close()
                        return None, True
            finally:
                for fd in fds:
                    os.close(fd)  # the mapping keeps the memory
            if arena is None:
                error = self._error_after(sock, bytes(data))
                if getattr(error, "status", "") != "RESOURCE_EXHAUSTED":
                    raise error
                log.warning("same-host bulk channel refused (%s); using TCP", error)
                sock.close()
                return None, True
        except BaseException:
            sock.close()
            raise
        return _Connection(sock, ticket.traced, arena), True

    def _error_after(self, sock: socket.socket, start: bytes) -> Exception:
        """The error of an error frame whose first bytes are `start`."""
        if not start:
            raise w.ConnectionClosed("the same-host listener closed the connection")
        head = start[: w.ERROR.size]
        if len(head) < w.ERROR.size:
            head += w.recv_bytes(sock, w.ERROR.size - len(head))
        status, length = w.ERROR.unpack(head)
        message = start[w.ERROR.size :]
        if len(message) < length:
            message += w.recv_bytes(sock, length - len(message))
        return self._raise(
            w.STATUS_NAMES.get(status, "INTERNAL"), message.decode("utf-8", "replace")
        )

    def _drop(self, tenant: str, *, tcp: bool = False) -> None:
        conn = self._local.__dict__.get("conns", {}).pop((tenant, tcp), None)
        if conn is not None:
            with self._lock:
                self._all.remove(conn)  # reconnects must not accumulate dead connections
            conn.close()

    def _expect_ok(self, sock: socket.socket) -> None:
        status = w.recv_bytes(sock, 1)[0]
        if status == w.OK:
            return
        length = int.from_bytes(w.recv_bytes(sock, 2), "big")
        message = w.recv_bytes(sock, length).decode("utf-8", "replace")
        raise self._raise(w.STATUS_NAMES.get(status, "INTERNAL"), message)

    def _request(
        self,
        conn: _Connection,
        op: int,
        model: str,
        digests: Sequence[bytes],
        then: Sequence[bytes | bytearray | memoryview] = (),
    ) -> None:
        """Send a request header, and `then` (a put's sizes and payloads) in the same
        `sendmsg`: the server wakes once, with the header and the first bytes at hand."""
        # A malformed request would desynchronise the stream; such calls take the gRPC
        # path instead, where the server answers INVALID_ARGUMENT with its own message.
        encoded = model.encode("utf-8")
        trace = binary_context() if conn.traced else None
        if trace is not None:
            op |= w.TRACED
        header = w.REQUEST.pack(op, len(encoded), len(digests))
        parts = [header, trace, encoded] if trace is not None else [header, encoded]
        try:
            w.send_parts(conn.sock, [*parts, b"".join(digests), *then])  # digests: one buffer
        except (BrokenPipeError, ConnectionResetError):
            # The server refused the request from its header and closed (a Unix socket
            # then fails the send at once): its error frame may be waiting to be read.
            self._expect_ok(conn.sock)
            raise

    def get_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[memoryview]:
        """Leading present payloads as views into this thread's reused buffer (or arena)."""
        _check_framable(model, digests)
        conn = self._connection(tenant)
        if conn.arena is None:
            return self._get_streamed(tenant, conn, model, digests, tcp=False)
        found: list[memoryview] = []
        while True:
            views, truncated = self._get_arena(tenant, conn, model, digests[len(found) :])
            if not truncated:
                return found + views
            if not views:  # the next block is bigger than the whole arena
                tcp = self._connection(tenant, tcp=True)
                rest = digests[len(found) :]
                return found + self._get_streamed(tenant, tcp, model, rest, tcp=True)
            found += [memoryview(bytes(v)) for v in views]  # the arena is reused next

    def _get_arena(
        self, tenant: str, conn: _Connection, model: str, digests: Sequence[bytes]
    ) -> tuple[list[memoryview], bool]:
        """One same-host GET: views of the blocks the server put in the arena, and
        whether it filled up before the next present block."""
        arena = conn.arena
        assert arena is not None
        try:
            self._request(conn, w.OP_GET, model, digests)
            self._expect_ok(conn.sock)
            count, truncated = w.LOCAL_GET.unpack(w.recv_bytes(conn.sock, w.LOCAL_GET.size))
            raw = w.recv_bytes(conn.sock, count * w.SIZE.size)
            sizes = [size for (size,) in w.SIZE.iter_unpack(raw)]
            offsets, end = w.arena_offsets(sizes)
            if end > len(arena):
                raise w.ConnectionClosed("the server described blocks outside the arena")
        except Exception:
            self._drop(tenant)
            raise
        view = memoryview(arena)
        return [view[o : o + n] for o, n in zip(offsets, sizes, strict=True)], bool(truncated)

    def _get_streamed(
        self, tenant: str, conn: _Connection, model: str, digests: Sequence[bytes], *, tcp: bool
    ) -> list[memoryview]:
        try:
            self._request(conn, w.OP_GET, model, digests)
            self._expect_ok(conn.sock)
            spans: list[tuple[int, int]] = []
            offset = 0
            size_buf = bytearray(w.SIZE.size)
            while True:
                w.recv_exact(conn.sock, memoryview(size_buf))
                (size,) = w.SIZE.unpack(size_buf)
                if size == 0:
                    break
                view = self._grow(conn, offset + size, spans)
                w.recv_exact(conn.sock, view[offset : offset + size])
                spans.append((offset, size))
                offset += size
        except Exception:
            self._drop(tenant, tcp=tcp)  # never reuse a connection left mid-frame
            raise
        view = memoryview(conn.buffer)
        return [view[start : start + size] for start, size in spans]

    @staticmethod
    def _grow(conn: _Connection, needed: int, spans: list[tuple[int, int]]) -> memoryview:
        if len(conn.buffer) >= needed:
            return memoryview(conn.buffer)
        kept = bytes(conn.buffer[: spans[-1][0] + spans[-1][1]]) if spans else b""
        view = conn.ensure(max(needed, 2 * len(conn.buffer)))
        view[: len(kept)] = kept
        return view

    def iter_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> Iterator[memoryview]:
        """Each leading present payload as soon as it has arrived, as a view that is valid
        until the next one is requested (all land at the start of one reused buffer), so
        the caller decodes block i while block i+1 is still arriving in the kernel."""
        _check_framable(model, digests)
        conn = self._connection(tenant)
        if conn.arena is None:
            return self._iter_streamed(tenant, conn, model, digests, tcp=False)
        return self._iter_arena(tenant, conn, model, digests)

    def _iter_arena(
        self, tenant: str, conn: _Connection, model: str, digests: Sequence[bytes]
    ) -> Iterator[memoryview]:
        served = 0
        while served < len(digests):
            views, truncated = self._get_arena(tenant, conn, model, digests[served:])
            if truncated and not views:  # the next block is bigger than the whole arena
                tcp = self._connection(tenant, tcp=True)
                yield from self._iter_streamed(tenant, tcp, model, digests[served:], tcp=True)
                return
            yield from views
            served += len(views)
            if not truncated:
                return

    def _iter_streamed(
        self, tenant: str, conn: _Connection, model: str, digests: Sequence[bytes], *, tcp: bool
    ) -> Iterator[memoryview]:
        finished = False
        try:
            self._request(conn, w.OP_GET, model, digests)
            self._expect_ok(conn.sock)
            size_buf = bytearray(w.SIZE.size)
            while True:
                w.recv_exact(conn.sock, memoryview(size_buf))
                (size,) = w.SIZE.unpack(size_buf)
                if size == 0:
                    finished = True
                    return
                view = conn.ensure(size)[:size]
                w.recv_exact(conn.sock, view)
                yield view
        finally:
            if not finished:
                self._drop(tenant, tcp=tcp)  # stopped mid-stream: out of step

    def get(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[bytes]:
        return [bytes(v) for v in self.get_views(tenant, model, digests)]

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[bytes | bytearray | memoryview],
    ) -> list[bool]:
        _check_framable(model, digests)
        if any(memoryview(p).nbytes == 0 for p in payloads):
            raise UseGrpc("empty payload")
        sizes = [memoryview(p).nbytes for p in payloads]
        conn, tcp = self._connection(tenant), False
        if conn.arena is not None and max(sizes, default=0) > len(conn.arena):
            conn, tcp = self._connection(tenant, tcp=True), True  # bigger than the arena
        if conn.arena is None:
            return self._put_request(tenant, conn, model, digests, sizes, payloads, tcp=tcp)
        outcomes: list[bool] = []
        for start, end in _arena_batches(sizes, len(conn.arena)):
            offsets, _ = w.arena_offsets(sizes[start:end])
            view = memoryview(conn.arena)
            for offset, payload in zip(offsets, payloads[start:end], strict=True):
                w.copy_into(view[offset:], payload)
            view.release()
            outcomes += self._put_request(
                tenant, conn, model, digests[start:end], sizes[start:end], (), tcp=False
            )
        return outcomes

    def _put_request(
        self,
        tenant: str,
        conn: _Connection,
        model: str,
        digests: Sequence[bytes],
        sizes: Sequence[int],
        payloads: Sequence[bytes | bytearray | memoryview],
        *,
        tcp: bool,
    ) -> list[bool]:
        """One PUT: the payloads follow on the socket, or are in the arena already."""
        try:
            raw_sizes = b"".join(w.SIZE.pack(size) for size in sizes)
            self._request(conn, w.OP_PUT, model, digests, [raw_sizes, *payloads])
            self._expect_ok(conn.sock)
            outcomes = w.recv_bytes(conn.sock, len(digests))
        except Exception:
            self._drop(tenant, tcp=tcp)
            raise
        return [o == w.OUTCOME_STORED for o in outcomes]

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


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


class UseGrpc(Exception):
    """This call cannot be framed on the bulk channel; send it over gRPC."""


def _check_framable(model: str, digests: Sequence[bytes]) -> None:
    if not model or len(model.encode("utf-8")) > 0xFFFF:
        raise UseGrpc("model")
    if any(len(d) != 32 for d in digests):
        raise UseGrpc("digest length")
