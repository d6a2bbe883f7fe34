"""Helpers of the same-host arena (the frames: kvcommon.bulkwire): whether a peer is
on this host, in this network namespace and of which user, and the copies into and
out of the shared-memory arena."""

from __future__ import annotations

import ctypes
import socket
import struct
from pathlib import Path
from typing import Any

PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid (native)


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
