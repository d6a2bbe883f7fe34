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
  before use, so a block altered or swapped on the way is a miss, never KV.

Every check that fails raises `ChannelBroken` (a ConnectionError): the connection is
dropped and the client's call falls back to gRPC (TLS), or ends as a miss.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Sequence

from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.tracing import binary_context
from policy.bulkchannel import TAG_BYTES, ChannelError, Receiver, Sender, client_side
from replica_agent.bulk_buffers import Buffers
from replica_agent.deadline import SocketTimer
from replica_agent.errors import store_error
from replica_agent.grpc_calls import MAX_BLOCK_BYTES
from replica_agent.transport import Payload

# A reply header's plaintext is a status byte and its fields, or an error frame
# (status, length u16, up to MAX_MESSAGE_CHARS bytes of message).
MAX_ERROR_BYTES = w.ERROR.size + w.MAX_MESSAGE_CHARS


class SealedChannel:
    """One connection's two directions: this side's Sender and the server's Receiver;
    every send and receive within the current call's deadline (the connection's
    `timer`)."""

    def __init__(
        self, sender: Sender, receiver: Receiver, traced: bool, timer: SocketTimer
    ) -> None:
        self._out = sender
        self._in = receiver
        self._traced = traced
        self._timer = timer

    @classmethod
    def hello(
        cls, sock: socket.socket, secret: bytes, ticket: bytes, traced: bool, timer: SocketTimer
    ) -> SealedChannel:
        """Present the ticket with this side's proof, and check the server's."""
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
        return cls(sender, receiver, traced, timer)

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

    # -- requests -----------------------------------------------------------------------

    def get(
        self,
        sock: socket.socket,
        buffers: Buffers,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
    ) -> Iterator[memoryview]:
        """The leading present blocks, each as it arrives (sealed: the caller opens it).
        Returns normally only after the reply's authenticated end."""
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
            bulkio.recv_exact(sock, view, self._timer)
            yield view
        raise w.ChannelBroken("the server sent more blocks than were asked for")

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


def _error(plain: bytes) -> tuple[int, str]:
    """An authenticated error frame's status code and message."""
    if len(plain) < w.ERROR.size:
        raise w.ChannelBroken("a sealed error frame too short")
    code, length = w.ERROR.unpack_from(plain)
    if len(plain) != w.ERROR.size + length:
        raise w.ChannelBroken("a sealed error frame of the wrong length")
    return code, plain[w.ERROR.size :].decode("utf-8", "replace")
