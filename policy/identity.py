"""Who is calling: principals and bearer-token authentication.

Tokens are never stored, only their SHA-256. A presented token is hashed once and
compared against every stored hash with `hmac.compare_digest`, without an early exit,
so the time taken says nothing about which (or whether a) principal matched.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum

from kvshare.errors import Unauthenticated
from policy.types import TenantId

BEARER_PREFIX = "bearer "
MAX_TOKEN_CHARS = 512


class Action(StrEnum):
    READ = "read"
    WRITE = "write"
    ADMIN = "admin"


@dataclass(frozen=True)
class Principal:
    name: str
    tenants: frozenset[TenantId]
    actions: frozenset[Action]


@dataclass(frozen=True)
class TokenCredential:
    """A principal's stored credential: the hex SHA-256 of its bearer token."""

    token_sha256: bytes
    principal: Principal


def hash_token(token: str) -> bytes:
    return hashlib.sha256(token.encode("utf-8")).digest()


class TokenAuthenticator:
    def __init__(self, credentials: Iterable[TokenCredential]) -> None:
        self._credentials = tuple(credentials)

    def authenticate(self, authorization: str | None) -> Principal:
        """The principal for an `authorization` metadata value, or Unauthenticated.

        Every failure raises the same error with the same message, so a caller learns
        nothing from which check failed.
        """
        token = _bearer_token(authorization)
        presented = hash_token(token) if token is not None else b"\x00" * 32
        match: Principal | None = None
        for credential in self._credentials:
            if hmac.compare_digest(presented, credential.token_sha256) and token is not None:
                match = credential.principal
        if match is None:
            raise Unauthenticated(
                "missing or invalid credential; send metadata 'authorization: Bearer <token>'"
            )
        return match


def _bearer_token(authorization: str | None) -> str | None:
    if authorization is None or len(authorization) > MAX_TOKEN_CHARS:
        return None
    if not authorization.lower().startswith(BEARER_PREFIX):
        return None
    token = authorization[len(BEARER_PREFIX) :].strip()
    return token or None
