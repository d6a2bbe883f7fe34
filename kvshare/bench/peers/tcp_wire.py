"""The raw-TCP ceiling's wire format and the socket loops both of its ends share.

A request is a fixed header, `key_count` 32-byte keys, then (PUT) `key_count` values of
`value_bytes` each. A reply is a fixed header, then (GET) one u64 length per value
found and the values back to back. An EXISTS request is a GET's; its reply is the
header alone, value_count = how many leading keys are held. The control ops (CLEAR,
RESERVE) carry no keys. Nothing else: this is the least any store on a socket must
do, so it bounds what kvshare's data path can reach.

The lengths are followed by zero bytes up to a multiple of VALUE_ALIGN (`padding`), so
the values start 64 bytes into the reply, or more: the kernel copies a value into the
socket's buffer pages, and the receiver out of them, ~2.5x slower when it begins 1-31
bytes into a page (benchmarks/socket_alignment.py), and the 24 bytes before a single
value made the ceiling pay that on both ends until 2026-12-06.
"""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Sequence

REQUEST = struct.Struct("<BxxxIQ")  # op, key_count, value_bytes (each value)
REPLY = struct.Struct("<BxxxIQ")  # status, value_count, total value bytes
LENGTH = struct.Struct("<Q")
KEY_BYTES = 32
MAX_KEYS_PER_REQUEST = 4096  # bounds the server's key buffer

OP_PUT = 1
OP_GET = 2
OP_CLEAR = 3
OP_RESERVE = 4  # pre-allocate key_count pooled buffers of value_bytes (untimed set-up)
OP_EXISTS = 5  # how many leading keys are held (the lookup a scheduler makes)
KEYED_OPS = frozenset({OP_PUT, OP_GET, OP_EXISTS})  # requests followed by key_count keys

STATUS_OK = 0
STATUS_BAD_REQUEST = 1

_IOV_BATCH = 512  # below IOV_MAX (1024 on Linux)
VALUE_ALIGN = 64


def padding(value_count: int) -> int:
    """Zero bytes between a GET reply's lengths and its values."""
    return -(REPLY.size + LENGTH.size * value_count) % VALUE_ALIGN


class PeerClosed(ConnectionError):
    """The other end closed the connection in the middle of a message."""


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill `view` completely from `sock` (recv_into: no per-call allocation)."""
    received = 0
    total = len(view)
    while received < total:
        count = sock.recv_into(view[received:], total - received)
        if count == 0:
            raise PeerClosed(f"connection closed after {received} of {total} bytes")
        received += count


def send_buffers(sock: socket.socket, buffers: Sequence[bytes | memoryview]) -> None:
    """Send buffers in order with few syscalls (sendmsg), handling partial sends."""
    if isinstance(sock, ssl.SSLSocket):  # SSLSocket has no sendmsg
        for buffer in buffers:
            sock.sendall(buffer)
        return
    pending = [memoryview(buffer).cast("B") for buffer in buffers if len(buffer)]
    while pending:
        batch = pending[:_IOV_BATCH]
        sent = sock.sendmsg(batch)
        consumed = 0
        while consumed < len(batch) and sent >= len(batch[consumed]):
            sent -= len(batch[consumed])
            consumed += 1
        del pending[:consumed]
        if sent:
            pending[0] = pending[0][sent:]


def configure(sock: socket.socket) -> None:
    """Nagle's algorithm stalls acknowledged writes; the ceiling must not pay for it."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
