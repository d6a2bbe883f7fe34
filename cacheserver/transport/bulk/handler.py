"""One bulk-channel request: read its frame, hand it to the request core, frame the reply.

Framing only (kvcommon.bulkwire). Admission, naming and the tiers are the request
core's (cacheserver.core.requests), exactly as for gRPC: the connection's principal and
tenant come from its ticket, and each request is admitted again. The header is
admitted before the body is read (rate, tenant and action, digest count), so a caller
cannot make the server receive a body it would refuse.

Payloads cross a TCP (or TLS) socket, or the connection's same-host arena: a GET from
memory is one `sendmsg` of sizes and payloads together; a PUT is received straight into
wherever the store keeps the block (`BlockSource.fill`).
"""

from __future__ import annotations

import socket
from collections.abc import Sequence
from dataclasses import dataclass

from cacheserver.blocks import BlockSource
from cacheserver.core.requests import DISK_BATCH_BYTES, RequestCore, parse_model_bytes
from cacheserver.transport.arena import Arena
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument, KvshareError
from policy import Action
from policy.tickets import Grant
from policy.types import StorageKey

DISCARD_CHUNK_BYTES = 1 << 20
OPS = {w.OP_GET: "Get", w.OP_PUT: "Put"}
TRANSFER_SLACK_S = 2.0


@dataclass(frozen=True)
class Pace:
    """How long a transfer may take: `slack_s` plus its bytes at the minimum rate. A
    block receiving into the journal holds ring space, and a reply being sent keeps the
    ring from reusing space (its views are pinned): a peer that trickles or stops
    reading must not hold either for longer (issue 15, F2 and F3)."""

    min_bytes_per_s: int
    idle_s: float  # the connection's timeout between requests, restored after
    slack_s: float = TRANSFER_SLACK_S

    def deadline(self, nbytes: int) -> w.Deadline:
        return w.Deadline(self.slack_s + nbytes / self.min_bytes_per_s, self.idle_s)


