"""The bulk channel's wire format, shared by server and client: frame layouts, their
constants and the encoders that need no socket. Moving the bytes is kvcommon.bulkio's
(socket I/O within a deadline), the same-host arena's memory kvcommon.samehost's.

After `OpenBulk` (gRPC) issues a ticket, the client opens a TCP (or TLS) connection:

    client: HELLO  = b"KVB1" | ticket (32 bytes)
    server: status u8 (0 = ok; else an error frame, and the connection closes)
    then any number of requests, each answered before the next:
    client: REQUEST = op u8 | model_len u16 | count u32 | [trace] | model | count x digest (32)
            PUT adds count x size u64, then the payloads back to back
            op | TRACED (only when OpenBulk said `trace_context`): a 25-byte trace
            context follows the header (trace id 16 | span id 8 | flags u8, the fields
            of a W3C traceparent: kvcommon.tracing), so the server's span of this
            request joins the caller's trace
    server: GET  -> status u8, then per block size u64 | payload, then END (size 0)
            PUT  -> status u8, then count x outcome u8 (1 stored, 2 already present)
            op | ALIGNED on a GET (only when OpenBulk said `aligned_payloads`): each
            block's size is followed by zero bytes up to the next multiple of
            PAYLOAD_ALIGN counted from the reply's status byte, then its payload
            (`payload_padding`); the END has none. Each side computes the padding from
            the reply's length so far, so none of it is announced
    error frame: status u8 (a gRPC status code) | message_len u16 | message (UTF-8);
            the status is the error class's `code` (kvcommon.errors), as over gRPC.
            The server then closes the connection, except after INTERNAL (13) for a
            request it had read whole and not begun to answer: that connection
            takes the next request (a client may still close it)

Integers are big-endian. Payloads are raw bytes with no per-message framing, so both
sides move them with one `sendmsg`/`recv_into` each, without copies.

Why ALIGNED: the kernel copies a payload into a socket's buffer pages and, on the other
side, out of them into the receiver's buffer. On these machines both copies of a
page-aligned 2 MiB payload cost ~2.5x as much (530-660 us instead of 180-250, sender
and receiver alike) when the payload starts 1-31 bytes into the buffer page, as it did
after the GET reply's 9-byte header; 0 or 32 bytes and more were fast
(benchmarks/socket_alignment.py).

Sealed-payload channel (docs/secure-channel.md; the cryptography is
policy.bulkchannel's): for tenants that require sealed blocks, when OpenBulk (over
TLS) granted a channel secret, the client connects over plain TCP to the same port and
every header travels as a FRAME: length u32 | AES-256-GCM ciphertext and tag, under
its direction's key and the next counter of that direction.

    client: HELLO_SEALED = b"KVB2" | ticket (32) | client proof (16)
    server: status u8 (0) | server proof (16); else an error frame in clear, and the
            connection closes (it is not authenticated: the client only gives up)
    client: FRAME(REQUEST | [trace]) then FRAME(model | count x digest | PUT: count x
            size u64); PUT then sends each payload followed by its 16-byte GMAC tag
    server: every reply header is a FRAME whose plaintext starts with a status u8; not
            0: the rest of an error frame, and the connection closes (but for
            INTERNAL, as above).
            GET  -> per block FRAME(0 | BLOCK(index, size)) then the payload in clear
                    (a sealed block), then FRAME(0 | BLOCK(blocks served, 0))
            PUT  -> FRAME(0 | count x outcome u8)
            op | BATCHED on a GET (only when OpenBulk said `sealed_batches`): one
                    header per batch of the store's reply (a run of blocks from
                    memory, or one read of the disk), FRAME(0 | BATCH(first index,
                    count, final) | count x size u64), then those payloads back to
                    back in clear; the batch with `final` set (count 0 for a reply
                    that ends without one: a miss) is the reply's last. A reply from
                    memory is one header for any number of blocks
            op | ONE_FRAME on a GET (only when OpenBulk said `sealed_batches`, and
                    at most ONE_FRAME_BYTES of plaintext): the request is ONE frame,
                    FRAME(REQUEST | [trace] | model | count x digest); the server
                    admits its header (rate, tenant, action, count) before it reads
                    the model and digests, which must be exactly what it counts

Same host: the server also listens on an abstract Unix socket (`local_address` of
OpenBulk). There the handshake is the same HELLO, answered by ARENA_REPLY (status u8 |
arena size u64) with a file descriptor attached (SCM_RIGHTS): a sealed memfd of that
size, the connection's own shared-memory arena. Requests keep the framing above, but no
payload bytes cross the socket: they lie in the arena, block i at `arena_offsets(...)[i]`
(back to back from 0, each start aligned to ARENA_ALIGN).

    PUT -> the client has written the payloads to the arena before the request; the
           server copies each out before it looks at it, then answers as above
    GET -> status u8, then LOCAL_GET (count u32 | truncated u8), then count x size u64;
           the server has written those blocks to the arena. truncated: the arena was
           full before the next present block; the client asks again for the rest.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

from kvcommon.errors import KvshareError

MAGIC = b"KVB1"
HELLO = struct.Struct(">4s32s")
REQUEST = struct.Struct(">BHI")
SIZE = struct.Struct(">Q")
ERROR = struct.Struct(">BH")
OP_GET = 1
OP_PUT = 2
OP_LOOKUP = 3  # reply: OK | PRESENT (how many leading digests are stored)
PRESENT = struct.Struct(">I")
DIGEST_BYTES = 32  # each digest in a request's body
TRACED = 0x80  # flag on op: a trace context follows the REQUEST header
ALIGNED = 0x40  # flag on a GET's op: the reply's payloads start at multiples of PAYLOAD_ALIGN
PAYLOAD_ALIGN = 64
PADDING = bytes(PAYLOAD_ALIGN)
TRACE_CONTEXT_BYTES = 25
OK = 0
END = SIZE.pack(0)
OUTCOME_STORED = 1
OUTCOME_ALREADY_PRESENT = 2
MAGIC_SEALED = b"KVB2"
HELLO_SEALED = struct.Struct(">4s32s16s")
PROOF_BYTES = 16
FRAME = struct.Struct(">I")  # a sealed header's length (ciphertext and tag)
BLOCK = struct.Struct(">IQ")  # a sealed GET reply's block: index u32 | size u64 (0: end)
BATCHED = 0x20  # flag on a sealed GET's op: the reply has a header per batch (BATCH)
BATCH = struct.Struct(">IIB")  # first index u32 | count u32 | final u8; count x size u64 follow
ONE_FRAME = 0x10  # flag on a sealed GET's op: its body (model, digests) is in the same frame
ONE_FRAME_BYTES = (16 << 10) - 64  # the most a ONE_FRAME request's plaintext may be
TLS_RECORD_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello
ARENA_REPLY = struct.Struct(">BQ")
LOCAL_GET = struct.Struct(">IB")
ARENA_ALIGN = 4096  # page-aligned blocks: copies between odd offsets run far slower
MAX_MESSAGE_CHARS = 1024


class ConnectionClosed(ConnectionError):
    """The peer closed the connection in the middle of a frame."""


class ChannelBroken(ConnectionError):
    """A sealed-channel frame failed authentication or does not fit the exchange: the
    connection cannot be trusted any more and is closed (the client falls back)."""


def sealed_frame(sealed: bytes) -> bytes:
    """A sealed header as it crosses the wire: its length, then its bytes."""
    return FRAME.pack(len(sealed)) + sealed


def request_digests(raw: bytes | bytearray | memoryview) -> list[bytes]:
    """The digests a request's body carries back to back (whole by the framing: the
    header counts them), each its own bytes."""
    data = bytes(raw)  # one copy; slices of bytes are cheap
    return [data[i : i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES)]


def payload_padding(position: int) -> int:
    """Zero bytes an ALIGNED reply puts after a block's size that ends `position` bytes
    into the reply (counted from its status byte), so the payload starts at a multiple
    of PAYLOAD_ALIGN."""
    return -position % PAYLOAD_ALIGN


def block_header(size: int, position: int, aligned: bool) -> tuple[bytes, int]:
    """A GET reply's header for a block of `size` bytes whose size field starts
    `position` bytes into the reply: the size, then for an ALIGNED reply its padding
    (`payload_padding`); and the reply's length after the block's payload."""
    header = SIZE.pack(size)
    position += SIZE.size
    if aligned:
        pad = payload_padding(position)
        header += PADDING[:pad]
        position += pad
    return header, position + size


def lookup_reply(present: int) -> bytes:
    """A LOOKUP's reply: OK and how many leading digests are stored."""
    return bytes([OK]) + PRESENT.pack(present)


def error_frame(error: KvshareError) -> bytes:
    """The error frame of `error`: its status code (kvcommon.errors) and message."""
    encoded = str(error).encode("utf-8")[:MAX_MESSAGE_CHARS]
    return ERROR.pack(error.wire_code, len(encoded)) + encoded


def arena_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where blocks of `sizes` lie in an arena, and where the last one ends."""
    offsets, start, end = [], 0, 0
    for size in sizes:
        offsets.append(start)
        end = start + size
        start = end + (-end % ARENA_ALIGN)
    return offsets, end
