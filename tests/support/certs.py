"""Test certificates made on the fly with `cryptography`: a CA, a server, clients.

Nothing here is committed as a file: every key is generated into a test's temporary
directory. EC P-256 keys keep generation fast (milliseconds, not RSA's seconds).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(
    directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> CertFiles:
    cert_path = directory / f"{stem}.crt"
    key_path = directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    key_path.chmod(0o600)
    return CertFiles(cert_path, key_path)


class TestCA:
    """A throwaway certificate authority that issues server and client certificates."""

    __test__ = False  # not a pytest class

    def __init__(self, directory: Path, name: str = "kvshare test CA") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name(name)
        now = datetime.datetime.now(datetime.UTC)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name)
            .issuer_name(self._name)
            .public_key(self._key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = directory / f"{name.replace(' ', '-')}.crt"
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def _issue(
        self,
        stem: str,
        common_name: str,
        sans: list[x509.GeneralName],
        usage: x509.ObjectIdentifier,
    ) -> CertFiles:
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.UTC)
        builder = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self._name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return _write(self.directory, stem, builder.sign(self._key, hashes.SHA256()), key)

    def server_cert(self, stem: str = "server", *, ips: tuple[str, ...] = ()) -> CertFiles:
        """For 127.0.0.1, ::1 and localhost, and `ips` (a server on another host)."""
        sans: list[x509.GeneralName] = [
            x509.DNSName("localhost"),
            *(x509.IPAddress(ipaddress.ip_address(ip)) for ip in ("127.0.0.1", "::1", *ips)),
        ]
        return self._issue(stem, "localhost", sans, ExtendedKeyUsageOID.SERVER_AUTH)

    def client_cert(
        self, stem: str, *, common_name: str, uri: str | None = None, dns: str | None = None
    ) -> CertFiles:
        sans: list[x509.GeneralName] = []
        if uri:
            sans.append(x509.UniformResourceIdentifier(uri))
        if dns:
            sans.append(x509.DNSName(dns))
        return self._issue(stem, common_name, sans, ExtendedKeyUsageOID.CLIENT_AUTH)


SPIFFE = "spiffe://kvshare.test"


@dataclass(frozen=True)
class Certs:
    ca: TestCA
    server: CertFiles
    clients: dict[str, CertFiles]  # cert-a, cert-b, stranger (valid, mapped to nobody)
    other_ca_client: CertFiles  # signed by a CA the server does not trust


def make_certs(directory: Path) -> Certs:
    """A CA and its server certificate; client certificates `cert-a`, `cert-b` and
    `stranger` known by their URI SANs; `cert-a` again, signed by a CA not trusted."""
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
