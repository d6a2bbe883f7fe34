"""Parse the access part of the server config: `[[tenants]]` and `[[principals]]`.

Deny by default: a principal may act only for the tenants and actions it lists, and it
may list only tenants that are defined. Unknown keys are errors, so a misspelt
`acions` never silently grants or removes anything.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvshare.errors import ConfigError
from policy.identity import Action, Principal, TokenCredential
from policy.types import TenantId, is_valid_tenant_id

TENANT_KEYS = frozenset({"id", "quota_bytes", "epoch"})
PRINCIPAL_KEYS = frozenset({"name", "token_sha256", "tenants", "actions"})
_HEX64 = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class TenantConfig:
    id: TenantId
    quota_bytes: int = 0  # 0: bounded only by the global budget
    epoch: int = 0  # bump to make every block of the tenant unreachable (off-boarding)


@dataclass(frozen=True)
class AccessConfig:
    tenants: tuple[TenantConfig, ...]
    credentials: tuple[TokenCredential, ...]


def line_of(text: str, key: str, occurrence: int = 0) -> int:
    """1-based line of the `occurrence`-th `key = ...` in a TOML text (0 if not found)."""
    pattern = re.compile(rf"^\s*{re.escape(key)}\s*=", re.MULTILINE)
    matches = list(pattern.finditer(text))
    if occurrence < len(matches):
        return text.count("\n", 0, matches[occurrence].start()) + 1
    return 0


class _Errors:
    """Builds ConfigErrors that name the file, the line and the key."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.text = text

    def error(self, key: str, message: str, occurrence: int = 0) -> ConfigError:
        line = line_of(self.text, key.rsplit(".", 1)[-1], occurrence)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {key}: {message}")


def _check_keys(raw: Mapping[str, Any], allowed: frozenset[str], table: str, err: _Errors) -> None:
    for key in raw:
        if key not in allowed:
            raise err.error(f"{table}.{key}", f"unknown key; allowed: {', '.join(sorted(allowed))}")


def _parse_tenant(raw: Mapping[str, Any], index: int, err: _Errors) -> TenantConfig:
    _check_keys(raw, TENANT_KEYS, f"tenants[{index}]", err)
    tenant_id = raw.get("id")
    if not isinstance(tenant_id, str) or not is_valid_tenant_id(tenant_id):
        raise err.error(f"tenants[{index}].id", "must match [a-z0-9][a-z0-9._-]{0,62}", index)
    quota = raw.get("quota_bytes", 0)
    if not isinstance(quota, int) or isinstance(quota, bool) or quota < 0:
        raise err.error(f"tenants[{index}].quota_bytes", "must be an integer >= 0", index)
    epoch = raw.get("epoch", 0)
    if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
        raise err.error(f"tenants[{index}].epoch", "must be an integer >= 0")
    return TenantConfig(TenantId(tenant_id), quota, epoch)


def _parse_str_list(raw: Any, key: str, err: _Errors, index: int) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise err.error(key, "must be a list of strings", index)
    return list(raw)


def _parse_principal(
    raw: Mapping[str, Any], index: int, tenant_ids: frozenset[TenantId], err: _Errors
) -> TokenCredential:
    table = f"principals[{index}]"
    _check_keys(raw, PRINCIPAL_KEYS, table, err)
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise err.error(f"{table}.name", "must be a non-empty string", index)
    token_hex = raw.get("token_sha256")
    if not isinstance(token_hex, str) or not _HEX64.fullmatch(token_hex):
        raise err.error(
            f"{table}.token_sha256", "must be 64 lowercase hex chars (sha256 of the token)", index
        )
    tenants = _parse_str_list(raw.get("tenants", []), f"{table}.tenants", err, index)
    for tenant in tenants:
        if tenant not in tenant_ids:
            raise err.error(
                f"{table}.tenants",
                f"names tenant {tenant!r}, which is not defined in [[tenants]]",
                index,
            )
    actions = _parse_str_list(raw.get("actions", []), f"{table}.actions", err, index)
    allowed = {a.value for a in Action}
    for action in actions:
        if action not in allowed:
            raise err.error(
                f"{table}.actions", f"unknown action {action!r}; use {sorted(allowed)}", index
            )
    principal = Principal(
        name=name,
        tenants=frozenset(TenantId(t) for t in tenants),
        actions=frozenset(Action(a) for a in actions),
    )
    return TokenCredential(bytes.fromhex(token_hex), principal)


def parse_access(
    tenants_raw: Sequence[Mapping[str, Any]],
    principals_raw: Sequence[Mapping[str, Any]],
    *,
    source: str,
    text: str,
) -> AccessConfig:
    err = _Errors(source, text)
    tenants = tuple(_parse_tenant(raw, i, err) for i, raw in enumerate(tenants_raw))
    seen: set[str] = set()
    for i, tenant in enumerate(tenants):
        if tenant.id in seen:
            raise err.error(f"tenants[{i}].id", f"tenant {tenant.id!r} is defined twice", i)
        seen.add(tenant.id)
    tenant_ids = frozenset(t.id for t in tenants)
    credentials = tuple(
        _parse_principal(raw, i, tenant_ids, err) for i, raw in enumerate(principals_raw)
    )
    names = [c.principal.name for c in credentials]
    if len(set(names)) != len(names):
        raise err.error("principals.name", "principal names must be unique")
    return AccessConfig(tenants, credentials)
