"""Client side of the bulk channel (framing in `kvshare.bulkwire`).

One connection per thread and tenant, opened with a one-time ticket from `OpenBulk`
and kept for reuse. GETs receive into a reused, page-aligned buffer that grows to the
largest reply seen, so steady-state transfers touch no fresh memory (a fresh buffer
per call caps near 1 GB/s on these machines: PERF-BASELINES). `get_views` hands out
memoryviews into that buffer — valid until the same thread's next bulk call — for
callers that decode at once; `get` returns copies.
"""

from __future__ import annotations

import contextlib
import mmap
import socket
import ssl
import threading
from collections.abc import Callable, Iterator, Sequence

from kvshare import bulkwire as w
from kvshare.tracing import binary_context

# tenant -> (ticket, "host:port", whether the listener takes trace contexts)
OpenTicket = Callable[[str], tuple[bytes, str, bool]]
RaiseStatus = Callable[[str, str], Exception]  # (status name, message) -> exception
PAGE = mmap.PAGESIZE


class _Connection:
    def __init__(self, sock: socket.socket, traced: bool) -> None:
        self.sock = sock
        self.traced = traced  # the server reads TRACED requests
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
            with contextlib.suppress(BufferError):  # views still held: freed with them
                self.buffer.close()


class BulkChannel:
    def __init__(
        self,
        open_ticket: OpenTicket,
        raise_status: RaiseStatus,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        timeout_s: float | None = 30.0,
    ) -> None:
        self._open_ticket = open_ticket
        self._raise = raise_status
        self._tls = tls
        self._server_name = server_name
        self._timeout_s = timeout_s
        self._local = threading.local()
        self._all: list[_Connection] = []
        self._lock = threading.Lock()

    def _connection(self, tenant: str) -> _Connection:
        conns: dict[str, _Connection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get(tenant)
        if conn is None:
            conn = conns[tenant] = self._connect(tenant)
            with self._lock:
                self._all.append(conn)
        return conn

    def _connect(self, tenant: str) -> _Connection:
        ticket, address, traced = self._open_ticket(tenant)
        host, _, port = address.rpartition(":")
        sock = socket.create_connection((host.strip("[]"), int(port)), timeout=self._timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self._tls is not None:
            sock = self._tls.wrap_socket(sock, server_hostname=self._server_name or host)
        sock.sendall(w.HELLO.pack(w.MAGIC, ticket))
        self._expect_ok(sock)
        return _Connection(sock, traced)

    def _drop(self, tenant: str) -> None:
        conn = self._local.__dict__.get("conns", {}).pop(tenant, None)
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
        w.send_parts(conn.sock, [*parts, b"".join(digests), *then])  # digests: one buffer

    def get_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[memoryview]:
        """Leading present payloads as views into this thread's reused buffer."""
        _check_framable(model, digests)
        conn = self._connection(tenant)
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
            self._drop(tenant)  # never reuse a connection left mid-frame
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
                self._drop(tenant)  # stopped mid-stream: the connection is out of step

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
        conn = self._connection(tenant)
        try:
            sizes = b"".join(w.SIZE.pack(memoryview(p).nbytes) for p in payloads)
            self._request(conn, w.OP_PUT, model, digests, [sizes, *payloads])
            self._expect_ok(conn.sock)
            outcomes = w.recv_bytes(conn.sock, len(digests))
        except Exception:
            self._drop(tenant)
            raise
        return [o == w.OUTCOME_STORED for o in outcomes]

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()


class UseGrpc(Exception):
    """This call cannot be framed on the bulk channel; send it over gRPC."""


def _check_framable(model: str, digests: Sequence[bytes]) -> None:
    if not model or len(model.encode("utf-8")) > 0xFFFF:
        raise UseGrpc("model")
    if any(len(d) != 32 for d in digests):
        raise UseGrpc("digest length")
