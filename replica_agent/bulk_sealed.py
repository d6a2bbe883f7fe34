"""The sealed-payload channel's client side (docs/secure-channel.md).

Used when OpenBulk, asked over TLS by a caller that opens every block it reads (the
replica agent with its keyring: `BlockClient(sealed_channel=True)`), granted a channel
secret: the tenant requires sealed blocks, so its payloads are already AES-256-GCM
under a key the server never holds, and TLS would only encrypt them a second time.
The connection is plain TCP; the cryptography is policy.bulkchannel's:

- hello: "KVB2" | ticket | this side's proof of the secret; the server answers with its
  own proof, checked before any request is sent (an impostor on the bulk port learns
  nothing: it cannot produce the proof);
- every header both ways is AES-256-GCM under the direction's key and the next counter
  of that direction, so a frame altered, dropped, replayed, reordered or reflected
  fails to open;
- each PUT payload is followed by its GMAC tag, bound to the request's body frame
  (digests and sizes), its counter and the block's index;
- GET payloads arrive as the sealed blocks they are; the caller opens each under its
  tenant key (the seal's associated data names tenant, model, digest and key version)
  before use, so a block altered or swapped on the way is a miss, never KV. Against a
  listener that said `sealed_batches`, a GET asks for BATCHED replies: one header per
  batch of blocks (its first index, count, sizes, and whether it is the last), so a
  reply from memory is one header to open for any number of blocks.

Every check that fails raises `ChannelBroken` (a ConnectionError): the connection is
dropped and the client's call falls back to gRPC (TLS), or ends as a miss.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable, Iterator, Sequence

from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.tracing import binary_context
from policy.bulkchannel import TAG_BYTES, ChannelError, Receiver, Sender, client_side
from replica_agent.bulk_buffers import Buffers
from replica_agent.deadline import SocketTimer
from replica_agent.errors import store_error
from replica_agent.grpc_calls import MAX_BLOCK_BYTES
from replica_agent.transport import Payload, PieceSink

# A reply header's plaintext is a status byte and its fields, or an error frame
# (status, length u16, up to MAX_MESSAGE_CHARS bytes of message).
MAX_ERROR_BYTES = w.ERROR.size + w.MAX_MESSAGE_CHARS
MAX_ERROR_FRAME = MAX_ERROR_BYTES + TAG_BYTES


class SealedChannel:
    """One connection's two directions: this side's Sender and the server's Receiver;
    every send and receive within the current call's deadline (the connection's
    `timer`)."""

    def __init__(
        self,
        sender: Sender,
        receiver: Receiver,
        traced: bool,
        timer: SocketTimer,
        *,
        batched: bool = False,
    ) -> None:
        self._out = sender
        self._in = receiver
        self._traced = traced
        self._timer = timer
        self._batched = batched  # GETs flagged BATCHED: a reply header per batch
        self._head = memoryview(bytearray(w.FRAME.size + MAX_ERROR_FRAME))  # `_batch`'s

    @classmethod
    def hello(
        cls,
        sock: socket.socket,
        secret: bytes,
        ticket: bytes,
        traced: bool,
        timer: SocketTimer,
        *,
        batched: bool = False,
    ) -> SealedChannel:
        """Present the ticket with this side's proof, and check the server's.
        `batched`: OpenBulk said `sealed_batches` (the listener knows BATCHED)."""
        sender, receiver = client_side(secret, ticket)
        hello = w.HELLO_SEALED.pack(w.MAGIC_SEALED, ticket, sender.hello_proof())
        bulkio.send_parts(sock, [hello], timer)
        status = bulkio.recv_bytes(sock, 1, timer)
        if status[0] != w.OK:
            # Not authenticated (the hello is not done): a reason to give up, not a
            # verdict to pass on. The call falls back to gRPC, which gives the real one.
            _code, message = bulkio.recv_error(sock, bytes(status), timer)
            raise w.ChannelBroken(f"the bulk listener refused the sealed channel: {message}")
        proof = bytes(bulkio.recv_bytes(sock, w.PROOF_BYTES, timer))
        try:
            receiver.check_hello(proof)
        except ChannelError:
            raise w.ChannelBroken("the bulk listener did not prove the channel secret") from None
        return cls(sender, receiver, traced, timer, batched=batched)

    # -- frames -------------------------------------------------------------------------

    def _seal(self, header: bytes) -> bytes:
        try:
            return w.sealed_frame(self._out.seal_header(header))
        except ChannelError:  # this connection's keys are used up: the next one is new
            raise w.ChannelBroken("the sealed bulk connection is used up") from None

    def _request(self, op: int, model: str, digests: Sequence[bytes], tail: bytes) -> list[bytes]:
        """A request's two frames: its header (then admitted by the server before it
        reads more), and its body: model, digests and (PUT) sizes."""
        encoded = model.encode("utf-8")
        trace = binary_context() if self._traced else None
        header = w.REQUEST.pack(op | (w.TRACED if trace else 0), len(encoded), len(digests))
        return [self._seal(header + (trace or b"")), self._seal(encoded + b"".join(digests) + tail)]

    def _get_request(self, model: str, digests: Sequence[bytes]) -> list[bytes]:
        """A BATCHED GET: ONE frame, header, model and digests together (ONE_FRAME),
        where it is at most ONE_FRAME_BYTES; else the two frames of `_request`."""
        encoded = model.encode("utf-8")
        trace = binary_context() if self._traced else None
        size = w.REQUEST.size + len(encoded) + w.DIGEST_BYTES * len(digests)
        if size + (w.TRACE_CONTEXT_BYTES if trace else 0) > w.ONE_FRAME_BYTES:
            return self._request(w.OP_GET | w.BATCHED, model, digests, b"")
        op = w.OP_GET | w.BATCHED | w.ONE_FRAME | (w.TRACED if trace else 0)
        header = w.REQUEST.pack(op, len(encoded), len(digests))
        return [self._seal(b"".join([header, trace or b"", encoded, *digests]))]

    def _reply(self, sock: socket.socket, size: int) -> bytes:
        """The next reply header's fields after its OK status (`size` bytes); the
        server's error (a BlockStoreError) when it sent one."""
        most = max(1 + size, MAX_ERROR_BYTES) + TAG_BYTES
        expect = 1 + size + TAG_BYTES  # an OK header: taken with its length in one receive
        frame = bulkio.recv_frame(sock, 1 + TAG_BYTES, most, self._timer, expect=expect)
        try:
            plain = self._in.open_header(frame)
        except ChannelError:
            raise w.ChannelBroken("a sealed bulk frame failed authentication") from None
        if plain[0] != w.OK:
            raise store_error(*_error(plain))
        if len(plain) != 1 + size:
            raise w.ChannelBroken("a sealed reply header of the wrong length")
        return plain[1:]

    def _batch(
        self, sock: socket.socket, served: int, left: int
    ) -> tuple[tuple[int, ...], bool, memoryview]:
        """The next BATCHED reply header, `served` blocks into the reply with `left`
        more asked for: its blocks' sizes, whether it is the reply's last, and the
        bytes received after it (the start of its payloads; valid until the next
        header). The header is taken with its length in one receive, as long as it is
        when every block asked for is in it; what came beyond it is handed on."""
        expect = 1 + w.BATCH.size + w.SIZE.size * left + TAG_BYTES  # all in one batch
        most = expect if expect > MAX_ERROR_FRAME else MAX_ERROR_FRAME
        head = self._head
        if head.nbytes < w.FRAME.size + most:
            head = self._head = memoryview(bytearray(w.FRAME.size + most))
        got = bulkio.recv_some(sock, head[: w.FRAME.size + expect], self._timer)
        if got < w.FRAME.size:
            bulkio.recv_exact(sock, head[got : w.FRAME.size], self._timer)
            got = w.FRAME.size
        (length,) = w.FRAME.unpack_from(head)
        bulkio.check_frame_size(length, 1 + TAG_BYTES, most)
        end = w.FRAME.size + length
        if got < end:  # the rest of a header that came in pieces (or an error frame)
            bulkio.recv_exact(sock, head[got:end], self._timer)
            got = end
        try:
            plain = self._in.open_header(head[w.FRAME.size : end])
        except ChannelError:
            raise w.ChannelBroken("a sealed bulk frame failed authentication") from None
        if plain[0] != w.OK:
            if got > end:  # an error frame is the last thing the server sends
                raise w.ChannelBroken("bytes beyond a sealed error frame")
            raise store_error(*_error(plain))
        if len(plain) < 1 + w.BATCH.size:
            raise w.ChannelBroken("a sealed batch header too short")
        first, count, final = w.BATCH.unpack_from(plain, 1)
        if first != served:
            raise w.ChannelBroken("a sealed reply out of order")
        if count > left or (not final and count == left):
            raise w.ChannelBroken("the server sent more blocks than were asked for")
        if final > 1 or (count == 0 and not final):
            raise w.ChannelBroken("a sealed batch header that does not fit the exchange")
        if len(plain) != 1 + w.BATCH.size + w.SIZE.size * count:
            raise w.ChannelBroken("a sealed batch header of the wrong length")
        sizes: tuple[int, ...] = struct.unpack_from(f">{count}Q", plain, 1 + w.BATCH.size)
        for size in sizes:
            if size > MAX_BLOCK_BYTES:
                raise store_error("DATA_LOSS", f"the server announced a {size}-byte block")
        return sizes, final == 1, head[end:got]

    # -- requests -----------------------------------------------------------------------

    def get(
        self,
        sock: socket.socket,
        buffers: Buffers,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
        pieces: PieceSink | None = None,
    ) -> Iterator[memoryview]:
        """The leading present blocks, each as it arrives (sealed: the caller opens it).
        Returns normally only after the reply's authenticated end. `pieces`: each
        block's bytes are fed there as they arrive (the caller opens a block while the
        rest of it is on the wire), before the block is yielded."""
        if self._batched:
            return self._get_batched(sock, buffers, model, digests, keep=keep, pieces=pieces)
        return self._get_blocks(sock, buffers, model, digests, keep=keep, pieces=pieces)

    def _get_blocks(
        self,
        sock: socket.socket,
        buffers: Buffers,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
        pieces: PieceSink | None,
    ) -> Iterator[memoryview]:
        """`get` with a reply header per block and one for the end (a server from
        before BATCHED)."""
        self._send(sock, self._request(w.OP_GET, model, digests, b""))
        for index in range(len(digests) + 1):
            got, size = w.BLOCK.unpack(self._reply(sock, w.BLOCK.size))
            if got != index:
                raise w.ChannelBroken("a sealed reply out of order")
            if size == 0:
                return
            if size > MAX_BLOCK_BYTES:
                raise store_error("DATA_LOSS", f"the server announced a {size}-byte block")
            view = buffers.take(size, keep=keep)
            feed = None if pieces is None else pieces(index, size)
            if feed is None:
                bulkio.recv_exact(sock, view, self._timer)
            else:
                bulkio.recv_fed(sock, view, feed, self._timer)
            yield view
        raise w.ChannelBroken("the server sent more blocks than were asked for")

    def _get_batched(
        self,
        sock: socket.socket,
        buffers: Buffers,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
        pieces: PieceSink | None,
    ) -> Iterator[memoryview]:
        """`get` with a reply header per batch (BATCHED): a batch's payloads follow its
        header back to back; kept ones are received in one call, the batch whole,
        unless they are fed to `pieces` as they arrive."""
        self._send(sock, self._get_request(model, digests))
        served, final = 0, False
        while not final:
            sizes, final, early = self._batch(sock, served, len(digests) - served)
            first, served = served, served + len(sizes)
            if pieces is not None:
                for index, size in enumerate(sizes, first):
                    view = buffers.take(size, keep=keep)
                    early = _receive_fed(sock, view, early, pieces(index, size), self._timer)
                    yield view
                continue
            if keep:
                views = [buffers.take(size, keep=True) for size in sizes]
                _receive(sock, views, early, self._timer)
                yield from views
                continue
            for size in sizes:  # each lands where the last did: received as it is used
                view = buffers.take(size, keep=False)
                early = _receive(sock, [view], early, self._timer)
                yield view

    def put(
        self,
        sock: socket.socket,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[Payload],
    ) -> list[bool]:
        """Store blocks; per block True if newly stored."""
        sizes = b"".join(w.SIZE.pack(memoryview(p).nbytes) for p in payloads)
        parts: list[Payload] = [*self._request(w.OP_PUT, model, digests, sizes)]
        for index, payload in enumerate(payloads):  # tags bound to the body frame sealed last
            parts += [payload, self._out.payload_tag(index, payload)]
        self._send(sock, parts)
        outcomes = self._reply(sock, len(digests))
        return [o == w.OUTCOME_STORED for o in outcomes]

    def _send(self, sock: socket.socket, parts: Sequence[Payload]) -> None:
        try:
            bulkio.send_parts(sock, list(parts), self._timer)
        except (BrokenPipeError, ConnectionResetError):
            # The server refused the request from its header and closed: its error frame
            # may be waiting to be read.
            self._reply(sock, 0)
            raise