class BulkHandler:
    """Serves the requests of one connection (its grant, and its arena if same-host).

    The framing of headers (`recv_request`, `_recv`, `_reply`, `send_error`), of GET
    replies (`_get`) and of put payloads (`_source`) is what the sealed-payload channel
    (cacheserver.transport.bulk.sealed) replaces; admission and the store calls are shared."""

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

    def recv_request(self) -> tuple[int, int, int, bytes | None]:
        """The next request's op (TRACED cleared), model length, digest count and trace
        context (None: none); ConnectionClosed when the peer closed between requests."""
        op, model_len, count = w.REQUEST.unpack(w.recv_bytes(self._conn, w.REQUEST.size))
        if not op & w.TRACED:
            return op, model_len, count, None
        trace = bytes(w.recv_bytes(self._conn, w.TRACE_CONTEXT_BYTES))
        return op & ~w.TRACED, model_len, count, trace

    def send_error(self, error: KvshareError) -> None:
        self._conn.sendall(w.error_frame(error))

    def _recv(self, size: int) -> memoryview:
        return memoryview(w.recv_bytes(self._conn, size))

    def _reply(self, reply: bytes) -> None:
        """A reply header (status OK and what follows it)."""
        self._conn.sendall(reply)

    def handle(self, op: int, model_len: int, count: int) -> None:
        """One request whose header was read; raises KvshareError to refuse it."""
        if op not in OPS:
            raise InvalidArgument(f"unknown bulk operation {op}")
        principal = self._grant.principal
        action = Action.READ if op == w.OP_GET else Action.WRITE
        self._core.check_rate(principal)
        tenant = self._core.admit_tenant(principal, self._grant.tenant, action)
        self._core.limits.check_digest_count(count)
        sizes_len = w.SIZE.size * count if op == w.OP_PUT else 0
        body = self._recv(model_len + 32 * count + sizes_len)
        model = parse_model_bytes(body[:model_len])
        raw = body[model_len : model_len + 32 * count]
        digests = [bytes(raw[i : i + 32]) for i in range(0, len(raw), 32)]
        if op == w.OP_GET:
            admitted = self._core.name(principal, tenant, model, digests)
            if self._arena is None:
                self._get(admitted.keys)
            else:
                self._get_local(admitted.keys, self._arena)
            return
        sizes = [size for (size,) in w.SIZE.iter_unpack(body[model_len + 32 * count :])]
        self._put(model, digests, sizes)

    # -- GET ---------------------------------------------------------------------------

    def _get(self, keys: Sequence[StorageKey]) -> None:
        """The reply in as few `sendmsg` calls as its tiers allow: one for blocks all in
        memory (status, sizes, payloads and END together)."""
        parts: list[bytes | bytearray | memoryview] = [bytes([w.OK])]
        nbytes = 0
        with self._core.store.read(self._grant.tenant, keys) as reading:
            while (batch := reading.next_batch(DISK_BATCH_BYTES)) is not None:
                for payload in batch.payloads:
                    parts += [w.SIZE.pack(len(payload)), payload]
                    nbytes += len(payload)
                if batch.final:
                    break
                # the next batch reads the disk: send these first
                w.send_parts(self._conn, parts, self._pace.deadline(nbytes))
                parts, nbytes = [], 0
            w.send_parts(self._conn, [*parts, w.END], self._pace.deadline(nbytes))

    def _get_local(self, keys: Sequence[StorageKey], arena: Arena) -> None:
        """Copy the leading present blocks into the arena, as many as fit, then say
        their sizes (and whether the arena filled up before the next present block)."""
        sizes: list[int] = []
        offset, truncated = 0, False
        with self._core.store.read(self._grant.tenant, keys) as reading:
            while not truncated and (batch := reading.next_batch(DISK_BATCH_BYTES)) is not None:
                for placed, payload in enumerate(batch.payloads):
                    size = len(payload)
                    if offset + size > arena.size:
                        # The rest is asked for again: not served now, nor missed.
                        reading.unsent(len(batch.payloads) - placed)
                        truncated = True
                        break
                    w.copy_into(arena.view[offset:], payload)
                    sizes.append(size)
                    offset += size + (-size % w.ARENA_ALIGN)
        reply = [bytes([w.OK]), w.LOCAL_GET.pack(len(sizes), truncated)]
        self._reply(b"".join(reply + [w.SIZE.pack(size) for size in sizes]))

    # -- PUT ---------------------------------------------------------------------------

    def _put(self, model: str, digests: Sequence[bytes], sizes: Sequence[int]) -> None:
        """Every block is named and its size admitted before any payload is taken."""
        put = self._core.admit_put(self._grant.principal, self._grant.tenant, model)
        keys = [
            self._core.name_block(put, index, digest, size)
            for index, (digest, size) in enumerate(zip(digests, sizes, strict=True))
        ]
        offsets = self._arena.placed(sizes) if self._arena is not None else None
        futures = []
        for index, (key, size) in enumerate(zip(keys, sizes, strict=True)):
            source: BlockSource = (
                self._source(index, size)
                if offsets is None or self._arena is None
                else _ArenaSource(self._arena, offsets[index], size)
            )
            futures.append(self._core.put(put, index, key, source))
        outcomes = bytes(
            w.OUTCOME_STORED if future.result() else w.OUTCOME_ALREADY_PRESENT for future in futures
        )
        self._reply(bytes([w.OK]) + outcomes)

    def _source(self, index: int, size: int) -> BlockSource:
        """Block `index` of a put, as it arrives on the connection."""
        return _SocketSource(self._conn, size, self._pace)


class _SocketSource:
    """A put's block as it arrives on the socket, in request order."""

    def __init__(self, conn: socket.socket, size: int, pace: Pace) -> None:
        self._conn = conn
        self.size = size
        self._pace = pace

    def payload(self) -> None:
        return None

    def fill(self, target: memoryview) -> None:
        w.recv_exact(self._conn, target, self._pace.deadline(self.size))

    def skip(self) -> None:
        """Receive and drop the block (the store holds it already)."""
        scratch = memoryview(bytearray(min(self.size, DISCARD_CHUNK_BYTES)))
        left = self.size
        while left:
            step = min(left, len(scratch))
            w.recv_exact(self._conn, scratch[:step])
            left -= step


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
        w.copy_into(target, self._arena.view[self._offset : self._offset + self.size])

    def skip(self) -> None:
        pass
