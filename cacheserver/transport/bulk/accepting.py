"""The bulk listener's sockets: bound with a clear error, TLS from the gRPC port's files,
and an accept loop that outlives resource exhaustion, and says so.

`accept()` fails for two kinds of reasons. The listener was closed (the server stops):
the loop ends. Or the process or the host ran out of something — descriptors (EMFILE,
ENFILE: a flood of idle connections to any of the server's ports is enough), buffers or
memory — or the pending connection died before it was taken (ECONNABORTED): that is
transient, and a loop that returned on it would leave the bulk channel dead for good
after a brief flood, with nothing logged, while gRPC recovers on its own. So the loop
backs off (up to a second), logs once when it starts failing and once it can accept
again, and reports the state for health (`problem`) until then. The connection whose
accept failed is gone (the kernel drops it), so recovery is not left to the next
caller: while failing, the loop wakes every second and checks that a descriptor can be
had again. A connection it cannot
start a thread for is closed, not left to hold a slot.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import ssl
import threading
import time
from collections.abc import Callable

from kvcommon import bulkio
from kvcommon.errors import ConfigError

log = logging.getLogger(__name__)
# Out of a resource that frees itself once the flood or the load passes.
EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
# The pending connection went away before accept() took it: try the next one.
GONE = {errno.ECONNABORTED, errno.EPROTO, errno.EINTR, errno.EAGAIN}
FIRST_BACKOFF_S = 0.01
MAX_BACKOFF_S = 1.0


class AcceptLoop:
    """Accepts on `listener` until `stopping()` and hands each connection to `serve`
    (which starts its own thread and returns)."""

    def __init__(
        self,
        listener: socket.socket,
        kind: str,
        accepted: Callable[[socket.socket], None],
        stopping: Callable[[], bool],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._listener = listener
        self._kind = kind
        self._accepted = accepted
        self._stopping = stopping
        self._clock = clock
        self._lock = threading.Lock()
        self._failing_since: float | None = None
        self._failure = ""
        self._failures = 0

    def problem(self) -> str | None:
        """Why this listener cannot take connections now (for health), or None."""
        with self._lock:
            if self._failing_since is None:
                return None
            seconds = self._clock() - self._failing_since
            return (
                f"the bulk {self._kind} listener cannot accept connections ({self._failure}) "
                f"for {seconds:.0f} s; clients use gRPC meanwhile"
            )

    def run(self) -> None:
        backoff = FIRST_BACKOFF_S
        while not self._stopping():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:  # only while failing: can it have a descriptor again?
                if _descriptor_available(self._listener):
                    self._recovered()
                continue
            except OSError as error:
                if self._stopping():
                    return  # the listener was closed
                if error.errno not in EXHAUSTED | GONE:
                    log.error(
                        "bulk %s listener: accept failed (%s); it takes no more connections",
                        self._kind,
                        error.strerror or error,
                    )
                    self._failed(error)
                    return
                if error.errno in EXHAUSTED:
                    self._failed(error)
                    self._listener.settimeout(MAX_BACKOFF_S)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, MAX_BACKOFF_S)
                continue
            backoff = FIRST_BACKOFF_S
            self._recovered()
            try:
                self._accepted(conn)
            except RuntimeError:  # no thread could be started: the same exhaustion
                with contextlib.suppress(OSError):
                    conn.close()
                self._failed(OSError(errno.EAGAIN, "cannot start a thread"))

    def _failed(self, error: OSError) -> None:
        with self._lock:
            self._failures += 1
            first = self._failing_since is None
            if first:
                self._failing_since = self._clock()
            self._failure = error.strerror or str(error)
        if first:
            log.warning(
                "bulk %s listener: cannot accept connections (%s); retrying, up to every "
                "%.0f s, while clients use gRPC",
                self._kind,
                self._failure,
                MAX_BACKOFF_S,
            )

    def _recovered(self) -> None:
        if self._listener.gettimeout() is not None:
            self._listener.settimeout(None)
        with self._lock:
            since, failures = self._failing_since, self._failures
            self._failing_since, self._failures = None, 0
        if since is not None:
            log.warning(
                "bulk %s listener: accepting connections again after %.1f s (%d failed accepts)",
                self._kind,
                self._clock() - since,
                failures,
            )


def _descriptor_available(listener: socket.socket) -> bool:
    try:
        os.close(os.dup(listener.fileno()))
    except OSError:
        return False
    return True


def bind_listener(host: str, port: int) -> socket.socket:
    """The TCP listener on `host:port` ([bulk] listen), or ConfigError saying what to change."""
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host.strip("[]"), port))
        listener.listen(128)
    except OSError as error:
        listener.close()
        reason = (
            "the port is in use"
            if error.errno == errno.EADDRINUSE
            else f"cannot bind ({error.strerror or error})"
        )
        raise ConfigError(
            f"cannot listen on {host}:{port} for the bulk channel: {reason}; set "
            "[bulk] listen or --bulk-listen (default: the --listen host at its port + 1)"
        ) from None
    return listener


def server_tls_context(
    cert_chain: bytes, private_key: bytes, client_ca: bytes | None
) -> ssl.SSLContext:
    """The bulk listener's TLS context, from the same files as the gRPC port."""
    import tempfile
    from pathlib import Path

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.options |= bulkio.SSL_OP_ENABLE_KTLS
    with tempfile.TemporaryDirectory() as tmp:
        cert_path, key_path = Path(tmp) / "cert.pem", Path(tmp) / "key.pem"
        cert_path.write_bytes(cert_chain)
        key_path.write_bytes(private_key)
        key_path.chmod(0o600)
        context.load_cert_chain(cert_path, key_path)
    if client_ca is not None:
        context.load_verify_locations(cadata=client_ca.decode("ascii"))
        context.verify_mode = ssl.CERT_REQUIRED
    return context
