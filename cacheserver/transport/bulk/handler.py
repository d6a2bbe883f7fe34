"""One bulk-channel request: read its frame, hand it to the request core, frame the reply.

Framing only (kvcommon.bulkwire). Admission, naming, the read loop and the tiers are
the request core's (cacheserver.core.requests), exactly as for gRPC: the connection's
principal and tenant come from its ticket, and each request is admitted again. The
header is admitted before the body is read (the core's `begin`: rate, tenant and
action, digest count), so a caller cannot make the server receive a body it would
refuse.

Payloads cross a TCP (or TLS) socket, or the connection's same-host arena: a GET from
memory is one `sendmsg` of sizes and payloads together; a PUT is received straight into
wherever the store keeps the block (`BlockSource.fill`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from cacheserver.blocks import BlockSource, Payload
from cacheserver.core.requests import RequestCore
from cacheserver.core.values import Accept, Begun, Served, Verb, parse_model_bytes
from cacheserver.transport.arena import Arena
from kvcommon import bulkio, handoff, samehost
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument, KvshareError
from policy.tickets import Grant

Buffer = bytes | bytearray | memoryview
DISCARD_CHUNK_BYTES = 1 << 20
# The method names of the requests' spans.
OPS = {w.OP_GET: "Get", w.OP_PUT: "Put", w.OP_LOOKUP: "Lookup"}
VERBS = {w.OP_GET: Verb.GET, w.OP_PUT: Verb.PUT, w.OP_LOOKUP: Verb.LOOKUP}
TRANSFER_SLACK_S = 2.0


@dataclass(frozen=True)
class Pace:
    """How long a transfer may take: `slack_s` plus its bytes at the minimum rate. A
    block receiving into the journal holds ring space, and a reply being sent keeps the
    ring from reusing space (its views are pinned): a peer that trickles or stops
    reading must not hold either for longer."""

    min_bytes_per_s: int
    idle_s: float  # the connection's timeout between requests, restored after
    slack_s: float = TRANSFER_SLACK_S

    def deadline(self, nbytes: int) -> bulkio.Deadline:
        return bulkio.Deadline(self.slack_s + nbytes / self.min_bytes_per_s, self.idle_s)


class BulkHandler:
    """Serves the requests of one connection (its grant, and its arena if same-host).

    The framing of headers (`recv_request`, `_recv`, `_reply`, `send_error`), of a GET
    reply's blocks (`_reply_start`, `_add_batch`, `_block_header`, `_reply_end`,
    `_accept`) and of put payloads (`_source`) is what the sealed-payload channel
    (cacheserver.transport.bulk.sealed) replaces; admission, the read loop and the
    store calls are the request core's."""

    def __init__(
        self,
        core: RequestCore,
        conn: socket.socket,
        grant: Grant,
        arena: Arena | None,
        pace: Pace,
    ) -> None:
        self._core = core
        self._conn = conn
        self._grant = grant
        self._arena = arena
        self._pace = pace
        self._accept: Accept | None = None  # None: every block the store returns is sent
        self.last_verb: Verb | None = None  # the last request's (bulk workers: where to serve)
        self.last_bytes = 0  # payload bytes the last request moved (the ready loop's STAY)
        # The listener's: whether a bulk worker gave the connection back (it only wrote)
        # and it is served here since, and its reads in a row since.
        self.given_back = False
        self.reads_in_a_row = 0
        # Where the current request stands on the wire, for `in_step`.
        self._body_read = False
        self._payloads: list[_Incoming] = []
        self._replied = False
        # The current request's header and body, taken off the socket whole (`take_peeked`).
        self._taken = memoryview(b"")
        # The current GET's reply pads its payloads (bulkwire.ALIGNED), and its length so far.
        self._aligned = False
        self._position = 0

    @property
    def grant(self) -> Grant:
        """The principal and tenant the connection is bound to."""
        return self._grant

    def take_peeked(self, peeked: memoryview) -> None:
        """The ready loop peeked the next request's header and body whole in the socket:
        they are taken off it in one receive, and `recv_request` and `_recv` read them
        from here (one system call where there were two). ConnectionClosed if they
        are not all there after all."""
        taken = self._conn.recv(len(peeked), socket.MSG_DONTWAIT)
        if len(taken) != len(peeked):
            raise w.ConnectionClosed("the peeked request was not all in the socket")
        self._taken = memoryview(taken)

    def recv_request(self) -> tuple[int, int, int, bytes | None]:
        """The next request's op (TRACED and ALIGNED cleared), model length, digest
        count and trace context (None: none); ConnectionClosed when the peer closed
        between requests. ALIGNED is kept for the reply (a GET's; other ops ignore it)."""
        op, model_len, count = w.REQUEST.unpack(self._recv(w.REQUEST.size))
        self._aligned = bool(op & w.ALIGNED)
        op &= ~w.ALIGNED
        if not op & w.TRACED:
            return op, model_len, count, None
        trace = bytes(self._recv(w.TRACE_CONTEXT_BYTES))
        return op & ~w.TRACED, model_len, count, trace

    def send_error(self, error: KvshareError) -> None:
        """The error frame of a failed request (this framing's one place for it)."""
        self._send_header(w.error_frame(error))

    @property
    def in_step(self) -> bool:
        """Whether the failed request left the connection at a request boundary: every
        byte of it was read and no byte of a reply went out. Then the connection can
        take the next request after the error frame; otherwise it must close."""
        consumed = self._body_read and all(p.consumed for p in self._payloads)
        consumed = consumed and not self._taken.nbytes
        return consumed and not self._replied

    def _recv(self, size: int) -> memoryview:
        taken = self._taken
        if taken.nbytes >= size:  # `take_peeked`'s, which hold the whole header and body
            self._taken = taken[size:]
            return taken[:size]
        if taken.nbytes:  # the loop's idea of a request's length and this framing differ
            raise RuntimeError("a peeked request was shorter than its framing")
        return memoryview(bulkio.recv_bytes(self._conn, size))

    def _reply(self, reply: bytes) -> None:
        """A reply header (status OK and what follows it)."""
        self._replied = True
        self._send_header(reply)

    def _send_header(self, header: bytes) -> None:
        """A reply header or an error frame, a few bytes; on the ready loop within the
        transfer's pace, handing off first if the socket buffer does not take it at
        once (kvcommon.handoff)."""
        if handoff.armed():
            bulkio.send_parts(self._conn, [header], self._pace.deadline(0))
        else:
            self._conn.sendall(header)

    def _send(self, parts: list[Buffer], nbytes: int) -> None:
        """Reply parts with `nbytes` of payloads among them, within the transfer's pace
        (on a thread that serves other connections too, it hands off before it waits
        for the socket buffer: kvcommon.handoff, in send_parts)."""
        self._replied = True
        self.last_bytes += nbytes
        bulkio.send_parts(self._conn, parts, self._pace.deadline(nbytes))

    def handle(self, op: int, model_len: int, count: int, *, rate_drawn: bool = False) -> None:
        """One request whose header was read; raises KvshareError to refuse it.
        `rate_drawn`: a bulk worker handed it back after drawing its rate."""
        self._body_read, self._payloads, self._replied = False, [], False
        self.last_bytes = 0
        verb = self.last_verb = VERBS.get(op)
        if verb is None:
            raise InvalidArgument(f"unknown bulk operation {op}")
        # The header is admitted before the body is read.
        principal, tenant = self._grant.principal, self._grant.tenant
        begun = self._core.begin(principal, verb, tenant, count, rate_drawn=rate_drawn)
        sizes_len = w.SIZE.size * count if verb is Verb.PUT else 0
        body = self._recv(model_len + w.DIGEST_BYTES * count + sizes_len)
        self._body_read = True
        model = parse_model_bytes(body[:model_len])
        digests = w.request_digests(body[model_len : model_len + w.DIGEST_BYTES * count])
        if verb is Verb.LOOKUP:
            present = self._core.lookup(begun, model, digests)
            self._reply(w.lookup_reply(present))
            return
        if verb is Verb.GET:
            if self._arena is None:
                self._get(begun, model, digests)
            else:
                self._get_local(begun, model, digests, self._arena)
            return
        sizes = [size for (size,) in w.SIZE.iter_unpack(body[model_len + w.DIGEST_BYTES * count :])]
        self.last_bytes = sum(sizes)
        outcomes = self._core.put_blocks(begun, model, digests, sizes, self._sources)
        stored = (w.OUTCOME_STORED if new else w.OUTCOME_ALREADY_PRESENT for new in outcomes)
        self._reply(bytes([w.OK]) + bytes(stored))

    # -- GET ---------------------------------------------------------------------------

    def _get(self, begun: Begun, model: str, digests: Sequence[bytes]) -> None:
        """The reply in as few `sendmsg` calls as its tiers allow: one for blocks all in
        memory (status, block headers, payloads and the end together)."""
        parts, nbytes, served, final = self._reply_start(), 0, 0, False
        with self._core.get(begun, model, digests, accept=self._accept) as reply:
            for batch in reply:
                nbytes += self._add_batch(parts, batch)
                served, final = batch.first_index + len(batch.payloads), batch.final
                if not final:  # the next batch reads the disk: send these first
                    self._send(parts, nbytes)
                    parts, nbytes = [], 0
            end = self._reply_end(served, final)
            self._send([*parts, end] if end else parts, nbytes)

    def _reply_start(self) -> list[Buffer]:
        self._position = 1
        return [bytes([w.OK])]

    def _add_batch(self, parts: list[Buffer], batch: Served) -> int:
        """A batch's headers and payloads onto `parts`; its payload bytes. Here (and on
        the sealed channel unless the GET says BATCHED) a header per block."""
        nbytes = 0
        for index, payload in enumerate(batch.payloads, batch.first_index):
            parts += [self._block_header(index, len(payload)), payload]
            nbytes += len(payload)
        return nbytes

    def _block_header(self, index: int, size: int) -> bytes:
        """The block's size, and for an ALIGNED request the padding that starts its
        payload at a multiple of PAYLOAD_ALIGN into the reply."""
        header, self._position = w.block_header(size, self._position, self._aligned)
        return header

    def _reply_end(self, served: int, final: bool) -> bytes:
        """What ends the reply after `served` blocks (`final`: the last batch said no
        more follow); b"": nothing more to send."""
        return w.END

    def _get_local(self, begun: Begun, model: str, digests: Sequence[bytes], arena: Arena) -> None:
        """Copy the leading present blocks into the arena, as many as fit, then say
        their sizes (and whether the arena filled up before the next present block:
        the client asks again for the rest)."""
        placement = _Placement(arena.size)
        sizes: list[int] = []
        with self._core.get(begun, model, digests, accept=placement.fits) as reply:
            for batch in reply:
                for payload in batch.payloads:
                    samehost.copy_into(arena.view[placement.offsets[len(sizes)] :], payload)
                    sizes.append(len(payload))
        reply_header = [bytes([w.OK]), w.LOCAL_GET.pack(len(sizes), placement.full)]
        self._reply(b"".join(reply_header + [w.SIZE.pack(size) for size in sizes]))

    # -- PUT ---------------------------------------------------------------------------

    def _sources(self, sizes: Sequence[int]) -> list[BlockSource]:
        """A put's blocks, once all are admitted: in the arena, or still on the wire."""
        if self._arena is not None:
            offsets = self._arena.placed(sizes)
            return [_ArenaSource(self._arena, o, n) for o, n in zip(offsets, sizes, strict=True)]
        self._payloads = [self._source(index, size) for index, size in enumerate(sizes)]
        return list(self._payloads)

    def _source(self, index: int, size: int) -> _Incoming:
        """Block `index` of a put, as it arrives on the connection."""
        return _SocketSource(self._conn, size, self._pace)


