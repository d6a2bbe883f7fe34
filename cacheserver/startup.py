"""Checks made before the server binds anything: the data dir (owner-only, locked, writable),
the listen address (free, and loopback unless TLS or an explicit flag), the TLS files."""

from __future__ import annotations

import errno
import fcntl
import ipaddress
import logging
import os
import socket
import stat
from pathlib import Path
from typing import IO

from cacheserver.config import ServerConfig, TlsFiles
from cacheserver.config.bulk import check_bulk_plaintext
from kvcommon.errors import ConfigError

log = logging.getLogger(__name__)


def is_loopback(listen: str) -> bool:
    host = listen.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def prepare_data_dir(data_dir: Path) -> IO[str]:
    """Create the data dir and take its lock; the lock is held until the file is closed.

    The data dir is owner-only (0700), whatever it was: it holds every tenant's blocks
    (plaintext KV where a tenant does not seal) and tenant ids, and under the default
    umask LMDB would create world-readable files in it. Made by the server or not,
    a group- or world-accessible data dir is tightened, and the change is logged."""
    try:
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        _make_owner_only(data_dir)
        fd = os.open(data_dir / "server.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        lock = os.fdopen(fd, "a+")
    except OSError as error:
        raise ConfigError(
            f"data dir {data_dir} is not writable ({error.strerror}); "
            "pick another --data-dir or fix its permissions"
        ) from None
    try:
        fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        raise ConfigError(
            f"data dir {data_dir} is in use by another kvshare server; "
            "stop it or pick another --data-dir"
        ) from None
    if not os.access(data_dir, os.W_OK):
        raise ConfigError(f"data dir {data_dir} is not writable; fix its permissions")
    return lock


def _make_owner_only(data_dir: Path) -> None:
    mode = stat.S_IMODE(data_dir.stat().st_mode)
    if mode & 0o077:
        data_dir.chmod(mode & 0o700)
        log.warning(
            "data dir %s was accessible to group or others (mode %o); made it owner-only",
            data_dir,
            mode,
        )


def check_can_bind(listen: str) -> None:
    """Fail with a clear message before gRPC logs its own multi-line bind error."""
    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"--listen {listen!r} is not HOST:PORT") from None
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        # As gRPC does: connections of a previous run in TIME_WAIT must not block a restart.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as error:
            reason = (
                "the port is in use"
                if error.errno == errno.EADDRINUSE
                else f"cannot bind ({error.strerror})"
            )
            raise ConfigError(
                f"cannot listen on {listen}: {reason}; pick another --listen"
            ) from None


def check_tls(config: ServerConfig, tls: TlsFiles | None) -> None:
    """Plaintext only on loopback (unless allowed); cert principals need mTLS."""
    if not is_loopback(config.listen) and tls is None and not config.allow_insecure_listen:
        raise ConfigError(
            f"refusing to listen on non-loopback {config.listen} without TLS; give "
            "--tls-cert/--tls-key (or [tls]), or --allow-insecure-listen on a trusted network"
        )
    check_bulk_plaintext(config, tls is not None)
    certs = config.access.cert_credentials if config.access else ()
    if certs and (tls is None or tls.client_ca is None):
        name = certs[0].principal.name
        raise ConfigError(
            f"principal {name!r} authenticates by cert_identity, but mTLS is off; set "
            "[tls] client_ca (or --tls-client-ca) to the CA that signs client certificates"
        )
