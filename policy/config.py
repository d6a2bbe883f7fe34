"""Parse the access part of the server config: `[[tenants]]` and `[[principals]]`.

Deny by default: a principal may act only for the tenants and actions it lists, and it
may list only tenants that are defined. Unknown keys are errors, so a misspelt
`acions` never silently grants or removes anything.

    [[tenants]]                     [[principals]]
    id = "acme"                     name = "replica-a"
    quota_bytes = 1073741824        token_sha256 = "<hex>"    # or cert_identity = "uri:..."
    epoch = 0                       tenants = ["acme"]
    read_public = true              actions = ["read", "write"]
                                    requests_per_s = 500      # optional; 0: unlimited
    [public]
    quota_bytes = 268435456         # the public scope `@public`; absent: no public scope
    epoch = 0

The public scope holds prefixes published for every tenant (policy.access): written
only by principals with the `publish` action (which need no tenants), read by
principals of tenants with `read_public = true`, charged to `[public] quota_bytes`.

Every config table uses the spec types of `policy.config_text` (`int_in`, `Flag`,
`Text`, `PathText`, `Address`, `Choice`: a key's type and range, stated once) and
`ConfigText`, whose errors name the file, the key's real line (`key_line`), the key and
what is allowed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policy.config_text import (
    MAX_BUDGET_BYTES,
    ConfigText,
    Flag,
    IntIn,
    Refused,
    Spec,
    int_in,
)
from policy.identity import (
    CERT_IDENTITY_RE,
    Action,
    CertCredential,
    Principal,
    TokenCredential,
)
from policy.types import PUBLIC, TenantId, is_valid_tenant_id

TENANT_KEYS = frozenset({"id", "quota_bytes", "epoch", "read_public", "require_sealed"})
# Keys of an earlier shared-namespace design, replaced by the public scope: named in the
# error so that an old config says what to write instead.
RETIRED_TENANT_KEYS = frozenset({"shared", "read_shared"})
PRINCIPAL_KEYS = frozenset(
    {"name", "token_sha256", "cert_identity", "tenants", "actions", "requests_per_s"}
)
_HEX64 = re.compile(r"[0-9a-f]{64}")
# The epoch is stored in 32 bits in every block's metadata (LMDB, journal, cluster).
EPOCH_MAX = (1 << 32) - 1
# A server answers some thousands of calls per second; a million is beyond any of it.
MAX_REQUESTS_PER_S = 1_000_000


@dataclass(frozen=True)
class TenantConfig:
    id: TenantId
    quota_bytes: int = 0  # 0: bounded only by the global budget
    epoch: int = 0  # bump to make every block of the tenant unreachable (off-boarding)
    read_public: bool = False  # this tenant's principals may read the public scope
    # Refuse puts whose payload is not a sealed block (an agent without its keyring would
    # otherwise store plaintext KV, which the server cannot tell from ciphertext later).
    require_sealed: bool = False


@dataclass(frozen=True)
class PublicConfig:
    """`[public]`: the public scope `@public` (policy.types.PUBLIC)."""

    quota_bytes: int  # the scope's own budget: it is evicted by nothing else
    epoch: int = 0  # bump to retire every published block at once
    require_sealed: bool = False


@dataclass(frozen=True)
class AccessConfig:
    tenants: tuple[TenantConfig, ...]
    credentials: tuple[TokenCredential, ...]
    cert_credentials: tuple[CertCredential, ...] = ()
    public: PublicConfig | None = None  # None: no public scope; `@public` is refused

    def quotas_bytes(self) -> dict[TenantId, int]:
        """Each namespace's quota, the public scope's among them."""
        quotas = {t.id: t.quota_bytes for t in self.tenants}
        if self.public is not None:
            quotas[PUBLIC] = self.public.quota_bytes
        return quotas

    def epochs(self) -> dict[TenantId, int]:
        """Each namespace's epoch, the public scope's among them."""
        epochs = {t.id: t.epoch for t in self.tenants}
        if self.public is not None:
            epochs[PUBLIC] = self.public.epoch
        return epochs

    def principals(self) -> list[Principal]:
        return [c.principal for c in self.credentials] + [
            c.principal for c in self.cert_credentials
        ]


TENANT_NUMBERS = {
    "quota_bytes": int_in(1, MAX_BUDGET_BYTES, "bytes", zero="bounded only by the global budget"),
    "epoch": int_in(0, EPOCH_MAX),
}
REQUESTS_PER_S = int_in(1, MAX_REQUESTS_PER_S, zero="unlimited")
PUBLIC_SPECS: dict[str, Spec] = {
    "quota_bytes": int_in(1, MAX_BUDGET_BYTES, "bytes"),
    "epoch": TENANT_NUMBERS["epoch"],
    "require_sealed": Flag(),
}


def _check_keys(
    raw: Mapping[str, Any], allowed: frozenset[str], table: str, err: ConfigText
) -> None:
    for key in raw:
        if key not in allowed:
            raise err.error(f"{table}.{key}", f"unknown key; allowed: {', '.join(sorted(allowed))}")


def _number(raw: Mapping[str, Any], key: str, table: str, err: ConfigText, spec: IntIn) -> int:
    try:
        return spec.check(raw.get(key, 0))
    except Refused as refused:
        raise err.error(f"{table}.{key}", str(refused)) from None


def _flag(raw: Mapping[str, Any], key: str, table: str, err: ConfigText) -> bool:
    try:
        return Flag().check(raw.get(key, False))
    except Refused as refused:
        raise err.error(f"{table}.{key}", str(refused)) from None


def _parse_str_list(raw: Any, key: str, err: ConfigText) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise err.error(key, "must be a list of strings")
    return list(raw)


def _parse_tenant(raw: Mapping[str, Any], index: int, err: ConfigText) -> TenantConfig:
    table = f"tenants[{index}]"
    for key in RETIRED_TENANT_KEYS & raw.keys():
        raise err.error(
            f"{table}.{key}",
            "shared tenants are replaced by the public scope: publish into `@public` "
            "(a [public] table with quota_bytes) and give its readers' tenants "
            "read_public = true",
        )
    _check_keys(raw, TENANT_KEYS, table, err)
    tenant_id = raw.get("id")
    if not isinstance(tenant_id, str) or not is_valid_tenant_id(tenant_id):
        raise err.error(
            f"{table}.id",
            f"must match [a-z0-9][a-z0-9._-]{{0,62}} ({PUBLIC!r} is the public scope, [public])",
        )
    return TenantConfig(
        TenantId(tenant_id),
        quota_bytes=_number(raw, "quota_bytes", table, err, TENANT_NUMBERS["quota_bytes"]),
        epoch=_number(raw, "epoch", table, err, TENANT_NUMBERS["epoch"]),
        read_public=_flag(raw, "read_public", table, err),
        require_sealed=_flag(raw, "require_sealed", table, err),
    )


def _parse_public(
    raw: Any, tenants: Sequence[TenantConfig], err: ConfigText
) -> PublicConfig | None:
    """`[public]`, or None when absent (then no tenant may say `read_public`)."""
    if raw is None:
        for i, tenant in enumerate(tenants):
            if tenant.read_public:
                raise err.error(
                    f"tenants[{i}].read_public",
                    "there is no public scope to read; add a [public] table with quota_bytes",
                )
        return None
    if not isinstance(raw, Mapping):
        raise err.error(("public",), "must be a table: write [public] and its keys")
    values = err.check_table(raw, PUBLIC_SPECS, ("public",))
    if "quota_bytes" not in values:
        raise err.error(
            ("public",),
            "needs quota_bytes: the public scope is charged to it, never to a tenant",
        )
    return PublicConfig(**values)


def _check_tenants(tenants: Sequence[TenantConfig], err: ConfigText) -> None:
    """Unique ids."""
    seen: set[str] = set()
    for i, tenant in enumerate(tenants):
        if tenant.id in seen:
            raise err.error(f"tenants[{i}].id", f"tenant {tenant.id!r} is defined twice")
        seen.add(tenant.id)


def _parse_credential(
    raw: Mapping[str, Any], table: str, err: ConfigText
) -> tuple[bytes | None, str | None]:
    """(token sha256, cert identity): exactly one of them is set."""
    token_hex = raw.get("token_sha256")
    identity = raw.get("cert_identity")
    if (token_hex is None) == (identity is None):
        raise err.error(
            f"{table}.token_sha256",
            "give exactly one of token_sha256 (bearer token) or cert_identity (mTLS); "
            "`kvshare admin token` prints a stanza",
        )
    if token_hex is not None:
        if not isinstance(token_hex, str) or not _HEX64.fullmatch(token_hex):
            raise err.error(
                f"{table}.token_sha256", "must be 64 lowercase hex chars (sha256 of the token)"
            )
        return bytes.fromhex(token_hex), None
    if not isinstance(identity, str) or not CERT_IDENTITY_RE.fullmatch(identity):
        raise err.error(
            f"{table}.cert_identity",
            "must be 'uri:<URI SAN>', 'dns:<DNS SAN>' or 'cn:<subject common name>'",
        )
    return None, identity


def _parse_grants(
    raw: Mapping[str, Any], table: str, tenant_ids: frozenset[TenantId], err: ConfigText
) -> tuple[frozenset[TenantId], frozenset[Action]]:
    tenants = _parse_str_list(raw.get("tenants", []), f"{table}.tenants", err)
    for tenant in tenants:
        if tenant not in tenant_ids:
            raise err.error(
                f"{table}.tenants", f"names tenant {tenant!r}, which is not defined in [[tenants]]"
            )
    actions = _parse_str_list(raw.get("actions", []), f"{table}.actions", err)
    allowed = {a.value for a in Action}
    for action in actions:
        if action not in allowed:
            raise err.error(f"{table}.actions", f"unknown action {action!r}; use {sorted(allowed)}")
    return frozenset(TenantId(t) for t in tenants), frozenset(Action(a) for a in actions)


def _parse_principal(
    raw: Mapping[str, Any], index: int, tenant_ids: frozenset[TenantId], err: ConfigText
) -> TokenCredential | CertCredential:
    table = f"principals[{index}]"
    _check_keys(raw, PRINCIPAL_KEYS, table, err)
    name = raw.get("name")
    # The name is written to logs and the audit log: one printable line.
    if not isinstance(name, str) or not name or len(name) > 256 or not name.isprintable():
        raise err.error(
            f"{table}.name", "must be a non-empty string of 1 to 256 printable characters"
        )
    token_sha256, identity = _parse_credential(raw, table, err)
    tenants, actions = _parse_grants(raw, table, tenant_ids, err)
    rate = (
        _number(raw, "requests_per_s", table, err, REQUESTS_PER_S)
        if "requests_per_s" in raw
        else None
    )
    credential = token_sha256 if token_sha256 is not None else f"{identity}".encode()
    principal = Principal(name, tenants, actions, requests_per_s=rate, credential=credential)
    if token_sha256 is not None:
        return TokenCredential(token_sha256, principal)
    assert identity is not None
    return CertCredential(identity, principal)


def parse_access(
    tenants_raw: Sequence[Mapping[str, Any]],
    principals_raw: Sequence[Mapping[str, Any]],
    *,
    source: str,
    text: str,
    public_raw: Any = None,
) -> AccessConfig:
    err = ConfigText(source, text)
    for array, entries in (("tenants", tenants_raw), ("principals", principals_raw)):
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                raise err.error((array, i), f"must be a table: write [[{array}]] and its keys")
    tenants = tuple(_parse_tenant(raw, i, err) for i, raw in enumerate(tenants_raw))
    _check_tenants(tenants, err)
    public = _parse_public(public_raw, tenants, err)
    tenant_ids = frozenset(t.id for t in tenants)
    parsed = [_parse_principal(raw, i, tenant_ids, err) for i, raw in enumerate(principals_raw)]
    seen_names: set[str] = set()
    seen_identities: set[str] = set()
    seen_tokens: set[bytes] = set()
    for i, credential in enumerate(parsed):
        if credential.principal.name in seen_names:
            raise err.error(f"principals[{i}].name", "principal names must be unique")
        seen_names.add(credential.principal.name)
        if isinstance(credential, TokenCredential):
            # One token, one principal: otherwise the last entry would silently win.
            if credential.token_sha256 in seen_tokens:
                raise err.error(
                    f"principals[{i}].token_sha256",
                    "two principals have this token; give each principal its own token",
                )
            seen_tokens.add(credential.token_sha256)
        if isinstance(credential, CertCredential):
            if credential.identity in seen_identities:
                raise err.error(
                    f"principals[{i}].cert_identity", "two principals have this cert_identity"
                )
            seen_identities.add(credential.identity)
    return AccessConfig(
        tenants,
        tuple(c for c in parsed if isinstance(c, TokenCredential)),
        tuple(c for c in parsed if isinstance(c, CertCredential)),
        public,
    )
