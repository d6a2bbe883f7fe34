"""The sealed-payload channel's server side: plain TCP, AEAD headers, sealed payloads.

For a tenant that requires sealed blocks, over a TLS deployment, OpenBulk can hand the
client a channel secret with its ticket (docs/secure-channel.md). The client then
connects to the TCP listener without TLS and says "KVB2" (kvcommon.bulkwire); from the
secret and the ticket each direction gets its own key (policy.bulkchannel), and:

- the hello: the client proves it holds the secret before its ticket is redeemed (a
  ticket read off the wire opens nothing), then the server proves it in turn;
- every header both ways (request, body of digests and sizes, reply block headers,
  outcomes, errors) is AES-256-GCM under the direction's key and the next counter;
- a PUT payload arrives in the clear (it is a sealed block) followed by its GMAC tag,
  bound to the request's body frame, its counter and the block's index; the GMAC is fed
  each piece of the block as it arrives (bulkio.recv_exact_fed: while the next piece
  comes, from the cache), the tag received with the last piece and checked as soon as
  the bytes are in, before the store's own checks and the commit (a failing tag gives
  the block up: nothing is stored or acknowledged);
- a GET reply sends only blocks in the sealed format (a block stored before the tenant
  required sealing ends the reply there, as a miss): the agent opens each under its
  tenant key, whose associated data names tenant, model, digest and key version. A GET
  flagged BATCHED (clients that OpenBulk told `sealed_batches`) gets one sealed header
  per batch of blocks, with every block's size in it, instead of one per block and one
  for the end (`_add_batch`, `_reply_end`).

A request's two frames (header, body) that are both in the socket already are taken in
one receive after a peek (`_take_request`), as the ready loop takes a plain request;
otherwise each is read as it comes. A GET flagged ONE_FRAME (a client that OpenBulk told
`sealed_batches`) is one frame, header and body together, of at most ONE_FRAME_BYTES:
the header is admitted before the model and digests are read from it, and they must be
exactly as long as the header says. Any frame that fails its check raises
`ChannelBroken` and the connection closes.
Admission, the read loop and the store calls are the request core's, as on every
transport; this module only frames.
"""

from __future__ import annotations

import logging
import socket
import struct
from collections import deque

from cacheserver.core.requests import RequestCore
from cacheserver.core.values import Served
from cacheserver.transport.bulk.handler import DISCARD_CHUNK_BYTES, Buffer, BulkHandler, Pace
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import KvshareError, Unauthenticated
from policy.bulkchannel import TAG_BYTES, ChannelError, PayloadMac, Receiver, Sender, server_side
from policy.sealing import looks_sealed
from policy.tickets import Grant, Route, TicketBook

log = logging.getLogger(__name__)
TAKE_BYTES = 16 << 10  # a request's two frames, peeked and taken whole up to this size
# As a plain int: or-ing the socket module's flag enums costs ~0.5 us a request.
_PEEK_NOW = int(socket.MSG_PEEK | socket.MSG_DONTWAIT)
# A request's first frame: its header, or (ONE_FRAME) the whole request.
_FIRST_FRAME = (w.REQUEST.size + TAG_BYTES, w.ONE_FRAME_BYTES + TAG_BYTES)
assert w.FRAME.size + _FIRST_FRAME[1] <= TAKE_BYTES  # a ONE_FRAME request is taken whole
_GET_FLAGS = w.TRACED | w.BATCHED | w.ONE_FRAME


class SealedHello:
    """A "KVB2" hello whose magic and ticket were read: `redeem`, then `accept`."""

    def __init__(self, conn: socket.socket, ticket: bytes, tickets: TicketBook) -> None:
        self._conn = conn
        self._ticket = ticket
        self._tickets = tickets
        self._sides: tuple[Sender, Receiver] | None = None

    def redeem(self) -> Grant:
        """The ticket's grant, once the client proved it holds the ticket's channel
        secret; Unauthenticated otherwise (the ticket then stays unused)."""
        proof = bytes(bulkio.recv_bytes(self._conn, w.PROOF_BYTES))
        grant = self._tickets.peek(self._ticket)
        if grant is None or not grant.channel_secret:
            raise Unauthenticated(
                "bulk ticket is invalid, used, expired or not for the sealed channel; "
                "call OpenBulk again"
            )
        sender, receiver = server_side(grant.channel_secret, self._ticket)
        try:
            receiver.check_hello(proof)
        except ChannelError:
            raise Unauthenticated(
                "the sealed channel's hello does not prove the ticket's secret"
            ) from None
        self._sides = sender, receiver
        return self._tickets.redeem(self._ticket, Route.SEALED)

    def accept(self, core: RequestCore, grant: Grant, pace: Pace) -> SealedHandler:
        """Answer with the server's proof; the connection's handler."""
        assert self._sides is not None, "redeem first"
        sender, receiver = self._sides
        self._conn.sendall(bytes([w.OK]) + sender.hello_proof())
        return SealedHandler(core, self._conn, grant, sender, receiver, pace)


