"""The bulk channel's framing, shared by server and client (no I/O policy here).

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
    error frame: status u8 (a gRPC status code) | message_len u16 | message (UTF-8);
            the status is the error class's `code` (kvcommon.errors), as over gRPC.
            The server then closes the connection, except after INTERNAL (13) for a
            request it had read whole and not begun to answer: that connection
            takes the next request (a client may still close it)

Integers are big-endian. Payloads are raw bytes with no per-message framing, so both
sides move them with one `sendmsg`/`recv_into` each, without copies.

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

import ctypes
import socket
import ssl
import struct
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from kvcommon import handoff
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
TLS_RECORD_HANDSHAKE = 0x16  # the first byte of a TLS ClientHello
# OpenSSL's SSL_OP_ENABLE_KTLS (Python 3.12 names it ssl.OP_ENABLE_KTLS; 3.11 passes the
# bit through): record encryption moves into the kernel where it has the `tls` module,
# else OpenSSL stays in user space, silently. Set on both ends of the TLS bulk channel.
SSL_OP_ENABLE_KTLS = getattr(ssl, "OP_ENABLE_KTLS", 1 << 3)
ARENA_REPLY = struct.Struct(">BQ")
PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (native)
LOCAL_GET = struct.Struct(">IB")
ARENA_ALIGN = 4096  # page-aligned blocks: copies between odd offsets run far slower
MAX_MESSAGE_CHARS = 1024
MAX_IOV = 512  # below Linux's IOV_MAX (1024) per sendmsg


class ConnectionClosed(ConnectionError):
    """The peer closed the connection in the middle of a frame."""


class ChannelBroken(ConnectionError):
    """A sealed-channel frame failed authentication or does not fit the exchange: the
    connection cannot be trusted any more and is closed (the client falls back)."""


def sealed_frame(sealed: bytes) -> bytes:
    """A sealed header as it crosses the wire: its length, then its bytes."""
    return FRAME.pack(len(sealed)) + sealed


def recv_frame(
    sock: socket.socket, min_size: int, max_size: int, deadline: Timer | None = None
) -> bytearray:
    """The next sealed header's bytes (still sealed). A length outside what this point
    of the exchange allows is refused before anything is allocated for it."""
    (size,) = FRAME.unpack(recv_bytes(sock, FRAME.size, deadline))
    if not min_size <= size <= max_size:
        raise ChannelBroken("a sealed bulk frame of an impossible length")
    return recv_bytes(sock, size, deadline)


class Timer(Protocol):
    """What `recv_exact` and `send_parts` call around each system call to bound a
    transfer: `Deadline` (the server's, per transfer) or the client's per-call timer
    (replica_agent.deadline.SocketTimer)."""

    def arm(self, sock: socket.socket) -> None: ...

    def disarm(self, sock: socket.socket) -> None: ...


class Deadline:
    """A total time limit on one transfer, however slowly its bytes trickle in or are
    taken: before each system call the socket's timeout is set to what is left, and
    afterwards back to `idle_s` (the connection's timeout between requests).

    On a blocking plain socket `recv_exact` and `send_parts` first move what can move
    without waiting, and arm only for the rest: a small reply or request then costs no
    setsockopt, while a peer that drips or stops reading is bounded as before. (Only
    this timer: the client's `SocketTimer` sets no timeout on its fast path anyway.)"""

    def __init__(self, seconds: float, idle_s: float) -> None:
        self.at = time.monotonic() + seconds
        self.idle_s = idle_s

    def left_s(self) -> float:
        """Seconds left; TimeoutError, as a timed-out socket would raise, once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TimeoutError("the transfer did not complete within its deadline")
        return left

    def arm(self, sock: socket.socket) -> None:
        set_timeout(sock, self.left_s())

    def disarm(self, sock: socket.socket) -> None:
        set_timeout(sock, self.idle_s)


def set_timeout(sock: socket.socket, seconds: float) -> None:
    """The socket's timeout, whichever kind it has: kernel timeouts on a blocking socket
    (`kernel_timeouts`), Python's own on a TLS or non-blocking one."""
    if sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket):
        _kernel_timeouts(sock, seconds)
    else:
        sock.settimeout(seconds)


def recv_exact(sock: socket.socket, view: memoryview, deadline: Timer | None = None) -> None:
    """Fill `view` completely from `sock` (within `deadline`, when given).

    On a blocking plain socket (timeouts set with SO_RCVTIMEO, see `kernel_timeouts`),
    MSG_WAITALL has the kernel fill the whole view in one call: one wake-up per block
    instead of one per ~64 KiB that arrived. There a `Deadline` is armed only for bytes
    that have not arrived yet (`_recv_now`). A thread that serves other connections too
    hands off before it waits for bytes (kvcommon.handoff)."""
    flags = 0
    if _waits_in_kernel(sock):
        flags = socket.MSG_WAITALL
        timed = isinstance(deadline, Deadline)
        if view.nbytes and (timed or handoff.armed()):
            if isinstance(deadline, Deadline):
                deadline.left_s()  # a spent deadline fails before any byte moves, as arm does
            view = view[_recv_now(sock, view) :]
            if not view.nbytes:
                return
            handoff.before_blocking()  # a thread serving other connections goes on
    elif handoff.armed():
        handoff.before_blocking()
    try:
        while view.nbytes:
            if deadline is not None:
                deadline.arm(sock)
            received = sock.recv_into(view, 0, flags)
            if received == 0:
                raise ConnectionClosed("peer closed the bulk connection")
            view = view[received:]
    finally:
        if deadline is not None:
            deadline.disarm(sock)


def recv_exact_parts(
    sock: socket.socket, views: list[memoryview], deadline: Timer | None = None
) -> None:
    """Fill every view of `views` in turn, as `recv_exact` fills one: on a blocking plain
    socket in one `recvmsg_into` (MSG_WAITALL) where the bytes have arrived, so a block
    and the size that follows it cost one system call, not two."""
    if not _waits_in_kernel(sock) or isinstance(deadline, Deadline) or handoff.armed():
        for view in views:
            recv_exact(sock, view, deadline)
        return
    views = [view for view in views if view.nbytes]
    try:
        while views:
            if deadline is not None:
                deadline.arm(sock)
            received = sock.recvmsg_into(views[:MAX_IOV], 0, socket.MSG_WAITALL)[0]
            if received == 0:
                raise ConnectionClosed("peer closed the bulk connection")
            _drop_sent(views, received)
    finally:
        if deadline is not None:
            deadline.disarm(sock)


def recv_some(sock: socket.socket, view: memoryview, deadline: Timer | None = None) -> int:
    """Receive what has arrived into `view`, at least one byte (waiting for it within
    `deadline`), at most `view`'s size: a reply whose length its first byte tells (an
    error frame, or OK and what follows) is then read in one call when it came whole.
    ConnectionClosed if the peer closed."""
    if handoff.armed():
        handoff.before_blocking()
    try:
        if deadline is not None:
            deadline.arm(sock)
        received = sock.recv_into(view)
    finally:
        if deadline is not None:
            deadline.disarm(sock)
    if received == 0:
        raise ConnectionClosed("peer closed the bulk connection")
    return received


def _waits_in_kernel(sock: socket.socket) -> bool:
    """A blocking plain socket: its timeouts are the kernel's (`kernel_timeouts`), so
    arming a `Deadline` costs two setsockopt calls and restoring it two more. A TLS
    socket takes no flags on its calls; one with Python's timeout is polled anyway."""
    return sock.gettimeout() is None and not isinstance(sock, ssl.SSLSocket)


def _recv_now(sock: socket.socket, view: memoryview) -> int:
    """How many bytes of `view` were filled from what had arrived already, without
    waiting (MSG_DONTWAIT): a small request's body or a block in the receive buffer
    then needs no timeout set around it. ConnectionClosed if the peer has closed."""
    try:
        received = sock.recv_into(view, 0, socket.MSG_DONTWAIT)
    except BlockingIOError:
        return 0  # nothing there yet
    if received == 0:
        raise ConnectionClosed("peer closed the bulk connection")
    return received


def send_now(sock: socket.socket, views: list[memoryview]) -> None:
    """Send from the front of `views` (dropping what went) as much as the socket buffer
    takes at once (MSG_DONTWAIT): a reply that fits then needs no timeout set around it.
    Stops at the first send that takes less than it was offered: the buffer is full."""
    while views:
        batch = views[:MAX_IOV]
        try:
            sent = sock.sendmsg(batch, (), socket.MSG_DONTWAIT)
        except BlockingIOError:
            return  # the buffer is full
        offered = len(views)
        _drop_sent(views, sent)
        if offered - len(views) < len(batch):  # a view it was offered is left: full
            return


def _drop_sent(views: list[memoryview], sent: int) -> None:
    """Drop the first `sent` bytes of `views`, without copying the payloads."""
    while views and sent >= views[0].nbytes:
        sent -= views[0].nbytes
        views.pop(0)
    if views and sent:
        views[0] = views[0][sent:]


def kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    """Make `sock` blocking with `seconds` as the kernel's send and receive timeouts
    (a call that waits longer fails with an OSError), so receives can use MSG_WAITALL,
    which Python's own timeouts (a non-blocking socket underneath) rule out."""
    sock.settimeout(None)
    _kernel_timeouts(sock, seconds)


def _kernel_timeouts(sock: socket.socket, seconds: float) -> None:
    whole = int(seconds)
    timeval = struct.pack("ll", whole, max(1, int((seconds - whole) * 1_000_000)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, timeval)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, timeval)


def send_parts(
    sock: socket.socket,
    parts: list[bytes | bytearray | memoryview],
    deadline: Timer | None = None,
) -> None:
    """Send every byte of `parts` with as few `sendmsg` calls as the kernel allows
    (within `deadline`, when given: a peer that stops reading cannot hold the sender).

    A socket with a timeout is non-blocking underneath, so one `sendmsg` may send only a
    prefix: resume from where it stopped, without copying the payloads. On a blocking
    plain socket a `Deadline` is armed only for what the socket buffer did not take at
    once (`send_now`). A thread that serves other connections too hands off before it
    waits (kvcommon.handoff).
    """
    views = [memoryview(p).cast("B") for p in parts]
    if isinstance(deadline, Deadline) and views and _waits_in_kernel(sock):
        deadline.left_s()  # a spent deadline fails before any byte moves, as arm does
        send_now(sock, views)
        if not views:
            return
        handoff.before_blocking()  # a thread serving other connections goes on
    elif handoff.armed():
        handoff.before_blocking()
    try:
        while views:
            if deadline is not None:
                deadline.arm(sock)
            if isinstance(sock, ssl.SSLSocket):  # TLS sockets have no sendmsg
                sock.sendall(views.pop(0))
                continue
            sent = sock.sendmsg(views[:MAX_IOV])  # the kernel takes at most IOV_MAX buffers
            _drop_sent(views, sent)
    finally:
        if deadline is not None:
            deadline.disarm(sock)


def recv_bytes(sock: socket.socket, size: int, deadline: Timer | None = None) -> bytearray:
    buffer = bytearray(size)
    recv_exact(sock, memoryview(buffer), deadline)
    return buffer


def request_digests(raw: bytes | bytearray | memoryview) -> list[bytes]:
    """The digests a request's body carries back to back (whole by the framing: the
    header counts them), each its own bytes."""
    data = bytes(raw)  # one copy; slices of bytes are cheap
    return [data[i : i + DIGEST_BYTES] for i in range(0, len(data), DIGEST_BYTES)]


def lookup_reply(present: int) -> bytes:
    """A LOOKUP's reply: OK and how many leading digests are stored."""
    return bytes([OK]) + PRESENT.pack(present)


def error_frame(error: KvshareError) -> bytes:
    """The error frame of `error`: its status code (kvcommon.errors) and message."""
    encoded = str(error).encode("utf-8")[:MAX_MESSAGE_CHARS]
    return ERROR.pack(error.wire_code, len(encoded)) + encoded


def recv_error(
    sock: socket.socket, start: bytes = b"", deadline: Timer | None = None
) -> tuple[int, str]:
    """The status code and message of an error frame whose first bytes, `start`, were
    read already (the rest is received here). The one parser of the frame."""
    head = start[: ERROR.size]
    if len(head) < ERROR.size:
        head += bytes(recv_bytes(sock, ERROR.size - len(head), deadline))
    code, length = ERROR.unpack(head)
    message = start[ERROR.size :]
    if len(message) < length:
        message += bytes(recv_bytes(sock, length - len(message), deadline))
    return code, bytes(message[:length]).decode("utf-8", "replace")


def host_namespace() -> str:
    """This process's host and network namespace as `boot-id/dev:inode`, or "" where it
    cannot be read. Equal strings mean the same kernel boot and the same network
    namespace: the only place where an abstract socket name is the one bound there."""
    try:
        boot_id = Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()
        netns = Path("/proc/self/ns/net").stat()
    except OSError:
        return ""
    return f"{boot_id}/{netns.st_dev}:{netns.st_ino}" if boot_id else ""


def peer_uid(sock: socket.socket) -> int | None:
    """The user id of the process at the other end of a Unix socket (SO_PEERCRED)."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
    except (OSError, AttributeError):
        return None
    _pid, uid, _gid = PEERCRED.unpack(raw)
    return int(uid)


def arena_offsets(sizes: Sequence[int]) -> tuple[list[int], int]:
    """Where blocks of `sizes` lie in an arena, and where the last one ends."""
    offsets, start, end = [], 0, 0
    for size in sizes:
        offsets.append(start)
        end = start + size
        start = end + (-end % ARENA_ALIGN)
    return offsets, end


# Below this a copy runs under the GIL (a 64 KiB memcpy takes a few µs; letting go of
# the GIL and taking it back, with other connection threads waiting, costs more: a
# 64-block batched GET of 64 KiB blocks ran 1.2-1.3x faster this way).
GIL_FREE_COPY_BYTES = 256 << 10


def copy_into(target: memoryview, source: Any) -> None:
    """Copy all of `source` (a buffer) to the start of `target`, a writable buffer.

    Large copies go through `ctypes.memmove`, which releases the GIL, whenever the
    source's address can be had (a writable buffer, or a whole `bytes`): on a thread
    per connection, copies of several clients then run on all cores at once."""
    src = memoryview(source).cast("B")
    size = src.nbytes
    dst = target.cast("B") if target.format != "B" else target
    if size >= GIL_FREE_COPY_BYTES:
        address: Any = None
        if not src.readonly:
            address = (ctypes.c_char * size).from_buffer(src)
        elif type(source) is bytes:
            address = source  # ctypes passes a bytes object's own storage
        if address is not None:
            ctypes.memmove((ctypes.c_char * size).from_buffer(dst), address, size)
            return
    dst[:size] = src
