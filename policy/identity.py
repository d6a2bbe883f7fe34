"""Who is calling: principals, bearer tokens and mTLS certificate identities.

Tokens are never stored, only their SHA-256. A presented token is hashed once and
compared against every stored hash with `hmac.compare_digest`, without an early exit,
so the time taken says nothing about which (or whether a) principal matched.

Certificate identities come from a client certificate the TLS layer has already
verified against the configured client CA (mTLS). They are written with their kind as
a prefix, so a DNS name can never be mistaken for a URI or a common name:

    uri:spiffe://example.org/replica-a   (a URI SAN; SPIFFE ids are the recommended form)
    dns:replica-a.example.org            (a DNS SAN)
    cn:replica-a                         (the subject common name)

Rule: a non-empty bearer token, when sent, decides alone (a wrong token is refused even
over a valid certificate); without one, the verified certificate decides.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import ssl
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum

from kvcommon.errors import Unauthenticated
from policy.types import TenantId

BEARER_PREFIX = "bearer "
MAX_TOKEN_CHARS = 512
TOKEN_BYTES = 32  # 256 bits of randomness per issued token
CERT_IDENTITY_RE = re.compile(r"(uri|dns|cn):\S.{0,1023}")
# gRPC auth-context property -> the prefix of the identities it yields.
_AUTH_CONTEXT_KINDS = (("peer_uri", "uri"), ("peer_dns", "dns"), ("x509_common_name", "cn"))
UNAUTHENTICATED_MESSAGE = (
    "missing or invalid credential; send metadata 'authorization: Bearer <token>' "
    "or connect with a client certificate the server's config maps to a principal"
)


class Action(StrEnum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"
    PUBLISH = "publish"  # write the public scope `@public` (needs no tenants)


@dataclass(frozen=True)
class Principal:
    name: str
    tenants: frozenset[TenantId]
    actions: frozenset[Action]
    requests_per_s: int | None = None  # None: the server's [limits] default; 0: unlimited
    # What the principal authenticates with (its token's SHA-256, or its certificate
    # identity): a live reload that keeps the name but changes this revokes whatever the
    # old credential opened (policy.access.AccessPolicy.current). Never logged.
    credential: bytes = field(default=b"", repr=False)


@dataclass(frozen=True)
class TokenCredential:
    """A principal's stored credential: the SHA-256 of its bearer token."""

    token_sha256: bytes
    principal: Principal


@dataclass(frozen=True)
class CertCredential:
    """A principal known by its client certificate, e.g. `uri:spiffe://org/replica-a`."""

    identity: str
    principal: Principal


@dataclass(frozen=True)
class Presented:
    """What a call presented: the kind of credential, never its value (for the audit log)."""

    kind: str  # "none", "token", "malformed" or "certificate"
    cert_identities: frozenset[str] = frozenset()


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


def new_token() -> str:
    """A fresh bearer token (URL-safe text, 256 random bits)."""
    return secrets.token_urlsafe(TOKEN_BYTES)


def certificate_identities(auth_context: Mapping[str, Sequence[bytes]]) -> frozenset[str]:
    """The prefixed identities of a verified peer certificate, from a gRPC auth context."""
    identities: set[str] = set()
    for prop, kind in _AUTH_CONTEXT_KINDS:
        for value in auth_context.get(prop, ()):
            text = value.decode("utf-8", "replace")
            if text:
                identities.add(f"{kind}:{text}")
    return frozenset(identities)


def certificate_fingerprint(der: bytes) -> bytes:
    """The SHA-256 of a verified peer certificate (DER), b"" for none: what binds a bulk
    ticket issued under mutual TLS to the certificate that asked for it."""
    return hashlib.sha256(der).digest() if der else b""


def pem_certificate_fingerprint(pem: bytes) -> bytes:
    """`certificate_fingerprint` of a PEM certificate (gRPC's `x509_pem_cert`)."""
    if not pem:
        return b""
    return certificate_fingerprint(ssl.PEM_cert_to_DER_cert(pem.decode("ascii")))


class Authenticator:
    def __init__(
        self,
        tokens: Iterable[TokenCredential],
        certificates: Iterable[CertCredential] = (),
    ) -> None:
        self._tokens = tuple(tokens)
        self._certificates = {c.identity: c.principal for c in certificates}

    def principals(self) -> list[Principal]:
        """Every principal it knows, token principals first."""
        return [c.principal for c in self._tokens] + list(self._certificates.values())

    def authenticate(
        self, authorization: str | None, cert_identities: Collection[str] = ()
    ) -> Principal:
        """The principal for a call, or Unauthenticated.

        Every failure raises the same error with the same message, so a caller learns
        nothing from which check failed. `cert_identities` must come from a certificate
        the TLS layer verified; pass nothing when mTLS is off.
        """
        present, token = _bearer_token(authorization)
        if present:
            return self._by_token(token)
        matches = {self._certificates[i] for i in cert_identities if i in self._certificates}
        if len(matches) != 1:  # none, or a certificate naming two principals: refuse
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return matches.pop()

    def _by_token(self, token: str | None) -> Principal:
        presented = hash_token(token) if token is not None else b"\x00" * 32
        match: Principal | None = None
        for credential in self._tokens:
            if hmac.compare_digest(presented, credential.token_sha256) and token is not None:
                match = credential.principal
        if match is None:
            raise Unauthenticated(UNAUTHENTICATED_MESSAGE)
        return match


def describe(authorization: str | None, cert_identities: Collection[str]) -> Presented:
    """The kind of credential a call presented, for the audit log (never the token)."""
    present, token = _bearer_token(authorization)
    if present:
        return Presented("token" if token is not None else "malformed")
    if cert_identities:
        return Presented("certificate", frozenset(cert_identities))
    return Presented("none")


def _bearer_token(authorization: str | None) -> tuple[bool, str | None]:
    """(whether a token was presented, the token if well-formed).

    No header, or an empty `Bearer ` (a client with only a certificate), is no token.
    """
    if authorization is None:
        return False, None
    if len(authorization) > MAX_TOKEN_CHARS:
        return True, None
    if not authorization.lower().startswith(BEARER_PREFIX.strip()):
        return True, None
    rest = authorization[len(BEARER_PREFIX.strip()) :]
    if rest.strip() == "":
        return False, None
    if not rest.startswith(" "):
        return True, None
    return True, rest.strip() or None
