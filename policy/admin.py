"""Admin operations that make credentials: tokens and the config stanzas that hold them.

A bearer token is generated here, shown to the operator once, and only its SHA-256
goes into the `[[principals]]` stanza; the server never stores the token. Every
stanza printed here parses back with `policy.config` (tests check the round trip).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from kvcommon.errors import ConfigError
from policy.identity import CERT_IDENTITY_RE, Action, hash_token, new_token
from policy.types import is_valid_tenant_id


@dataclass(frozen=True)
class IssuedToken:
    token: str  # show once, then forget
    stanza: str  # holds only the token's SHA-256


def _quoted(values: Sequence[str]) -> str:
    return "[" + ", ".join(json.dumps(v) for v in values) + "]"


def check_tenant_ids(tenants: Sequence[str]) -> None:
    for tenant in tenants:
        if not is_valid_tenant_id(tenant):
            raise ConfigError(f"tenant {tenant!r} must match [a-z0-9][a-z0-9._-]{{0,62}}")


def parse_actions(text: str) -> list[str]:
    actions = [a.strip() for a in text.split(",") if a.strip()]
    allowed = {a.value for a in Action}
    for action in actions:
        if action not in allowed:
            raise ConfigError(f"unknown action {action!r}; use a comma list of {sorted(allowed)}")
    if not actions:
        raise ConfigError(f"give at least one action of {sorted(allowed)}")
    return actions


def tenant_stanza(tenant: str, quota_bytes: int = 0, *, read_public: bool = False) -> str:
    check_tenant_ids([tenant])
    if quota_bytes < 0:
        raise ConfigError("quota bytes must be >= 0 (0: bounded only by the global budget)")
    lines = ["[[tenants]]", f"id = {json.dumps(tenant)}", f"quota_bytes = {quota_bytes}"]
    if read_public:
        lines.append("read_public = true")
    return "\n".join(lines) + "\n"


def public_stanza(quota_bytes: int, epoch: int = 0) -> str:
    """The `[public]` table: the public scope and its own quota."""
    if quota_bytes < 1:
        raise ConfigError(
            "the public scope needs a quota of at least 1 byte; it is charged to nobody else"
        )
    if epoch < 0:
        raise ConfigError("epoch must be >= 0")
    return f"[public]\nquota_bytes = {quota_bytes}\nepoch = {epoch}\n"


def principal_stanza(
    name: str,
    tenants: Sequence[str],
    actions: Sequence[str],
    *,
    token_sha256_hex: str | None = None,
    cert_identity: str | None = None,
) -> str:
    if not name:
        raise ConfigError("principal name is empty; give --name")
    check_tenant_ids(tenants)
    if not tenants and Action.PUBLISH.value not in actions:
        raise ConfigError(
            "give at least one --tenant (only a principal with the publish action needs none)"
        )
    lines = ["[[principals]]", f"name = {json.dumps(name)}"]
    if token_sha256_hex is not None:
        lines.append(f'token_sha256 = "{token_sha256_hex}"')
    elif cert_identity is not None:
        if not CERT_IDENTITY_RE.fullmatch(cert_identity):
            raise ConfigError("cert identity must be 'uri:...', 'dns:...' or 'cn:...'")
        lines.append(f"cert_identity = {json.dumps(cert_identity)}")
    lines += [f"tenants = {_quoted(tenants)}", f"actions = {_quoted(actions)}"]
    return "\n".join(lines) + "\n"


def issue_token(name: str, tenants: Sequence[str], actions: Sequence[str]) -> IssuedToken:
    token = new_token()
    stanza = principal_stanza(name, tenants, actions, token_sha256_hex=hash_token(token).hex())
    return IssuedToken(token, stanza)