class SealedHandler(BulkHandler):
    """BulkHandler with every header sealed, tagged put payloads and sealed-only GETs."""

    def __init__(
        self,
        core: RequestCore,
        conn: socket.socket,
        grant: Grant,
        sender: Sender,
        receiver: Receiver,
        pace: Pace,
    ) -> None:
        super().__init__(core, conn, grant, None, pace)
        self._out = sender
        self._in = receiver
        self._accept = looks_sealed
        self._take = bytearray(TAKE_BYTES)  # where a whole request's frames are taken
        self._frames: deque[memoryview] = deque()  # taken, not opened yet
        self._batched = False  # the current GET's reply: a header per batch (BATCHED)
        self._body: bytes | None = None  # a ONE_FRAME request's model and digests

    def _open(self, min_size: int, max_size: int) -> bytes:
        """The next header from the client, opened, of `min_size` to `max_size` bytes."""
        if self._frames:
            frame: Buffer = self._frames.popleft()
            bulkio.check_frame_size(len(frame), min_size + TAG_BYTES, max_size + TAG_BYTES)
        else:
            frame = bulkio.recv_frame(self._conn, min_size + TAG_BYTES, max_size + TAG_BYTES)
        try:
            return self._in.open_header(frame)
        except ChannelError:
            raise self._broken() from None

    def _take_request(self) -> None:
        """A request's frames, taken off the socket in one receive when a peek finds
        them whole there already (one system call and a peek where reading each length,
        then each frame, took four); `_open` reads them from here. The first frame is
        taken when it is whole (a ONE_FRAME request is no more), the second (a body)
        with it when it is whole too; what is not all there is read as it comes. A body
        is still opened, or read, only after the header was admitted, as on every
        transport."""
        self._frames.clear()
        try:
            got = self._conn.recv_into(self._take, TAKE_BYTES, _PEEK_NOW)
        except (BlockingIOError, InterruptedError):
            return
        peeked = memoryview(self._take)[:got]
        if got < w.FRAME.size:
            return
        (first,) = w.FRAME.unpack_from(peeked)
        end = body_at = w.FRAME.size + first
        if not _FIRST_FRAME[0] <= first <= _FIRST_FRAME[1] or got < body_at:
            return  # an impossible length is refused by recv_frame, as ever
        if got >= body_at + w.FRAME.size:
            (second,) = w.FRAME.unpack_from(peeked, body_at)
            if body_at + w.FRAME.size + second <= got:
                end = body_at + w.FRAME.size + second
        if self._conn.recv_into(self._take, end, socket.MSG_DONTWAIT) != end:
            raise w.ConnectionClosed("the peeked request was not all in the socket")
        taken = memoryview(self._take)
        self._frames.append(taken[w.FRAME.size : body_at])
        if end > body_at:
            self._frames.append(taken[body_at + w.FRAME.size : end])

    def _broken(self) -> w.ChannelBroken:
        return _authentication_failed(self._grant.principal.name)

    def recv_request(self) -> tuple[int, int, int, bytes | None]:
        """The next request's header (module docstring). A ONE_FRAME GET's model and
        digests, which came in the same frame, wait in `_body` until the header was
        admitted (`_recv`), as a body frame waits in the socket."""
        self._take_request()
        self._body = None
        header = self._open(w.REQUEST.size, w.ONE_FRAME_BYTES)
        op, model_len, count = w.REQUEST.unpack_from(header)
        traced = bool(op & w.TRACED)
        head = w.REQUEST.size + (w.TRACE_CONTEXT_BYTES if traced else 0)
        if op & w.ONE_FRAME:
            if op & ~_GET_FLAGS != w.OP_GET or len(header) < head or self._frames:
                raise w.ChannelBroken("a sealed one-frame request that is not a GET's")
            self._body = header[head:]
        elif len(header) != head:
            raise w.ChannelBroken("a sealed request header of the wrong length")
        trace = header[w.REQUEST.size : head] if traced else None
        self._batched = bool(op & w.BATCHED)  # kept for the reply (a GET's; others ignore it)
        return op & ~_GET_FLAGS, model_len, count, trace

    def send_error(self, error: KvshareError) -> None:
        """The error frame of a failed request, sealed (this framing's one place for it)."""
        self._send_header(self._frame(w.error_frame(error)))

    def _recv(self, size: int) -> memoryview:
        """A request's body of `size` bytes (its admitted header says how many): the
        next frame, opened, or what a ONE_FRAME request carried after its header."""
        body = self._body
        if body is None:
            return memoryview(self._open(size, size))
        self._body = None
        if len(body) != size:
            raise w.ChannelBroken("a sealed one-frame request of the wrong length")
        return memoryview(body)

    def _frame(self, header: bytes) -> bytes:
        try:
            return w.sealed_frame(self._out.seal_header(header))
        except ChannelError:  # this connection's keys are used up: the client opens another
            raise w.ChannelBroken("the sealed bulk connection is used up") from None

    def _reply(self, reply: bytes) -> None:
        self._replied = True
        self._send_header(self._frame(reply))

    def _source(self, index: int, size: int) -> _SealedSource:
        mac = self._in.payload_mac(index)
        deadline = self._pace.deadline(size)
        return _SealedSource(self._conn, mac, size, self._grant.principal.name, deadline)

    # A GET reply: only blocks in the sealed format are taken (`looks_sealed`), so the
    # first one that is not ends the reply there (a miss from there, never sent in
    # clear). BATCHED: per batch of the store's one sealed header (its first index, its
    # block count, whether it is the last, each block's size), then its payloads as
    # stored (sealed blocks) back to back; a reply that ends without a final batch (a
    # miss, or a batch that found the next block gone) ends with an empty final one.
    # Otherwise (a client from before): per block a sealed header then the payload,
    # then an end header.

    def _reply_start(self) -> list[Buffer]:
        return []

    def _add_batch(self, parts: list[Buffer], batch: Served) -> int:
        if not self._batched:
            return super()._add_batch(parts, batch)
        payloads = batch.payloads
        sizes = [len(payload) for payload in payloads]
        parts.append(self._frame(_batch(batch.first_index, sizes, batch.final)))
        parts += payloads
        return sum(sizes)

    def _block_header(self, index: int, size: int) -> bytes:
        return self._frame(_block(index, size))

    def _reply_end(self, served: int, final: bool) -> bytes:
        if not self._batched:
            return self._frame(_block(served, 0))
        return b"" if final else self._frame(_batch(served, [], True))


