"""How a bulk connection is let in: its hello, its ticket, its authenticated slot.

A connection is opened only with a ticket from `OpenBulk`, which gRPC issued after
authenticating the caller (policy.TicketBook); redeeming it binds the connection to that
principal and tenant. With TLS on the gRPC port the TCP listener uses the same
certificate (and client-certificate CA), and on the same port takes the sealed-payload
channel (cacheserver.transport.bulk.sealed): a client whose first byte does not start
TLS must say "KVB2" and prove the secret OpenBulk gave it over TLS for a tenant that
requires sealed blocks; a ticket in clear is refused.

The same-host listener takes the same tickets, then hands the connection a
shared-memory arena of its own (a memfd, sealed so that the client can neither shrink
nor grow it: no access of the server's can fault), at most [bulk] max_arenas of them.

Every hello is observed like an RPC (`kvshare.bulk/Hello`, `kvshare.bulk/SealedHello`);
a refused one gets its error frame, and the connection closes.
"""

from __future__ import annotations

import logging
import socket
import ssl
from collections.abc import Callable

from cacheserver.config import BulkConfig
from cacheserver.core.requests import RequestCore
from cacheserver.telemetry import ServerTelemetry
from cacheserver.transport.arena import Arena, ArenaCount
from cacheserver.transport.bulk.handler import BulkHandler, Pace, send_error_frame
from cacheserver.transport.bulk.sealed import SealedHello
from cacheserver.transport.bulk.slots import ConnectionSlots
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument, ResourceExhausted, wire_error
from policy.identity import certificate_fingerprint
from policy.tickets import Grant, Route, TicketBook

log = logging.getLogger(__name__)
BULK_SYSTEM = "kvshare_bulk"  # the `rpc.system` of the bulk listener's spans
HELLO = "kvshare.bulk/Hello"
# The sealed-payload channel's hello, counted apart: an operator sees which channel
# replicas use (kvshare_rpc_requests_total{method="kvshare.bulk/SealedHello"}).
SEALED_HELLO = "kvshare.bulk/SealedHello"


class BulkHandshake:
    """The hellos of one bulk server's listeners. `slots` holds every accepted
    connection's slot; a redeemed ticket turns its slot into an authenticated one."""

    def __init__(
        self,
        core: RequestCore,
        tickets: TicketBook,
        tls: ssl.SSLContext | None,
        slots: ConnectionSlots,
        pace: Pace,
        telemetry: ServerTelemetry,
        bulk: BulkConfig,
    ) -> None:
        self._core = core
        self._tickets = tickets
        self._tls = tls
        self._slots = slots
        self._pace = pace
        self._telemetry = telemetry
        self._arena_bytes = bulk.arena_bytes
        self.arenas = ArenaCount(bulk.max_arenas, bulk.max_arenas_per_principal)

    def hello_tcp(self, conn: socket.socket, raw: socket.socket) -> BulkHandler | None:
        """The TCP listener's hello: a ticket over TLS (plain TCP where the server has
        no TLS), or the sealed-payload channel's "KVB2" over plain TCP, whose ticket
        only opens with its proof (cacheserver.transport.bulk.sealed). None: refused."""
        magic, ticket = w.HELLO.unpack(bulkio.recv_bytes(conn, w.HELLO.size))
        if magic == w.MAGIC_SEALED and conn is raw:
            hello = SealedHello(raw, ticket, self._tickets)
            grant = self._admit(conn, raw, hello.redeem, SEALED_HELLO)
            return None if grant is None else hello.accept(self._core, grant, self._pace)
        tls_required = self._tls is not None
        grant = self._admit(
            conn, conn, lambda: self._redeem(magic, ticket, conn, Route.TLS, tls_required)
        )
        if grant is None:
            return None
        conn.sendall(bytes([w.OK]))
        return BulkHandler(self._core, conn, grant, None, self._pace)

    def hello_local(self, conn: socket.socket) -> tuple[BulkHandler, Arena] | None:
        """The same-host listener's hello: a ticket, then the connection's own arena,
        sent as a descriptor with the reply. None: refused (an error frame sent).
        The arena goes back with `close_arena` when the connection ends."""
        magic, ticket = w.HELLO.unpack(bulkio.recv_bytes(conn, w.HELLO.size))
        grant = self._admit(conn, conn, lambda: self._redeem(magic, ticket, conn, Route.LOCAL))
        if grant is None:
            return None
        principal = grant.principal.name
        arena = self._open_arena(conn, principal)
        if arena is None:
            return None
        try:
            try:
                socket.send_fds(conn, [w.ARENA_REPLY.pack(w.OK, arena.size)], [arena.fd])
            finally:
                arena.close_fd()  # the client holds its own descriptor now
        except BaseException:
            self.close_arena(arena, principal)
            raise
        return BulkHandler(self._core, conn, grant, arena, self._pace), arena

    def close_arena(self, arena: Arena, principal: str) -> None:
        """A same-host connection ended: its arena is unmapped and counted back."""
        try:
            arena.close()
        finally:
            self.arenas.give_back(principal)

    def _open_arena(self, conn: socket.socket, principal: str) -> Arena | None:
        """This connection's arena, or None (and an error frame) when no more may open."""
        try:
            self.arenas.take(principal)
        except ResourceExhausted as error:
            send_error_frame(conn, error)
            return None
        try:
            return Arena(self._arena_bytes)
        except OSError as error:
            self.arenas.give_back(principal)
            log.error("cannot create a same-host arena: %s", error.strerror)
            refusal = ResourceExhausted("the server could not create a shared-memory arena")
            send_error_frame(conn, refusal)
            return None

    def _admit(
        self,
        conn: socket.socket,
        raw: socket.socket,
        redeem: Callable[[], Grant],
        method: str = HELLO,
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


def opens_tls(raw: socket.socket) -> bool:
    """Whether the client's first byte starts a TLS handshake (else: the sealed
    channel's hello, or a client that is refused)."""
    return raw.recv(1, socket.MSG_PEEK) == bytes([w.TLS_RECORD_HANDSHAKE])
