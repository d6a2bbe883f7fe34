"""Fixtures for the isolation suite: two tenants, two principals, generated certificates.

Tenants `alpha` and `beta`; token principals `a` (alpha rw), `b` (beta rw), `root`
(admin on both); certificate principals `cert-a` (alpha rw) and `cert-b` (beta rw)
known by their URI SANs. Every server here is the real one (gRPC, LMDB, policy).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from cacheserver.config import ServerConfig, load_config
from cacheserver.embedded import EmbeddedServer
from replica_agent.client import BlockClient, ClientTls
from tests.certs import CertFiles, TestCA
from tests.conftest import Tenancy, write_config

MODEL = "iso/model@r1;fp32;L2;H2;D8;B4;tp0/1"
SPIFFE = "spiffe://kvshare.test"


@dataclass(frozen=True)
class Certs:
    ca: TestCA
    server: CertFiles
    clients: dict[str, CertFiles]  # cert-a, cert-b, stranger (valid, mapped to nobody)
    other_ca_client: CertFiles  # signed by a CA the server does not trust


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    directory = tmp_path_factory.mktemp("certs")
    ca = TestCA(directory)
    clients = {
        name: ca.client_cert(name, common_name=name, uri=f"{SPIFFE}/{name}")
        for name in ("cert-a", "cert-b", "stranger")
    }
    rogue = TestCA(directory / "rogue", name="rogue CA")
    return Certs(
        ca,
        ca.server_cert(),
        clients,
        rogue.client_cert("cert-a", common_name="cert-a", uri=f"{SPIFFE}/cert-a"),
    )


def tls_table(certs: Certs, *, mtls: bool) -> str:
    lines = ["[tls]", f'cert = "{certs.server.cert}"', f'key = "{certs.server.key}"']
    if mtls:
        lines.append(f'client_ca = "{certs.ca.cert_path}"')
    return "\n".join(lines) + "\n"


CERT_PRINCIPALS = f"""
[[principals]]
name = "cert-a"
cert_identity = "uri:{SPIFFE}/cert-a"
tenants = ["alpha"]
actions = ["read", "write"]

[[principals]]
name = "cert-b"
cert_identity = "uri:{SPIFFE}/cert-b"
tenants = ["beta"]
actions = ["read", "write"]
"""


def isolation_config(
    directory: Path,
    certs: Certs | None = None,
    *,
    mtls: bool = False,
    quotas: dict[str, int] | None = None,
    extra: str = "",
) -> Tenancy:
    """write_config's two tenants, plus TLS (and mTLS with cert principals) if asked."""
    tls = tls_table(certs, mtls=mtls) if certs is not None else ""
    tenancy = write_config(directory, quotas=quotas, extra=extra + "\n" + tls)
    if mtls:
        with tenancy.path.open("a") as f:
            f.write(CERT_PRINCIPALS)
    return tenancy


@dataclass
class Served:
    """A running server with its config, tokens and certificates."""

    server: EmbeddedServer
    config: ServerConfig
    tokens: dict[str, str]
    certs: Certs | None = None
    stopped: bool = False

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.stop()

    @property
    def address(self) -> str:
        return self.server.address

    def tls(self, cert: str | None = None) -> ClientTls | None:
        if self.config.tls is None:
            return None
        assert self.certs is not None
        files = self.certs.clients[cert] if cert else None
        return ClientTls(
            root_ca=self.certs.ca.cert_path,
            client_cert=files.cert if files else None,
            client_key=files.key if files else None,
        )

    def client(self, who: str, *, cert: str | None = None, **kwargs: object) -> BlockClient:
        """A client with `who`'s token ('' for none) and, for mTLS, the named certificate."""
        token = self.tokens[who] if who else ""
        return BlockClient(self.address, token, tls=self.tls(cert), **kwargs)  # type: ignore[arg-type]

    @property
    def policy(self):  # type: ignore[no-untyped-def]
        assert self.server.server is not None
        return self.server.server.policy

    @property
    def store(self):  # type: ignore[no-untyped-def]
        assert self.server.server is not None
        return self.server.server.store


def serve(tenancy: Tenancy, certs: Certs | None = None, **replace: object) -> Served:
    """Start a server for `tenancy` (stop it with `.stop()`)."""
    config = load_config(tenancy.path)
    if replace:
        config = dataclasses.replace(config, **replace)  # type: ignore[arg-type]
    server = EmbeddedServer(config)
    server.start()
    return Served(server, config, tenancy.tokens, certs)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """Plain loopback server with the two tenants."""
    running = serve(isolation_config(tmp_path))
    try:
        yield running
    finally:
        running.stop()
