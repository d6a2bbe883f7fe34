"""Client side of the bulk channel: LOOKUP, GET and PUT requests (framing in
`kvcommon.bulkwire`). `BulkChannel` is a transport (replica_agent.transport): delete,
stats and any call its frames cannot carry are `UseGrpc`.

Its connections are of three kinds, chosen when one opens, each in a module of its own:
on the server's host the same-host arena (bulk_samehost.py: its opening, reads and
puts), else TCP or TLS (bulk_connect.py: opening, streamed reads and puts, and the
request framing all kinds share), or the sealed-payload channel (bulk_sealed.py).
This module keeps them per thread and tenant and sends each call to its connection's
kind.

One connection per thread and tenant, opened with a one-time ticket and kept for
reuse; a kept connection the server closed meanwhile (a restart) is replaced
before it is used, so a restart is no failure of the channel (no fallback, no backoff in
fallback.py). `read` is the one read path: each leading present payload as a view,
as soon as it arrived — into the connection's reused buffers, or, on the server's host,
into the shared-memory arena the server wrote it to. With `keep=False` a view is valid
until the next one is asked for (the restore path decodes block i while block i+1 is on
the wire); with `keep=True` every view is valid until this thread's next call.

Every call runs within one deadline (replica_agent.deadline: the client's `timeout_s`
for the whole call, however slowly the reply comes); a call that runs out of it, or
stops anywhere mid-frame, closes its connection, whose stream position is then unknown.

Sizes the server announces are checked before anything is allocated for them: a
hostile or broken server gets a DATA_LOSS error (a miss for the agent), never an
allocation of its choosing.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable, Iterator, Sequence

from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.bulk_connect import (
    Connection,
    connect_tcp,
    put_request,
    read_streamed,
    recv_reply,
    send_request,
)
from replica_agent.bulk_samehost import can_use_local, connect_local, put_arena, read_arena
from replica_agent.deadline import CallDeadline
from replica_agent.errors import store_error
from replica_agent.grpc_calls import Ticket
from replica_agent.transport import Payload, PieceSink, UseGrpc, fed_whole

OpenTicket = Callable[[str, CallDeadline], Ticket]  # tenant, the call's deadline -> a ticket


class BulkChannel:
    def __init__(
        self,
        open_ticket: OpenTicket,
        tls: ssl.SSLContext | None = None,
        server_name: str | None = None,
        timeout_s: float | None = 30.0,
        *,
        same_host: bool = True,
        lookups: bool = True,
        local_allowed: Callable[[], bool] = lambda: True,
        local_failed: Callable[[], object] = lambda: None,
        local_opened: Callable[[], object] = lambda: None,
    ) -> None:
        """`lookups` False: lookups are `UseGrpc` (a sealed-channel caller: its frames
        carry blocks, and a second connection just for lookups would buy nothing).
        `local_allowed`/`local_failed`: the client's backoff for the same-host
        transport (after it failed, TCP is used for a while); `local_opened`: called for
        each connection that got the same-host arena (the client counts them)."""
        self._open_ticket = open_ticket
        self._lookups = lookups
        self._tls = tls
        self._server_name = server_name
        self._timeout_s = timeout_s
        self._same_host = same_host
        self._local_allowed = local_allowed
        self._local_failed = local_failed
        self._local_opened = local_opened
        self._local = threading.local()
        self._all: list[Connection] = []
        self._lock = threading.Lock()

    # -- connections ----------------------------------------------------------------

    def _connection(self, tenant: str, deadline: CallDeadline, *, tcp: bool = False) -> Connection:
        """This thread's connection for `tenant`, for a call within `deadline`:
        same-host when it can be had, unless `tcp` asks for the TCP listener (a block
        too big for the arena)."""
        conns: dict[tuple[str, bool], Connection] = self._local.__dict__.setdefault("conns", {})
        conn = conns.get((tenant, tcp))
        if conn is not None and conn.is_closed_by_peer():
            self._drop(tenant, tcp=tcp)
            conn = None
        if conn is None:
            conn = conns[(tenant, tcp)] = self._connect(tenant, tcp, deadline)
            with self._lock:
                self._all.append(conn)
        conn.timer.deadline = deadline
        return conn

    def _connect(self, tenant: str, tcp: bool, deadline: CallDeadline) -> Connection:
        ticket = self._open_ticket(tenant, deadline)
        if not tcp and self._same_host and can_use_local(ticket) and self._local_allowed():
            conn, ticket_spent = connect_local(ticket, deadline)
            if conn is not None:
                self._local_opened()
                return conn
            self._local_failed()
            if ticket_spent:
                ticket = self._open_ticket(tenant, deadline)
        return connect_tcp(ticket, self._tls, self._server_name, deadline)

    def _deadline(self, deadline: CallDeadline | None) -> CallDeadline:
        """The call's deadline: the caller's (BlockClient: shared with a fallback), or
        a fresh one of `timeout_s`."""
        return deadline if deadline is not None else CallDeadline(self._timeout_s)

    def _drop(self, tenant: str, *, tcp: bool) -> None:
        """Close a connection left out of step (an error mid-frame): never reused."""
        conn = self._local.__dict__.get("conns", {}).pop((tenant, tcp), None)
        if conn is not None:
            with self._lock:
                self._all.remove(conn)  # reconnects must not accumulate dead connections
            conn.close()

    def _dropper(self, tenant: str, *, tcp: bool = False) -> Callable[[], None]:
        """What closes this thread's connection for `tenant` when a request left it out
        of step (bulk_connect, bulk_samehost)."""
        return lambda: self._drop(tenant, tcp=tcp)

    def close(self) -> None:
        with self._lock:
            for conn in self._all:
                conn.close()
            self._all.clear()

    # -- requests -------------------------------------------------------------------

    def lookup(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        deadline: CallDeadline | None = None,
    ) -> int:
        """How many leading digests are stored. On this thread's connection for the
        tenant if it has one (a same-host one included: a lookup moves no payload), else
        on a TCP one, so a thread that only looks up (an engine's scheduler) never takes
        a same-host arena. Not on the sealed channel (UseGrpc): its frames carry blocks."""
        if not self._lookups:
            raise UseGrpc("lookups over gRPC")
        _check_framable(model, digests)
        deadline = self._deadline(deadline)
        conns: dict[tuple[str, bool], Connection] = self._local.__dict__.get("conns", {})
        tcp = (tenant, False) not in conns
        conn = self._connection(tenant, deadline, tcp=tcp)
        if conn.sealed is not None:
            raise UseGrpc("sealed channel")
        try:
            send_request(conn, w.OP_LOOKUP, model, digests)
            (present,) = w.PRESENT.unpack(recv_reply(conn.sock, w.PRESENT.size, conn.timer))
        except Exception:
            self._drop(tenant, tcp=tcp)
            raise
        if present > len(digests):
            self._drop(tenant, tcp=tcp)
            raise store_error("DATA_LOSS", "the server found more blocks than were asked for")
        return int(present)

    def read(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
        deadline: CallDeadline | None = None,
        pieces: PieceSink | None = None,
    ) -> Iterator[memoryview]:
        """The leading present payloads, each as soon as it arrived (module docstring);
        `pieces` as `Transport.read`: fed as they arrive on the sealed channel, else
        whole."""
        _check_framable(model, digests)
        if deadline is None:  # `_deadline` written out: every GET comes through here
            deadline = CallDeadline(self._timeout_s)
        conn = self._connection(tenant, deadline)
        conn.buffers.reset()
        if conn.sealed is not None:
            return self._read_sealed(tenant, conn, model, digests, keep=keep, pieces=pieces)
        if conn.arena is None:
            streamed = read_streamed(conn, model, digests, keep=keep, drop=self._dropper(tenant))
            return fed_whole(streamed, pieces)

        def over_tcp(rest: Sequence[bytes]) -> Iterator[memoryview]:
            tcp = self._connection(tenant, deadline, tcp=True)
            tcp.buffers.reset()
            drop = self._dropper(tenant, tcp=True)
            return read_streamed(tcp, model, rest, keep=keep, drop=drop)

        local = read_arena(
            conn, model, digests, keep=keep, drop=self._dropper(tenant), over_tcp=over_tcp
        )
        return fed_whole(local, pieces)

    def _read_sealed(
        self,
        tenant: str,
        conn: Connection,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
        pieces: PieceSink | None,
    ) -> Iterator[memoryview]:
        assert conn.sealed is not None
        finished = False
        try:
            sealed = conn.sealed
            yield from sealed.get(conn.sock, conn.buffers, model, digests, keep=keep, pieces=pieces)
            finished = True
        finally:
            if not finished:
                self._drop(tenant, tcp=False)  # stopped mid-stream, or a frame failed

    def get(self, tenant: str, model: str, digests: Sequence[bytes]) -> list[bytes]:
        return [bytes(v) for v in self.read(tenant, model, digests, keep=True)]

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[Payload],
        deadline: CallDeadline | None = None,
    ) -> list[bool]:
        _check_framable(model, digests)
        sizes = [memoryview(p).nbytes for p in payloads]
        if 0 in sizes:
            raise UseGrpc("empty payload")
        deadline = self._deadline(deadline)
        conn, tcp = self._connection(tenant, deadline), False
        if conn.arena is not None and max(sizes, default=0) > len(conn.arena):
            conn, tcp = self._connection(tenant, deadline, tcp=True), True  # too big for it
        if conn.sealed is not None:
            try:
                return conn.sealed.put(conn.sock, model, digests, payloads)
            except Exception:
                self._drop(tenant, tcp=False)
                raise
        if conn.arena is not None:
            return put_arena(conn, model, digests, sizes, payloads, self._dropper(tenant))
        try:  # the payloads follow the request on the socket
            return put_request(conn, model, digests, sizes, payloads)
        except Exception:
            self._drop(tenant, tcp=tcp)
            raise

    def delete(self, request: pb.DeleteRequest, deadline: CallDeadline | None = None) -> int:
        raise UseGrpc("no delete on the bulk channel")

    def stats(self, deadline: CallDeadline | None = None) -> pb.StatsResponse:
        raise UseGrpc("no stats on the bulk channel")


def _check_framable(model: str, digests: Sequence[bytes]) -> None:
    """A malformed request would desynchronise the stream; such calls take the gRPC
    path instead, where the server answers INVALID_ARGUMENT with its own message."""
    if not model or len(model.encode("utf-8")) > 0xFFFF:
        raise UseGrpc("model")
    for digest in digests:  # a loop, not any() over a generator: run for every call
        if len(digest) != 32:
            raise UseGrpc("digest length")
