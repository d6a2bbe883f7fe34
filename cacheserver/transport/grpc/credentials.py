"""The server's TLS credentials, which a live reload can rotate (gRPC's, and the
bulk listener's context made from the same files).

The server's certificate chain, key and client CA are read at start-up and again at
each reload (cacheserver.reload). gRPC's dynamic server credentials ask
`RotatingCertificate.fetch` at each new handshake whether the certificate changed:
after a reload the next handshake takes the new files, and connections already open
keep the session they made. Whether the server asks for client certificates (mutual
TLS) is fixed at start-up: turning it on or off needs a restart.
"""

from __future__ import annotations

import ssl
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from cacheserver.config import TlsFiles
from cacheserver.transport.bulk import server_tls_context
from kvcommon.errors import ConfigError


@dataclass(frozen=True)
class TlsMaterial:
    """The bytes of a server's TLS files, read once."""

    chain: bytes
    key: bytes = field(repr=False)
    client_ca: bytes | None = None


def read_tls(tls: TlsFiles) -> TlsMaterial:
    try:
        return TlsMaterial(
            tls.cert_chain.read_bytes(),
            tls.private_key.read_bytes(),
            tls.client_ca.read_bytes() if tls.client_ca else None,
        )
    except OSError as error:
        raise ConfigError(f"cannot read TLS file {error.filename}: {error.strerror}") from None


def bulk_tls(material: TlsMaterial | None) -> ssl.SSLContext | None:
    """The bulk listener's TLS context for the same files (None: no TLS); ConfigError
    for a certificate and key that do not make one."""
    if material is None:
        return None
    try:
        return server_tls_context(material.chain, material.key, material.client_ca)
    except (ssl.SSLError, ValueError) as error:  # a key not the certificate's, no PEM
        reason = getattr(error, "reason", None) or str(error)
        raise ConfigError(
            f"[tls] cert and key do not make a TLS context ({reason}); give the "
            "certificate chain and the private key that belong together, and a PEM client_ca"
        ) from None


def _configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.key, material.chain)], root_certificates=material.client_ca
    )


class RotatingCertificate:
    """The certificate configuration gRPC's handshakes take, swapped by `rotate`."""

    def __init__(self, material: TlsMaterial) -> None:
        self._lock = threading.Lock()
        self._pending: grpc.ServerCertificateConfiguration | None = None
        self._initial = _configuration(material)
        self._mutual = material.client_ca is not None

    def credentials(self) -> grpc.ServerCredentials:
        # (grpc's stubs say the fetcher returns a configuration; None, "unchanged", is
        # what its documentation allows and its C core expects)
        fetch: Callable[[], grpc.ServerCertificateConfiguration] = self.fetch  # type: ignore[assignment]
        return grpc.dynamic_ssl_server_credentials(
            self._initial, fetch, require_client_authentication=self._mutual
        )

    def rotate(self, material: TlsMaterial) -> None:
        """New handshakes use `material` (its client CA, if any, too)."""
        with self._lock:
            self._pending = _configuration(material)

    def fetch(self) -> grpc.ServerCertificateConfiguration | None:
        """gRPC's question at each handshake: a new configuration, or None (unchanged)."""
        with self._lock:
            pending, self._pending = self._pending, None
        return pending