def _receive(
    sock: socket.socket, views: list[memoryview], early: memoryview, timer: SocketTimer
) -> memoryview:
    """Fill `views` in turn: first from `early` (bytes received with the header before
    them), the rest off the socket; what is left of `early`."""
    if early.nbytes:
        rest: list[memoryview] = []
        for view in views:
            used = min(early.nbytes, view.nbytes)
            view[:used] = early[:used]
            early = early[used:]
            if used < view.nbytes:
                rest.append(view[used:])
        views = rest
    if views:
        bulkio.recv_exact_parts(sock, views, timer)
    return early


def _receive_fed(
    sock: socket.socket,
    view: memoryview,
    early: memoryview,
    feed: Callable[[memoryview], None] | None,
    timer: SocketTimer,
) -> memoryview:
    """`_receive` of one block, fed to `feed` as its bytes arrive (None: received
    whole); what is left of `early`."""
    if feed is None:
        return _receive(sock, [view], early, timer)
    used = min(early.nbytes, view.nbytes)
    if used:
        view[:used] = early[:used]
        feed(view[:used])
    if used < view.nbytes:
        bulkio.recv_fed(sock, view[used:], feed, timer)
    return early[used:]


def _error(plain: bytes) -> tuple[int, str]:
    """An authenticated error frame's status code and message."""
    if len(plain) < w.ERROR.size:
        raise w.ChannelBroken("a sealed error frame too short")
    code, length = w.ERROR.unpack_from(plain)
    if len(plain) != w.ERROR.size + length:
        raise w.ChannelBroken("a sealed error frame of the wrong length")
    return code, plain[w.ERROR.size :].decode("utf-8", "replace")
