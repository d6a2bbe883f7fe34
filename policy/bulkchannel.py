"""The sealed-payload bulk channel's cryptography (docs/secure-channel.md), without I/O.

For tenants whose blocks are all sealed (AES-256-GCM under tenant keys the server never
holds, associated data binding tenant, model, digest and key version), encrypting the
payloads a second time in TLS is where most of the cost of the secure configuration
goes. This channel runs over plain TCP and protects everything *but* the sealed
payload bytes, under per-connection keys agreed through the TLS-protected OpenBulk:

- `OpenBulk` (gRPC over TLS) hands the client a fresh 32-byte secret with its ticket;
  each direction's key is HKDF-SHA256(secret, salt = ticket, info = direction). The
  ticket crosses the plain connection; the secret never does.
- The client proves it holds the secret when it presents the ticket (`hello_proof`),
  and the server answers with its own proof, so neither side talks to an impostor.
- Every header (a request's op, model, digests and sizes; a reply block's index and
  size, or a reply batch's first index, count, final flag and sizes; the end of a
  reply) is AES-256-GCM-encrypted with a nonce made of a counter
  that both sides keep per direction and never send: a dropped, replayed, reordered or
  reflected header fails to open.
- A PUT's payload bytes get a GMAC tag each (AES-GCM with nothing encrypted), bound to
  the request's header tag, its counter and the block's index, so the server, which
  cannot open a sealed block, never stores bytes the client did not send.
- A GET's payload bytes carry no channel tag: the agent opens every block under its
  tenant key before use, and the seal's associated data names the digest, so a block
  swapped, altered or truncated on the way fails to open and is a miss, never KV.

Every failure raises the one error `ChannelError`, and the connection must then close.
"""

from __future__ import annotations

import hmac
import secrets
import struct
from collections.abc import Iterable

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kvcommon.encoding import enc
from policy.tickets import TICKET_BYTES

SECRET_BYTES = 32
TAG_BYTES = 16
LABEL = "kvshare/bulk/v2"
CLIENT_TO_SERVER = "c2s"
SERVER_TO_CLIENT = "s2c"
HELLO_COUNTER = 0  # headers count from 1
HEADER_INDEX = 0  # a header's nonce; block i's payload tag uses i + 1
# Beyond this many headers a connection ends (the client opens a new one, new keys):
# far below the 2^64 the counter allows, and it bounds what one key protects.
MAX_HEADERS_PER_CONNECTION = 1 << 32
Buffer = bytes | bytearray | memoryview


class ChannelError(Exception):
    """A frame failed authentication, or the connection used up its keys. Close it."""


def new_channel_secret() -> bytes:
    return secrets.token_bytes(SECRET_BYTES)


def direction_key(secret: bytes, ticket: bytes, direction: str) -> bytes:
    """HKDF-SHA256(secret, salt = the connection's one-time ticket, info = direction)."""
    if len(secret) != SECRET_BYTES or len(ticket) != TICKET_BYTES:
        raise ChannelError("channel secret or ticket of the wrong size")
    kdf = HKDF(hashes.SHA256(), 32, salt=ticket, info=enc(LABEL, "key", direction))
    return kdf.derive(secret)


_NONCE = struct.Struct(">QI")  # counter u64 | index u32


def _nonce(counter: int, index: int) -> bytes:
    return _NONCE.pack(counter, index)