def send_error_frame(conn: socket.socket, error: KvshareError) -> None:
    """An error frame in clear: a refused request, hello or arena (kvcommon.bulkwire)."""
    conn.sendall(w.error_frame(error))


class _Placement:
    """Where a same-host GET's blocks go in the arena: back to back, page-aligned, as
    many as fit (`fits` is the reply's acceptance predicate)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self._next = 0
        self.offsets: list[int] = []
        self.full = False  # a block did not fit: the reply ends before it

    def fits(self, payload: Payload) -> bool:
        size = len(payload)
        if self._next + size > self._capacity:
            self.full = True
            return False
        self.offsets.append(self._next)
        self._next += size + (-size % w.ARENA_ALIGN)
        return True


class _Incoming(BlockSource, Protocol):
    """A put's block still on the connection; `consumed` once its bytes were read."""

    consumed: bool


class _SocketSource:
    """A put's block as it arrives on the socket, in request order."""

    def __init__(self, conn: socket.socket, size: int, pace: Pace) -> None:
        self._conn = conn
        self.size = size
        self._pace = pace
        self.consumed = False

    def payload(self) -> None:
        return None

    def fill(self, target: memoryview) -> None:
        bulkio.recv_exact(self._conn, target, self._pace.deadline(self.size))
        self.consumed = True

    def skip(self) -> None:
        """Receive and drop the block (the store holds it already)."""
        scratch = memoryview(bytearray(min(self.size, DISCARD_CHUNK_BYTES)))
        left = self.size
        while left:
            step = min(left, len(scratch))
            bulkio.recv_exact(self._conn, scratch[:step])
            left -= step
        self.consumed = True


class _ArenaSource:
    """A put's block in the connection's arena. Copied out before anything looks at
    it, so a client rewriting the arena meanwhile can only change its own block, as if
    it had sent other bytes."""

    def __init__(self, arena: Arena, offset: int, size: int) -> None:
        self._arena = arena
        self._offset = offset
        self.size = size

    def payload(self) -> None:
        return None

    def fill(self, target: memoryview) -> None:
        samehost.copy_into(target, self._arena.view[self._offset : self._offset + self.size])

    def skip(self) -> None:
        pass
