"""The same-host transport's shared memory: one sealed memfd arena per connection.

The server maps the arena and sends the client its descriptor (SCM_RIGHTS) after the
handshake. Seals (no shrink, no grow) keep its size fixed, so no access of the server's
can fault, whatever the client does with its own descriptor. Payloads move through it:
block i of a request at `bulkwire.arena_offsets(sizes)[i]`; the server derives and
bounds-checks every offset itself.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import secrets
import socket
import threading
from collections.abc import Sequence

from cacheserver.transport.caps import PrincipalCap
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument

log = logging.getLogger(__name__)
# Linux only (memfd, seals, abstract sockets): elsewhere the same-host listener is off.
SAME_HOST_SUPPORTED = hasattr(os, "memfd_create") and hasattr(fcntl, "F_ADD_SEALS")
ARENA_SEALS = (
    fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL if SAME_HOST_SUPPORTED else 0
)


class Arena:
    """A same-host connection's shared memory: a sealed memfd, mapped here and sent to
    the client. The seals keep its size fixed, so the server's mapping never faults."""

    def __init__(self, size: int) -> None:
        self.fd = os.memfd_create("kvshare-bulk-arena", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, size)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS, ARENA_SEALS)
            self._map = mmap.mmap(self.fd, size)
        except BaseException:
            os.close(self.fd)
            raise
        self.size = size
        self.view = memoryview(self._map)

    def placed(self, sizes: Sequence[int]) -> list[int]:
        """The offsets of a request's blocks, or InvalidArgument if they do not fit."""
        offsets, end = w.arena_offsets(sizes)
        if end > self.size:
            raise InvalidArgument(
                f"the request's {len(sizes)} payloads take {end} bytes, over this "
                f"connection's shared-memory arena of {self.size}; split the request"
            )
        return offsets

    def close_fd(self) -> None:
        """Close this side's descriptor (once: its number may be reused at once)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)

    def close(self) -> None:
        """Free the arena's memory now: the client may keep its descriptor after the
        connection ends, which would otherwise keep the pages alive (and unbounded by
        [bulk] max_arenas). MADV_REMOVE gives them back; the client then sees zeros."""
        self.close_fd()
        self.view.release()
        with contextlib.suppress(OSError, AttributeError):
            self._map.madvise(mmap.MADV_REMOVE)
        self._map.close()


def listen_locally() -> tuple[socket.socket, str] | None:
    """The same-host listener: an abstract Unix socket with a random 128-bit name (so
    no one can claim it before the server, and only a caller told it by OpenBulk finds
    it), and that name (without the leading NUL). None (logged) where the platform has
    none: clients then use TCP."""
    if not SAME_HOST_SUPPORTED:
        log.warning("no same-host bulk transport on this platform (needs Linux memfd)")
        return None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    name = f"kvshare-bulk-{secrets.token_hex(16)}"
    try:
        listener.bind("\0" + name)
        listener.listen(128)
    except OSError as error:
        listener.close()
        log.warning("no same-host bulk listener (%s); clients use TCP", error.strerror)
        return None
    return listener, name


class ArenaCount:
    """How many arenas are open, in all and per principal: each holds up to its size in
    memory, so both are capped; past either cap a client uses the TCP listener."""

    def __init__(self, max_total: int, max_per_principal: int) -> None:
        self._lock = threading.Lock()
        self._cap = PrincipalCap(
            max_total,
            max_per_principal,
            lambda cap: (
                f"all {cap} same-host arenas are in use ([bulk] max_arenas); use the TCP listener"
            ),
            lambda principal, cap: (
                f"principal {principal!r} holds {cap} same-host arenas "
                "([bulk] max_arenas_per_principal); its further connections use the TCP listener"
            ),
        )

    @property
    def total(self) -> int:
        with self._lock:
            return self._cap.total

    def take(self, principal: str) -> None:
        """One more arena for `principal`, or ResourceExhausted saying which cap."""
        with self._lock:
            self._cap.take(principal)

    def give_back(self, principal: str) -> None:
        with self._lock:
            self._cap.give_back(principal)