class _Direction:
    """One direction of one connection: its key, its label and its header counter."""

    def __init__(self, secret: bytes, ticket: bytes, direction: str) -> None:
        self._key = direction_key(secret, ticket, direction)
        self._aead = AESGCM(self._key)
        self._ticket = ticket
        self._label = direction
        self.counter = HELLO_COUNTER
        self.header_tag = b""  # the last header's tag: what its payload tags bind to
        self._header_aad = self._aad("h")  # every header's, made once per connection

    def _advance(self) -> int:
        if self.counter + 1 >= MAX_HEADERS_PER_CONNECTION:
            raise ChannelError("this connection's keys are used up; open a new one")
        self.counter += 1
        return self.counter

    def _aad(self, what: str) -> bytes:
        return enc(LABEL, what, self._label, self._ticket)

    def _gmac(self, nonce: bytes, parts: Iterable[Buffer]) -> bytes:
        """GMAC: AES-GCM over `parts` as associated data, nothing encrypted."""
        tagger = Cipher(algorithms.AES(self._key), modes.GCM(nonce)).encryptor()
        for part in parts:
            tagger.authenticate_additional_data(part)
        tagger.finalize()
        return tagger.tag

    def _check_gmac(self, nonce: bytes, parts: Iterable[Buffer], tag: bytes) -> None:
        checker = Cipher(algorithms.AES(self._key), modes.GCM(nonce, bytes(tag))).decryptor()
        for part in parts:
            checker.authenticate_additional_data(part)
        try:
            checker.finalize()  # compares the tags in constant time
        except InvalidTag:
            raise ChannelError("a bulk frame failed authentication") from None


class PayloadMac:
    """The GMAC of one payload, fed as its bytes arrive (`update`), checked by `verify`."""

    def __init__(self, key: bytes, nonce: bytes, header_tag: bytes) -> None:
        self._tagger = Cipher(algorithms.AES(key), modes.GCM(nonce)).encryptor()
        self._tagger.authenticate_additional_data(header_tag)

    def update(self, data: Buffer) -> None:
        self._tagger.authenticate_additional_data(data)

    def verify(self, tag: Buffer) -> None:
        """ChannelError unless `tag` is the GMAC of all the bytes given (constant time)."""
        self._tagger.finalize()
        if not hmac.compare_digest(self._tagger.tag, bytes(tag)):
            raise ChannelError("a bulk frame failed authentication")


class Sender(_Direction):
    """The sending side of one direction."""

    def hello_proof(self) -> bytes:
        """Proof that this side holds the channel secret (sent once, first)."""
        return self._gmac(_nonce(HELLO_COUNTER, HEADER_INDEX), [self._aad("hello")])

    def seal_header(self, header: Buffer) -> bytes:
        """The next header, encrypted and tagged (len(header) + TAG_BYTES bytes)."""
        frame = self._aead.encrypt(_nonce(self._advance(), HEADER_INDEX), header, self._header_aad)
        self.header_tag = frame[-TAG_BYTES:]
        return frame

    def payload_tag(self, index: int, payload: Buffer) -> bytes:
        """GMAC of block `index` of the last header's message."""
        nonce = _nonce(self.counter, index + 1)
        return self._gmac(nonce, [self.header_tag, payload])


class Receiver(_Direction):
    """The receiving side of one direction: checks what the peer's Sender made."""

    def check_hello(self, proof: bytes) -> None:
        self._check_gmac(_nonce(HELLO_COUNTER, HEADER_INDEX), [self._aad("hello")], proof)

    def open_header(self, frame: Buffer) -> bytes:
        """The next header's plaintext, or ChannelError (then close the connection)."""
        nonce = _nonce(self._advance(), HEADER_INDEX)
        try:
            header = self._aead.decrypt(nonce, frame, self._header_aad)
        except InvalidTag:
            raise ChannelError("a bulk frame failed authentication") from None
        self.header_tag = bytes(frame[-TAG_BYTES:])
        return header

    def check_payload(self, index: int, payload: Buffer, tag: bytes) -> None:
        """Block `index` of the last header's message is what the peer sent."""
        self._check_gmac(_nonce(self.counter, index + 1), [self.header_tag, payload], tag)

    def payload_mac(self, index: int) -> PayloadMac:
        """`check_payload` for a payload that arrives in pieces (the same tag)."""
        return PayloadMac(self._key, _nonce(self.counter, index + 1), self.header_tag)


def client_side(secret: bytes, ticket: bytes) -> tuple[Sender, Receiver]:
    return (
        Sender(secret, ticket, CLIENT_TO_SERVER),
        Receiver(secret, ticket, SERVER_TO_CLIENT),
    )


def server_side(secret: bytes, ticket: bytes) -> tuple[Sender, Receiver]:
    return (
        Sender(secret, ticket, SERVER_TO_CLIENT),
        Receiver(secret, ticket, CLIENT_TO_SERVER),
    )
