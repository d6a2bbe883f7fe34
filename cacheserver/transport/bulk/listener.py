"""The bulk listener's connections: block bytes over plain TCP or TLS, beside gRPC.

Python gRPC costs about a millisecond per call and copies each payload several times;
this listener moves payloads with one `sendmsg` straight from the memory tier (or one
copy out of LMDB) and receives them with `recv_into`, on a thread per connection, so
the GIL is released for the whole transfer. Framing: `kvcommon.bulkwire`.

Security: a connection is let in only with a ticket from `OpenBulk`
(cacheserver.transport.bulk.handshake: TLS with the gRPC port's certificate, or the
sealed-payload channel); it is then bound to that principal and tenant, and every
request is admitted and carried out by the request core (cacheserver.core.requests),
the same verbs the gRPC handlers call. Which process serves a plain-TCP connection's
requests, this one or a bulk worker: cacheserver.transport.bulk.turns.

Same host: a second listener, on an abstract Unix socket with a random name (so no
one can claim it before the server, and only a caller told it by OpenBulk finds it),
takes the same tickets, and its hello hands the connection a shared-memory arena of its
own: payloads move through the arena, one copy each way instead of two, and no TCP
stack. The server copies a put's bytes out of the arena before it checks or hashes
them, so a client rewriting the arena meanwhile can only change its own block, as if it
had sent other bytes. Policy is the same code as on TCP
(cacheserver.transport.bulk.handler).

Errors: a request the core refuses gets its error frame and the connection closes (the
rest of the request may be in flight). Any other exception is a bug: the request gets
INTERNAL with a request id (kvcommon.errors.wire_error, as over gRPC), and the
connection serves on when the request was read whole and no reply had started
(`BulkHandler.in_step`). A failing socket or sealed frame closes the connection.

Each request is observed like an RPC (ServerTelemetry.rpc, methods `kvshare.bulk/Get`,
`kvshare.bulk/Put`, `kvshare.bulk/Hello`); a request flagged TRACED carries its
caller's trace context, so its span joins the caller's trace as a gRPC call's does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import threading
from collections.abc import Callable, Collection, Iterator

from cacheserver.config import BulkConfig
from cacheserver.core.requests import RequestCore
from cacheserver.telemetry import ServerTelemetry
from cacheserver.transport.arena import Arena, listen_locally
from cacheserver.transport.bulk.accepting import AcceptLoop, bind_listener
from cacheserver.transport.bulk.handler import OPS, BulkHandler, Pace
from cacheserver.transport.bulk.handshake import BULK_SYSTEM, BulkHandshake, opens_tls
from cacheserver.transport.bulk.readyloop import ReadyLoop
from cacheserver.transport.bulk.slots import ConnectionSlots
from cacheserver.transport.bulk.turns import DelegateTo, ServingTurns, reads_again
from kvcommon import bulkio, samehost
from kvcommon import bulkwire as w
from kvcommon.errors import KvshareError, wire_error
from kvcommon.tracing import context_from_binary
from policy.tickets import TicketBook

log = logging.getLogger(__name__)
# The spans' and counts' method names, made once (not a string built per request).
METHODS = {op: f"kvshare.bulk/{name}" for op, name in OPS.items()}
INVALID_METHOD = "kvshare.bulk/Invalid"
IDLE_TIMEOUT_S = 300.0  # an authenticated connection may idle between requests this long
# Before its ticket is accepted a peer is unauthenticated: it gets only this long, in
# total, to finish TLS and present the ticket (cacheserver.transport.bulk.slots).
HANDSHAKE_TIMEOUT_S = 5.0


class BulkServer:
    def __init__(
        self,
        host: str,
        core: RequestCore,
        tickets: TicketBook,
        tls: ssl.SSLContext | None = None,
        *,
        telemetry: ServerTelemetry | None = None,
        bulk: BulkConfig | None = None,
        port: int = 0,
        delegate_to: DelegateTo | None = None,
        ready_loop: bool = True,
    ) -> None:
        """`delegate_to`: hands an authenticated plain-TCP connection to a bulk worker
        (WorkerProcesses.delegate with the grant's Delegation), or keeps it (None).
        `ready_loop`: plain-TCP connections served here go on the ready loop
        (cacheserver.transport.bulk.readyloop) rather than a thread each; off where a
        request may wait on a remote tier."""
        self._telemetry = telemetry or ServerTelemetry()
        self._bulk = bulk or BulkConfig()
        self._core = core
        self._tickets = tickets
        self._tls = tls
        self._listener = bind_listener(host, port)
        _bound_host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopping = False
        self._slots = ConnectionSlots(HANDSHAKE_TIMEOUT_S)
        self._pace = Pace(self._bulk.min_transfer_bytes_per_s, IDLE_TIMEOUT_S)
        self._handshake = BulkHandshake(
            core, tickets, tls, self._slots, self._pace, self._telemetry, self._bulk
        )
        self.ready: ReadyLoop[BulkHandler] | None = None
        if ready_loop:
            self.ready = ReadyLoop(self._loop_serve_one, IDLE_TIMEOUT_S, lambda: self._stopping)
        self._turns = ServingTurns(
            core, delegate_to, self._serve_one, self.ready, self._close, lambda: self._stopping
        )
        self._reaper = threading.Thread(
            target=self._slots.reap, name="kvshare-bulk-reaper", daemon=True
        )
        self._loops: list[AcceptLoop] = []
        self._acceptors = [self._acceptor(self._listener, self._serve, "tcp")]
        # The same-host listener, as OpenBulk describes it: its abstract socket's name
        # (without the leading NUL), its host and network namespace, the server's uid.
        self.local_address = self.local_namespace = ""
        self.local_uid = os.getuid()
        local = listen_locally() if self._bulk.same_host else None
        self._local_listener = local[0] if local is not None else None
        if local is not None:
            self.local_address = local[1]
            self.local_namespace = samehost.host_namespace()
            self._acceptors.append(self._acceptor(local[0], self._serve_local, "local"))

    def _acceptor(
        self, listener: socket.socket, serve: Callable[[socket.socket], None], kind: str
    ) -> threading.Thread:
        def accepted(conn: socket.socket) -> None:
            with self._lock:
                self._connections.add(conn)
            self._slots.accept(conn, kind)
            try:
                threading.Thread(
                    target=serve, args=(conn,), name="kvshare-bulk", daemon=True
                ).start()
            except RuntimeError:
                self._forget(conn)
                raise

        loop = AcceptLoop(listener, kind, accepted, lambda: self._stopping)
        self._loops.append(loop)
        return threading.Thread(target=loop.run, name=f"kvshare-bulk-accept-{kind}", daemon=True)

    def problem(self) -> str | None:
        """Why a bulk listener cannot take connections now (health), or None."""
        problems = [p for p in (loop.problem() for loop in self._loops) if p]
        return "; ".join(problems) or None

    @property
    def handshake_timeout_s(self) -> float:
        return self._slots.handshake_timeout_s

    @handshake_timeout_s.setter
    def handshake_timeout_s(self, seconds: float) -> None:
        self._slots.handshake_timeout_s = seconds

    def use_tls(self, tls: ssl.SSLContext) -> None:
        """New TLS handshakes use `tls` (a certificate rotated by a live reload);
        connections already open keep the session they made."""
        self._tls = tls

    def close_principals(self, principals: Collection[str]) -> int:
        """Close every open connection of the named principals, on every path (TCP,
        TLS, the sealed channel, same-host arenas, connections a bulk worker serves);
        returns how many (ConnectionSlots.shut_principals)."""
        return self._slots.shut_principals(principals)

    def connections_of(self, principal: str) -> int:
        """The open connections bound to `principal` (every path)."""
        return self._slots.held_by(principal)

    @property
    def arenas(self) -> int:
        """Same-host connections holding an arena now."""
        return self._handshake.arenas.total

    def start(self) -> str:
        self._reaper.start()
        for acceptor in self._acceptors:
            acceptor.start()
        return self.address

    def stop(self) -> None:
        self._stopping = True
        # shutdown() wakes threads blocked in accept()/recv(); close() alone does not.
        _close_quietly(self._listener)
        if self._local_listener is not None:
            _close_quietly(self._local_listener)
        with self._lock:
            for conn in list(self._connections):
                _close_quietly(conn)
        self._slots.close()
        if self.ready is not None:
            self.ready.stop()
        for acceptor in self._acceptors:
            acceptor.join(timeout=5)

    @contextlib.contextmanager
    def _connection_scope(self, raw: socket.socket) -> Iterator[_Scope]:
        """One accepted connection's thread, for both listeners: a client going away
        ends it quietly (nothing acknowledged is affected), anything else is logged;
        either way the connection slot is given back, unless the ready loop adopted
        the connection (it gives the slot back when the connection ends)."""
        scope = _Scope()
        try:
            yield scope
        except (OSError, w.ConnectionClosed, ssl.SSLError):
            pass
        except Exception:
            log.exception("bulk connection failed")
        finally:
            if not scope.adopted:
                self._forget(raw)

    def _serve(self, raw: socket.socket) -> None:
        conn = raw
        with self._connection_scope(raw) as scope:
            try:
                raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                raw.settimeout(self.handshake_timeout_s)
                if self._tls is not None and opens_tls(raw):
                    # Wrapping detaches `raw`: the slot and the stop list must hold the
                    # wrapped socket before the handshake, or neither the reaper nor
                    # stop() could shut a peer that drips its handshake or its hello.
                    conn = self._tls.wrap_socket(
                        raw, server_side=True, do_handshake_on_connect=False
                    )
                    self._rebind(raw, conn)
                    assert isinstance(conn, ssl.SSLSocket)
                    conn.do_handshake()
                handler = self._handshake.hello_tcp(conn, raw)
                if handler is None:
                    return
                if conn is raw:  # plain TCP: kernel timeouts, so receives can wait for all
                    bulkio.kernel_timeouts(raw, IDLE_TIMEOUT_S)
                    scope.adopted = self._turns.serve(raw, handler)
                    return
                else:
                    conn.settimeout(IDLE_TIMEOUT_S)
                while self._serve_one(handler):
                    pass
            finally:
                if not scope.adopted:
                    _close_quietly(conn)
                    self._forget(conn)  # the wrapped socket, if TLS; `raw` is forgotten too

    def _loop_serve_one(self, handler: BulkHandler, peeked: memoryview | None) -> bool:
        """One request of a connection on the ready loop. A connection a bulk worker gave
        back leaves the loop for a worker again once its last REDELEGATE_AFTER_READS
        requests were reads (`ServingTurns`)."""
        if not self._serve_one(handler, peeked):
            return False
        return not (handler.given_back and reads_again(handler))

    def _close(self, raw: socket.socket) -> None:
        _close_quietly(raw)
        self._forget(raw)

    def _serve_local(self, conn: socket.socket) -> None:
        """A same-host connection: the same handshake and requests as `_serve`, with
        payloads in the connection's arena."""
        opened: tuple[BulkHandler, Arena] | None = None
        with self._connection_scope(conn):
            try:
                conn.settimeout(self.handshake_timeout_s)
                opened = self._handshake.hello_local(conn)
                if opened is None:
                    return
                bulkio.kernel_timeouts(conn, IDLE_TIMEOUT_S)
                while self._serve_one(opened[0]):
                    pass
            finally:
                _close_quietly(conn)
                if opened is not None:
                    handler, arena = opened
                    self._handshake.close_arena(arena, handler.grant.principal.name)

    def _rebind(self, raw: socket.socket, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(raw)
            self._connections.add(conn)
        self._slots.rebind(raw, conn)

    def _forget(self, conn: socket.socket) -> None:
        self._slots.release(conn)
        with self._lock:
            self._connections.discard(conn)

    def _serve_one(
        self, handler: BulkHandler, peeked: memoryview | None = None, *, rate_drawn: bool = False
    ) -> bool:
        """One request; False when the connection should close. `peeked`: the ready
        loop saw its header and body whole in the socket; `rate_drawn`: a bulk worker
        handed the request back after drawing its rate."""
        try:
            if peeked is not None:
                handler.take_peeked(peeked)
            op, model_len, count, trace = handler.recv_request()
        except w.ConnectionClosed:
            return False
        parent = None if trace is None else context_from_binary(trace)
        method = METHODS.get(op, INVALID_METHOD)
        with self._telemetry.rpc(method, parent, system=BULK_SYSTEM) as call:
            try:
                handler.handle(op, model_len, count, rate_drawn=rate_drawn)
                return True
            except OSError:
                raise  # the connection failed, or a sealed frame did: it closes
            except Exception as error:
                answer = wire_error(error, method)
                call.status = answer.status
                # A refusal closes the connection, as clients expect (the rest of its
                # request may still be in flight); after an internal error, one left at
                # a request boundary serves on.
                serves_on = not isinstance(error, KvshareError) and handler.in_step
                handler.send_error(answer)
                return serves_on


class _Scope:
    """What a connection's thread leaves when it returns: `adopted`, the connection
    lives on, on the ready loop."""

    adopted = False


def _close_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()/recv()
    with contextlib.suppress(OSError):
        conn.close()