def _authentication_failed(principal: str) -> w.ChannelBroken:
    log.warning(
        "sealed bulk connection of principal %r: a frame failed authentication; closing",
        principal,
    )
    return w.ChannelBroken("a sealed bulk frame failed authentication")


def _block(index: int, size: int) -> bytes:
    return bytes([w.OK]) + w.BLOCK.pack(index, size)


def _batch(first_index: int, sizes: list[int], final: bool) -> bytes:
    """A BATCHED reply's header: OK, the batch's first index, its count and whether it
    is the reply's last, then each block's size."""
    head = bytes([w.OK]) + w.BATCH.pack(first_index, len(sizes), final)
    return head + struct.pack(f">{len(sizes)}Q", *sizes)


class _SealedSource:
    """A put's block as it arrives, then its tag, checked before the store sees it."""

    def __init__(
        self,
        conn: socket.socket,
        mac: PayloadMac,
        size: int,
        principal: str,
        deadline: bulkio.Deadline,
    ) -> None:
        self._conn = conn
        self._mac = mac
        self.size = size
        self._principal = principal
        self._deadline = deadline  # for the block and its tag (handler.Pace)
        self.consumed = False

    def payload(self) -> None:
        return None

    def fill(self, target: memoryview) -> None:
        """The block into `target`, its GMAC fed as its pieces arrive, then the tag
        (received with the last piece) checked."""
        tag = bytearray(TAG_BYTES)
        bulkio.recv_exact_fed(self._conn, target, memoryview(tag), self._mac.update, self._deadline)
        self.consumed = True
        self._verify(tag)

    def skip(self) -> None:
        """Receive and drop the block (the store holds it already), checked all the same:
        a connection carries nothing unauthenticated."""
        scratch = memoryview(bytearray(min(self.size, DISCARD_CHUNK_BYTES)))
        left = self.size
        while left:
            step = min(left, len(scratch))
            bulkio.recv_exact(self._conn, scratch[:step], self._deadline)
            self._mac.update(scratch[:step])
            left -= step
        self._check_tag()

    def _check_tag(self) -> None:
        tag = bulkio.recv_bytes(self._conn, TAG_BYTES)
        self.consumed = True
        self._verify(tag)

    def _verify(self, tag: bytearray) -> None:
        try:
            self._mac.verify(tag)
        except ChannelError:
            raise _authentication_failed(self._principal) from None
