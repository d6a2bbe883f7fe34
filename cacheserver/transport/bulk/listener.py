"""The bulk listener's connections: block bytes over plain TCP or TLS, beside gRPC.

Python gRPC costs about a millisecond per call and copies each payload several times;
this listener moves payloads with one `sendmsg` straight from the memory tier (or one
copy out of LMDB) and receives them with `recv_into`, on a thread per connection, so
the GIL is released for the whole transfer. Framing: `kvcommon.bulkwire`.

Security: a connection is opened only with a ticket from `OpenBulk`, which gRPC issued
after authenticating the caller (policy.TicketBook); the connection is then bound to
that principal and tenant, and every request is admitted and carried out by the request
core (cacheserver.core.requests), the same verbs the gRPC handlers call. With TLS on the gRPC
port, this listener uses the same certificate (and client-certificate CA), and on the
same port takes the sealed-payload channel (cacheserver.transport.bulk.sealed): a client whose
first byte does not start TLS must say "KVB2" and prove the secret OpenBulk gave it
over TLS for a tenant that requires sealed blocks; a ticket in clear is refused.

Same host: a second listener, on an abstract Unix socket with a random name (so no
one can claim it before the server, and only a caller told it by OpenBulk finds it),
takes the same tickets. After the handshake it hands the connection a shared-memory
arena of its own (a memfd, sealed so that the client can neither shrink nor grow it:
no access of the server's can fault), and payloads move through the arena: one copy
each way instead of two, and no TCP stack. The server copies a put's bytes out of the
arena before it checks or hashes them, so a client rewriting the arena meanwhile can
only change its own block, as if it had sent other bytes. Policy is the same code as
on TCP (cacheserver.transport.bulk.handler).

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
from collections.abc import Callable, Iterator

from cacheserver.config import BulkConfig
from cacheserver.core.requests import RequestCore
from cacheserver.core.values import Verb
from cacheserver.telemetry import ServerTelemetry
from cacheserver.transport.arena import Arena, ArenaCount, listen_locally
from cacheserver.transport.bulk.accepting import AcceptLoop, bind_listener
from cacheserver.transport.bulk.delegation import (
    CLOSED,
    GIVE_BACK,
    HAND_BACK,
    RATE_DRAWN,
    REDELEGATE_AFTER_READS,
    SERVED_ON,
)
from cacheserver.transport.bulk.handler import OPS, BulkHandler, Pace, send_error_frame
from cacheserver.transport.bulk.readyloop import ReadyLoop
from cacheserver.transport.bulk.sealed import SealedHandler, SealedHello
from cacheserver.transport.bulk.slots import ConnectionSlots
from kvcommon import bulkio, samehost
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument, KvshareError, ResourceExhausted, wire_error
from kvcommon.tracing import context_from_binary
from policy.identity import certificate_fingerprint
from policy.tickets import Grant, Route, TicketBook
from policy.types import PUBLIC

log = logging.getLogger(__name__)
# Hands a connection past its hello to a bulk worker (True: to a worker, skipping the
# server's own turn): the server's end of the connection's hand-back pair, or None to
# serve it here.
DelegateTo = Callable[[socket.socket, Grant, bool], socket.socket | None]
IDLE_TIMEOUT_S = 300.0  # an authenticated connection may idle between requests this long
_READS = (Verb.GET, Verb.LOOKUP)
# Before its ticket is accepted a peer is unauthenticated: it gets only this long, in
# total, to finish TLS and present the ticket (cacheserver.transport.bulk.slots).
HANDSHAKE_TIMEOUT_S = 5.0
BULK_SYSTEM = "kvshare_bulk"  # the `rpc.system` of this listener's spans
# The sealed-payload channel's hello, counted apart: an operator sees which channel
# replicas use (kvshare_rpc_requests_total{method="kvshare.bulk/SealedHello"}).
SEALED_HELLO = "kvshare.bulk/SealedHello"


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
        (BulkWorkers.delegate with the grant's Delegation), or keeps it (None).
        `ready_loop`: plain-TCP connections served here go on the ready loop
        (cacheserver.transport.bulk.readyloop) rather than a thread each; off where a
        request may wait on a remote tier."""
        self._telemetry = telemetry or ServerTelemetry()
        self._delegate_to = delegate_to
        self._bulk = bulk or BulkConfig()
        self._core = core
        self._tickets = tickets
        self._tls = tls
        self._listener = bind_listener(host, port)
        _bound_host, port = self._listener.getsockname()[:2]
        self.address = f"{host}:{port}"
        self._connections: set[socket.socket] = set()
        self._arenas = ArenaCount(self._bulk.max_arenas, self._bulk.max_arenas_per_principal)
        self._lock = threading.Lock()
        self._stopping = False
        self._slots = ConnectionSlots(HANDSHAKE_TIMEOUT_S)
        self._pace = Pace(self._bulk.min_transfer_bytes_per_s, IDLE_TIMEOUT_S)
        self.ready: ReadyLoop[BulkHandler] | None = None
        if ready_loop:
            self.ready = ReadyLoop(self._loop_serve_one, IDLE_TIMEOUT_S, lambda: self._stopping)
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

    @property
    def arenas(self) -> int:
        """Same-host connections holding an arena now."""
        return self._arenas.total

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
                if self._tls is not None and _opens_tls(raw):
                    # Wrapping detaches `raw`: the slot and the stop list must hold the
                    # wrapped socket before the handshake, or neither the reaper nor
                    # stop() could shut a peer that drips its handshake or its hello.
                    conn = self._tls.wrap_socket(
                        raw, server_side=True, do_handshake_on_connect=False
                    )
                    self._rebind(raw, conn)
                    assert isinstance(conn, ssl.SSLSocket)
                    conn.do_handshake()
                handler = self._hello_tcp(conn, raw)
                if handler is None:
                    return
                if conn is raw:  # plain TCP: kernel timeouts, so receives can wait for all
                    bulkio.kernel_timeouts(raw, IDLE_TIMEOUT_S)
                    scope.adopted = self._serve_plain(raw, handler)
                    return
                else:
                    conn.settimeout(IDLE_TIMEOUT_S)
                while self._serve_one(handler):
                    pass
            finally:
                if not scope.adopted:
                    _close_quietly(conn)
                    self._forget(conn)  # the wrapped socket, if TLS; `raw` is forgotten too

    def _serve_plain(
        self, raw: socket.socket, handler: BulkHandler, to_a_worker: bool = False
    ) -> bool:
        """A plain-TCP connection: here, or (with bulk workers, in turn) on a worker;
        one the worker gives back (it only wrote) goes to a worker again once it reads
        (`_loop_serve_one`). Served here, it goes on the ready loop: True (the loop
        closes it, or hands it to a worker again)."""
        handler.given_back = False
        while (handback := self._delegate(raw, handler, to_a_worker)) is not None:
            if not self._serve_handed_back(handback, handler):
                return False
            handler.reads_in_a_row = 0
            if self.ready is not None:
                handler.given_back = True
                break
            if not self._serve_until_reads(handler):
                return False
            to_a_worker = True
        if self.ready is not None:
            sealed = isinstance(handler, SealedHandler)
            self.ready.adopt(
                raw, handler, lambda: self._leave_loop(raw, handler), peekable=not sealed
            )
            return True
        while self._serve_one(handler):
            pass
        return False

    def _loop_serve_one(self, handler: BulkHandler, peeked: memoryview | None) -> bool:
        """One request of a connection on the ready loop. A connection a bulk worker gave
        back leaves the loop for a worker again once its last REDELEGATE_AFTER_READS
        requests were reads (`_leave_loop`)."""
        if not self._serve_one(handler, peeked):
            return False
        return not (handler.given_back and _reads_again(handler))

    def _leave_loop(self, raw: socket.socket, handler: BulkHandler) -> None:
        """A connection leaves the ready loop: closed, or (given back, it reads again)
        handed to a bulk worker on a thread of its own, as a new connection is."""
        reads_again = handler.given_back and handler.reads_in_a_row >= REDELEGATE_AFTER_READS
        if not reads_again or self._stopping:
            self._close(raw)
            return

        def redelegate() -> None:
            adopted = False
            try:
                adopted = self._serve_plain(raw, handler, to_a_worker=True)
            except (OSError, w.ConnectionClosed, ssl.SSLError):
                pass  # the peer went, or a transfer ran out of time: it closes, as ever
            except Exception:
                log.exception("bulk connection failed")
            finally:
                if not adopted:
                    self._close(raw)

        threading.Thread(target=redelegate, name="kvshare-bulk-conn", daemon=True).start()

    def _close(self, raw: socket.socket) -> None:
        _close_quietly(raw)
        self._forget(raw)

    def _serve_until_reads(self, handler: BulkHandler) -> bool:
        """Serve a connection a worker gave back until its last REDELEGATE_AFTER_READS
        requests were reads (True); False when it closes. (Without the ready loop.)"""
        while self._serve_one(handler):
            if _reads_again(handler):
                return True
        return False

    def _delegate(
        self, raw: socket.socket, handler: BulkHandler, to_a_worker: bool = False
    ) -> socket.socket | None:
        """Hand a plain-TCP connection to a bulk worker, in turn (cacheserver.transport.bulk
        .workers; `to_a_worker`: skipping the server's own turn): the server's end of its
        hand-back pair, or None to serve it here."""
        grant = handler.grant
        if self._delegate_to is None or grant.channel_secret or grant.tenant == PUBLIC:
            return None  # the sealed channel and the public scope stay in the server
        return self._delegate_to(raw, grant, to_a_worker)

    def _serve_handed_back(self, handback: socket.socket, handler: BulkHandler) -> bool:
        """A delegated connection: serve each request its worker hands back, on this
        process's own descriptor of the connection, until the worker lets it go. True:
        the worker gave the connection back (GIVE_BACK), and it serves on here."""
        with handback:
            while (message := handback.recv(8))[:1] in (HAND_BACK, GIVE_BACK):
                serves_on = self._serve_one(handler, rate_drawn=message[1:2] == RATE_DRAWN)
                if message[:1] == GIVE_BACK:
                    return serves_on
                if handler.last_verb in _READS:
                    self._core.read_handed_back()
                handback.sendall(SERVED_ON if serves_on else CLOSED)
                if not serves_on:
                    return False
        return False

    def _hello_tcp(self, conn: socket.socket, raw: socket.socket) -> BulkHandler | None:
        """The TCP listener's hello: a ticket over TLS (plain TCP where the server has
        no TLS), or the sealed-payload channel's "KVB2" over plain TCP, whose ticket
        only opens with its proof (cacheserver.transport.bulk.sealed). None: refused."""
        magic, ticket = w.HELLO.unpack(bulkio.recv_bytes(conn, w.HELLO.size))
        if magic == w.MAGIC_SEALED and conn is raw:
            hello = SealedHello(raw, ticket, self._tickets)
            grant = self._handshake(conn, raw, hello.redeem, SEALED_HELLO)
            return None if grant is None else hello.accept(self._core, grant, self._pace)
        tls_required = self._tls is not None
        grant = self._handshake(
            conn, conn, lambda: self._redeem(magic, ticket, conn, Route.TLS, tls_required)
        )
        if grant is None:
            return None
        conn.sendall(bytes([w.OK]))
        return BulkHandler(self._core, conn, grant, None, self._pace)

    def _serve_local(self, conn: socket.socket) -> None:
        """A same-host connection: the same handshake and requests as `_serve`, with
        payloads in the connection's arena."""
        arena: Arena | None = None
        with self._connection_scope(conn):
            try:
                conn.settimeout(self.handshake_timeout_s)
                magic, ticket = w.HELLO.unpack(bulkio.recv_bytes(conn, w.HELLO.size))
                grant = self._handshake(
                    conn, conn, lambda: self._redeem(magic, ticket, conn, Route.LOCAL)
                )
                if grant is None:
                    return
                principal = grant.principal.name
                arena = self._open_arena(conn, principal)
                if arena is None:
                    return
                try:
                    socket.send_fds(conn, [w.ARENA_REPLY.pack(w.OK, arena.size)], [arena.fd])
                finally:
                    arena.close_fd()  # the client holds its own descriptor now
                bulkio.kernel_timeouts(conn, IDLE_TIMEOUT_S)
                handler = BulkHandler(self._core, conn, grant, arena, self._pace)
                while self._serve_one(handler):
                    pass
            finally:
                _close_quietly(conn)
                if arena is not None:
                    try:
                        arena.close()
                    finally:
                        self._arenas.give_back(principal)

    def _open_arena(self, conn: socket.socket, principal: str) -> Arena | None:
        """This connection's arena, or None (and an error frame) when no more may open."""
        try:
            self._arenas.take(principal)
        except ResourceExhausted as error:
            send_error_frame(conn, error)
            return None
        try:
            return Arena(self._bulk.arena_bytes)
        except OSError as error:
            self._arenas.give_back(principal)
            log.error("cannot create a same-host arena: %s", error.strerror)
            refusal = ResourceExhausted("the server could not create a shared-memory arena")
            send_error_frame(conn, refusal)
            return None

    def _rebind(self, raw: socket.socket, conn: socket.socket) -> None:
        with self._lock:
            self._connections.discard(raw)
            self._connections.add(conn)
        self._slots.rebind(raw, conn)

    def _forget(self, conn: socket.socket) -> None:
        self._slots.release(conn)
        with self._lock:
            self._connections.discard(conn)

    def _handshake(
        self,
        conn: socket.socket,
        raw: socket.socket,
        redeem: Callable[[], Grant],
        method: str = "kvshare.bulk/Hello",
    ) -> Grant | None:
        """Redeem the client's ticket (`redeem`) and take an authenticated slot for `raw`
        (the accepted socket); None (and an error frame sent) if either fails."""
        with self._telemetry.rpc(method, None, system=BULK_SYSTEM) as call:
            try:
                grant = redeem()
                self._slots.authenticated(raw, grant.principal.name)
                return grant
            except OSError:
                raise
            except Exception as error:
                answer = wire_error(error, method)
                call.status = answer.status
                send_error_frame(conn, answer)
                return None

    def _redeem(
        self,
        magic: bytes,
        ticket: bytes,
        conn: socket.socket,
        route: Route,
        tls_required: bool = False,
    ) -> Grant:
        if magic != w.MAGIC:
            raise InvalidArgument("not a kvshare bulk client (bad magic)")
        if tls_required and not isinstance(conn, ssl.SSLSocket):
            raise InvalidArgument(
                "this bulk listener speaks TLS, as the gRPC port does; connect with TLS"
            )
        peer = b""
        if isinstance(conn, ssl.SSLSocket):
            peer = certificate_fingerprint(conn.getpeercert(binary_form=True) or b"")
        return self._tickets.redeem(ticket, route, peer)

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
        name = OPS.get(op, "Invalid")
        method = f"kvshare.bulk/{name}"
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


def _reads_again(handler: BulkHandler) -> bool:
    """After a request of a connection a bulk worker gave back: whether its last
    REDELEGATE_AFTER_READS requests were reads (it goes to a worker again)."""
    handler.reads_in_a_row = handler.reads_in_a_row + 1 if handler.last_verb in _READS else 0
    return handler.reads_in_a_row >= REDELEGATE_AFTER_READS


class _Scope:
    """What a connection's thread leaves when it returns: `adopted`, the connection
    lives on, on the ready loop."""

    adopted = False


def _opens_tls(raw: socket.socket) -> bool:
    """Whether the client's first byte starts a TLS handshake (else: the sealed
    channel's hello, or a client that is refused)."""
    return raw.recv(1, socket.MSG_PEEK) == bytes([w.TLS_RECORD_HANDSHAKE])


def _close_quietly(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)  # wakes a thread blocked in accept()/recv()
    with contextlib.suppress(OSError):
        conn.close()
