"""The isolation suite's configs: tenants `alpha` and `beta`, token principals, and TLS
or mTLS with certificate principals `cert-a` and `cert-b` known by their URI SANs."""

from __future__ import annotations

from pathlib import Path

from tests.support.certs import SPIFFE, Certs
from tests.support.servers import Running, Tenancy, launch, write_config

MODEL = "iso/model@r1;fp32;L2;H2;D8;B4;tp0/1"


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


# One fixture family: the isolation suite's servers are tests/conftest.py's.
Served = Running


serve = launch
