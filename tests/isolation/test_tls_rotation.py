"""TLS rotation by a live reload (cacheserver.reload): the server certificate, its key
and the client CA change without a restart. New handshakes on the gRPC port and on the
bulk listener present the new certificate and trust only the new client CA; a client
certificate of the old CA is refused from then on, one of the new CA serves."""

from __future__ import annotations

import re
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import SPIFFE, CertFiles, TestCA
from tests.support.reload import MODEL, Grant, LiveConfig, digest, reload
from tests.support.servers import Running

BLOCK = b"k" * 4096


def tls_table(server: CertFiles, client_ca: Path) -> str:
    return f'[tls]\ncert = "{server.cert}"\nkey = "{server.key}"\nclient_ca = "{client_ca}"\n'


CERT_PRINCIPAL = (
    f'[[principals]]\nname = "cert-a"\ncert_identity = "uri:{SPIFFE}/cert-a"\n'
    'tenants = ["alpha"]\nactions = ["read", "write"]\n'
)


class Cas:
    def __init__(self, directory: Path) -> None:
        self.old = TestCA(directory / "old", name="old CA")
        self.new = TestCA(directory / "new", name="new CA")
        self.old_server = self.old.server_cert("server")
        self.new_server = self.new.server_cert("server")
        self.old_client = self.old.client_cert("cert-a", common_name="a", uri=f"{SPIFFE}/cert-a")
        self.new_client = self.new.client_cert("cert-a", common_name="a", uri=f"{SPIFFE}/cert-a")
        self.both = directory / "both-cas.crt"  # what a client trusts across the rotation
        self.both.write_bytes(self.old.cert_path.read_bytes() + self.new.cert_path.read_bytes())


@pytest.fixture
def cas(tmp_path: Path) -> Cas:
    return Cas(tmp_path / "pki")


@pytest.fixture
def live(tmp_path: Path, cas: Cas) -> LiveConfig:
    return LiveConfig(
        tmp_path,
        {"alpha": 0},
        {"root": Grant(["alpha"], ["read", "write", "admin"])},
        tls_table(cas.old_server, cas.old.cert_path),
        CERT_PRINCIPAL,
    )


def served_certificate(address: str, ca: Path, client: CertFiles, *, alpn: bool) -> bytes:
    """The certificate a new handshake with `address` is shown (DER)."""
    host, port = address.rsplit(":", 1)
    context = ssl.create_default_context(cafile=ca)
    context.load_cert_chain(client.cert, client.key)
    if alpn:  # gRPC's port speaks HTTP/2
        context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection((host, int(port)), timeout=5) as raw,
        context.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return der


def der_of(files: CertFiles) -> bytes:
    certificate = x509.load_pem_x509_certificate(files.cert.read_bytes())
    return certificate.public_bytes(Encoding.DER)


def client(running: Running, ca: Path, files: CertFiles, **options: object) -> BlockClient:
    tls = ClientTls(root_ca=ca, client_cert=files.cert, client_key=files.key)
    return BlockClient(running.address, "", tls=tls, timeout_s=5, **options)  # type: ignore[arg-type]


def test_a_reload_rotates_the_certificate_key_and_client_ca(
    running: Running, live: LiveConfig, cas: Cas
) -> None:
    bulk = running.server.server.bulk  # type: ignore[union-attr]
    assert bulk is not None
    grpc_before = served_certificate(running.address, cas.both, cas.old_client, alpn=True)
    assert grpc_before == der_of(cas.old_server)
    with client(running, cas.both, cas.old_client, same_host=False) as c:  # before: serves
        c.put("alpha", MODEL, [digest("tls", 0)], [BLOCK])

    live.extra = tls_table(cas.new_server, cas.new.cert_path)
    live.write()
    reply = reload(running, live, tls=admin_tls(cas))
    assert reply.applied, reply.message

    # New handshakes, on both ports, show the new certificate.
    assert served_certificate(running.address, cas.both, cas.new_client, alpn=True) == der_of(
        cas.new_server
    )
    assert served_certificate(bulk.address, cas.both, cas.new_client, alpn=False) == der_of(
        cas.new_server
    )
    # A client certificate of the new CA serves over gRPC and the bulk channel ...
    for options in ({"bulk": False}, {"same_host": False}):
        with client(running, cas.both, cas.new_client, **options) as c:
            assert c.get("alpha", MODEL, [digest("tls", 0)]) == [BLOCK]
    # ... and one of the old CA no longer does.
    with (
        client(running, cas.both, cas.old_client, bulk=False) as c,
        pytest.raises(Exception) as refused,
    ):
        c.get("alpha", MODEL, [digest("tls", 0)])
    code = getattr(refused.value, "code", None)
    assert (code() if callable(code) else code) == grpc.StatusCode.UNAVAILABLE


def admin_tls(cas: Cas) -> ClientTls:
    """The admin's mTLS for Reload: a client certificate of the CA the server trusts first."""
    return ClientTls(cas.both, cas.old_client.cert, cas.old_client.key)


def refused_keeping_the_old_certificate(
    running: Running, live: LiveConfig, cas: Cas, server: CertFiles
) -> str:
    """Reload with `server` as the server's certificate and key: refused in one line,
    and new handshakes are still shown the old certificate. The refusal's message."""
    live.extra = tls_table(server, cas.new.cert_path)
    live.write()
    reply = reload(running, live, tls=admin_tls(cas))
    assert not reply.applied
    assert "\n" not in reply.message
    assert served_certificate(running.address, cas.both, cas.old_client, alpn=True) == der_of(
        cas.old_server
    )
    return reply.message


def test_a_reload_with_an_unreadable_key_keeps_the_old_certificate(
    running: Running, live: LiveConfig, cas: Cas, tmp_path: Path
) -> None:
    unreadable = CertFiles(cas.new_server.cert, tmp_path / "missing.key")
    message = refused_keeping_the_old_certificate(running, live, cas, unreadable)
    assert "missing.key" in message
    assert re.match(r".*kvshare\.toml:\d+: tls: cannot read TLS file", message)


def test_a_reload_with_a_key_of_another_certificate_keeps_the_old_certificate(
    running: Running, live: LiveConfig, cas: Cas
) -> None:
    mismatched = CertFiles(cas.new_server.cert, cas.old_server.key)
    message = refused_keeping_the_old_certificate(running, live, cas, mismatched)
    assert "do not make a TLS context" in message
    assert re.match(r".*kvshare\.toml:\d+: tls: ", message)
