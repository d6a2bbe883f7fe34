"""Parse the access part of the server config: `[[tenants]]` and `[[principals]]`.

Deny by default: a principal may act only for the tenants and actions it lists, and it
may list only tenants that are defined. Unknown keys are errors, so a misspelt
`acions` never silently grants or removes anything.

    [[tenants]]                     [[principals]]
    id = "acme"                     name = "replica-a"
    quota_bytes = 1073741824        token_sha256 = "<hex>"    # or cert_identity = "uri:..."
    epoch = 0                       tenants = ["acme"]
    shared = false                  actions = ["read", "write"]
    read_shared = ["public"]        requests_per_s = 500      # optional; 0: unlimited

A `shared = true` tenant is a read-only namespace for public prefixes: principals
write to it only with the `publish` action, and principals of every tenant that
lists it in `read_shared` may read it (see `policy.access`).

Every config table uses this module's spec types (`int_in`, `Flag`, `Text`, `PathText`,
`Address`, `Choice`: a key's type and range, stated once) and `ConfigText`, whose
errors name the file, the key's real line (`key_line`), the key and what is allowed.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvcommon.errors import ConfigError
from kvcommon.hostport import parse_host_port
from policy.identity import (
    CERT_IDENTITY_RE,
    Action,
    CertCredential,
    Principal,
    TokenCredential,
)
from policy.types import TenantId, is_valid_tenant_id

TENANT_KEYS = frozenset({"id", "quota_bytes", "epoch", "shared", "read_shared", "require_sealed"})
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
    shared: bool = False  # a read-only namespace for public prefixes (writes need `publish`)
    read_shared: tuple[TenantId, ...] = ()  # shared namespaces this tenant's principals read
    # Refuse puts whose payload is not a sealed block (an agent without its keyring would
    # otherwise store plaintext KV, which the server cannot tell from ciphertext later).
    require_sealed: bool = False


@dataclass(frozen=True)
class AccessConfig:
    tenants: tuple[TenantConfig, ...]
    credentials: tuple[TokenCredential, ...]
    cert_credentials: tuple[CertCredential, ...] = ()

    def principals(self) -> list[Principal]:
        return [c.principal for c in self.credentials] + [
            c.principal for c in self.cert_credentials
        ]


# -- where a key is: its real line, found by scanning the text --------------------------

_HEADER_LINE = re.compile(r"^\s*(\[\[?)\s*([^\[\]]+?)\s*\]\]?\s*(?:#.*)?$")
_KEY_PART = r"(?:[A-Za-z0-9_-]+|\"(?:[^\"\\]|\\.)*\"|'[^']*')"
_KEY_LINE = re.compile(rf"^\s*({_KEY_PART}(?:\s*\.\s*{_KEY_PART})*)\s*=")
_PARTS = re.compile(_KEY_PART)

KeyPath = tuple[str | int, ...]


def _dotted(text: str) -> list[str]:
    parts = []
    for part in _PARTS.findall(text):
        if part.startswith('"'):  # a basic string: its escapes as TOML reads them
            try:
                part = tomllib.loads(f"k = {part}")["k"]
            except tomllib.TOMLDecodeError:
                part = part[1:-1]
        elif part.startswith("'"):  # a literal string: no escapes
            part = part[1:-1]
        parts.append(part)
    return parts


def key_line(text: str, path: KeyPath) -> int:
    """1-based line where `path` (e.g. ("tenants", 0, "quota_bytes"), ("storage",),
    ("telemetri",)) is set: a `key = ...` line, a dotted key, or a `[table]` or
    `[[array]]` header, with array tables counted. The nearest enclosing table's line
    when the key itself is not written out; 0 only when nothing of it is.

    tomllib gives no positions, so the text is scanned line by line (multi-line strings
    skipped): an error must point at the line to fix, never at line 0."""
    entries: list[tuple[KeyPath, int]] = []
    arrays: dict[KeyPath, int] = {}  # array-table path -> index of its latest element
    current: KeyPath = ()
    in_string = ""
    # TOML breaks lines at \n only (splitlines would also break at \x0c, \u2028, ...).
    for number, line in enumerate(text.split("\n"), start=1):
        if in_string:
            if line.count(in_string) % 2:
                in_string = ""
            continue
        header = _HEADER_LINE.match(line)
        key = None if header else _KEY_LINE.match(line)
        if header:
            current = _resolve(_dotted(header[2])[:-1], arrays) + tuple(_dotted(header[2])[-1:])
            if header[1] == "[[":
                arrays[current] = arrays.get(current, -1) + 1
                current = (*current, arrays[current])
            entries.append((current, number))
        elif key:
            entries.append(((*current, *_dotted(key[1])), number))
        for quote in ('"""', "'''"):
            if line.count(quote) % 2:
                in_string = quote
    for length in range(len(path), 0, -1):
        wanted = path[:length]
        for entry, number in entries:
            if entry[:length] == wanted:
                return number
    return 0


def _resolve(parts: list[str], arrays: dict[KeyPath, int]) -> KeyPath:
    """A header's parent path with the latest index of each array table in it."""
    resolved: KeyPath = ()
    for part in parts:
        resolved = (*resolved, part)
        if resolved in arrays:
            resolved = (*resolved, arrays[resolved])
    return resolved


def key_name(path: KeyPath) -> str:
    """("tenants", 0, "id") -> "tenants[0].id"; a key with odd characters is quoted, so
    an error message stays one line."""
    name = ""
    for part in path:
        if isinstance(part, int):
            name += f"[{part}]"
        else:
            shown = part if re.fullmatch(r"[A-Za-z0-9_-]+", part) else repr(part)
            name += f".{shown}" if name else shown
    return name


# -- what each key may hold: one declarative spec per key -------------------------------

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PiB = 1 << 50
SECOND_MS = 1000
DAY_MS = 86_400 * SECOND_MS
PATH_MAX = 4096  # Linux's longest path
# A byte budget or quota: the disk budget's derived LMDB map (1.5 times it) must fit in
# a 64-bit process's 128 TiB of address space.
MAX_BUDGET_BYTES = 64 * TiB


class Refused(ValueError):
    """A value outside its spec; the message says what is allowed."""


def shown(value: Any) -> str:
    """A value as an error message shows it: one line, at most 40 characters."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _amount(value: int, unit: str) -> str:
    if unit == "bytes":
        for size, name in ((PiB, "PiB"), (TiB, "TiB"), (GiB, "GiB"), (MiB, "MiB"), (KiB, "KiB")):
            if value >= size and value % size == 0:
                return f"{value} ({value // size} {name})"
            if value >= size and (value + 1) % size == 0:
                return f"{value} ({(value + 1) // size} {name} - 1)"
        return str(value)
    if unit == "ms":
        for size, name in ((DAY_MS, "day"), (3600 * SECOND_MS, "hour"), (SECOND_MS, "s")):
            if value >= size and value % size == 0:
                count = value // size
                return f"{value} ({count} {name}{'s' if count > 1 and name != 's' else ''})"
    return str(value)


@dataclass(frozen=True)
class IntIn:
    """An integer from `lo` to `hi`; with `zero` set, 0 is allowed too and means that."""

    lo: int
    hi: int
    unit: str = ""  # "bytes", "ms" or "": how the bounds are shown
    zero: str = ""

    def allowed(self) -> str:
        text = f"an integer from {_amount(self.lo, self.unit)} to {_amount(self.hi, self.unit)}"
        return text + (f", or 0 ({self.zero})" if self.zero else "")

    def check(self, value: Any) -> int:
        if type(value) is not int:  # bool is an int subclass; 1.0 and "1" are not ints
            raise Refused(f"must be int, not {shown(value)}; use {self.allowed()}")
        if value == 0 and self.zero:
            return value
        if not self.lo <= value <= self.hi:
            raise Refused(f"{value} is out of range; use {self.allowed()}")
        return value


def int_in(lo: int, hi: int, unit: str = "", *, zero: str = "") -> IntIn:
    return IntIn(lo, hi, unit, zero)


@dataclass(frozen=True)
class Flag:
    def allowed(self) -> str:
        return "true or false"

    def check(self, value: Any) -> bool:
        if not isinstance(value, bool):
            raise Refused(f"must be bool (true or false), not {shown(value)}")
        return value


@dataclass(frozen=True)
class Text:
    """A string of `lo` to `hi` characters, none of them a control character (a key
    prefix, a user name, a URL: each ends up in logs, headers or file names)."""

    lo: int = 0
    hi: int = 256

    def allowed(self) -> str:
        return f"a string of {self.lo} to {self.hi} printable characters"

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise Refused(f"must be str, not {shown(value)}")
        if not self.lo <= len(value) <= self.hi or not value.isprintable():
            raise Refused(f"{shown(value)}: use {self.allowed()}")
        return value


@dataclass(frozen=True)
class PathText:
    """A file or directory path; "" (the default) only where `empty` says what it means."""

    empty: str = ""

    def allowed(self) -> str:
        text = f"a path of 1 to {PATH_MAX} bytes without NUL"
        return text + (f', or "" ({self.empty})' if self.empty else "")

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise Refused(f"must be a path (a string), not {shown(value)}")
        if not value and self.empty:
            return value
        if not value or "\0" in value or len(value.encode("utf-8", "replace")) > PATH_MAX:
            raise Refused(f"{shown(value)} is not a usable path; give {self.allowed()}")
        return value


@dataclass(frozen=True)
class Address:
    """HOST:PORT with the port from `lowest` to 65535 (a listener may take 0: any free
    port; an address others dial may not); "" where `empty` says what it means."""

    what: str  # the key, as parse_host_port's messages name it
    lowest: int = 0
    empty: str = ""

    def allowed(self) -> str:
        text = f"HOST:PORT with a port from {self.lowest} to 65535"
        return text + (f', or "" ({self.empty})' if self.empty else "")

    def check(self, value: Any) -> str:
        if not isinstance(value, str):
            raise Refused(f"must be str, not {shown(value)}; give {self.allowed()}")
        if not value and self.empty:
            return value
        try:
            address = parse_host_port(value, what=self.what)
        except ValueError as error:
            raise Refused(f"{_one_line(str(error))}; give {self.allowed()}") from None
        if address.port < self.lowest:
            raise Refused(
                f"{self.what} {shown(value)}: port {address.port} is not a port clients can "
                f"reach; give the port replicas connect to ({self.allowed()})"
            )
        return value


@dataclass(frozen=True)
class Choice:
    """One of a few words (`what` names the key, as the flag and the file both say it)."""

    what: str
    words: tuple[str, ...]

    def allowed(self) -> str:
        return " or ".join(self.words)

    def check(self, value: Any) -> str:
        if value not in self.words or not isinstance(value, str):
            raise Refused(f"{self.what} {shown(value)}; use {self.allowed()}")
        return value


class Spec(Protocol):
    """What one key may hold: `check` returns the value or raises Refused."""

    def allowed(self) -> str: ...

    def check(self, value: Any) -> Any: ...


class ConfigText:
    """One config file: builds ConfigErrors that name the file, the line and the key,
    and checks tables against their specs."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.text = text

    def error(self, path: KeyPath | str, message: str) -> ConfigError:
        """`path` is a key path, or a name as errors show it (`tenants[0].id`)."""
        if isinstance(path, str):
            path = tuple(
                int(part[1:-1]) if part.startswith("[") else part
                for part in re.findall(r"\[\d+\]|[^.\[\]]+", path)
            )
        line = key_line(self.text, path)
        where = f"{self.source}:{line}" if line else self.source
        return ConfigError(f"{where}: {key_name(path)}: {message}")

    def check_table(
        self, raw: Mapping[str, Any], specs: Mapping[str, Spec], table: KeyPath
    ) -> dict[str, Any]:
        """Every key of `raw` known to `specs` and within its spec; the checked values."""
        values: dict[str, Any] = {}
        for key, value in raw.items():
            spec = specs.get(key)
            if spec is None:
                raise self.error((*table, key), f"unknown key; allowed: {', '.join(sorted(specs))}")
            try:
                values[key] = spec.check(value)
            except Refused as refused:
                raise self.error((*table, key), str(refused)) from None
        return values


TENANT_NUMBERS = {
    "quota_bytes": int_in(1, MAX_BUDGET_BYTES, "bytes", zero="bounded only by the global budget"),
    "epoch": int_in(0, EPOCH_MAX),
}
REQUESTS_PER_S = int_in(1, MAX_REQUESTS_PER_S, zero="unlimited")


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


def _parse_str_list(raw: Any, key: str, err: ConfigText) -> list[str]:
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise err.error(key, "must be a list of strings")
    return list(raw)


def _parse_tenant(raw: Mapping[str, Any], index: int, err: ConfigText) -> TenantConfig:
    table = f"tenants[{index}]"
    _check_keys(raw, TENANT_KEYS, table, err)
    tenant_id = raw.get("id")
    if not isinstance(tenant_id, str) or not is_valid_tenant_id(tenant_id):
        raise err.error(f"{table}.id", "must match [a-z0-9][a-z0-9._-]{0,62}")
    shared = raw.get("shared", False)
    if not isinstance(shared, bool):
        raise err.error(f"{table}.shared", "must be true or false")
    read_shared = _parse_str_list(raw.get("read_shared", []), f"{table}.read_shared", err)
    require_sealed = raw.get("require_sealed", False)
    if not isinstance(require_sealed, bool):
        raise err.error(f"{table}.require_sealed", "must be true or false")
    return TenantConfig(
        TenantId(tenant_id),
        quota_bytes=_number(raw, "quota_bytes", table, err, TENANT_NUMBERS["quota_bytes"]),
        epoch=_number(raw, "epoch", table, err, TENANT_NUMBERS["epoch"]),
        shared=shared,
        read_shared=tuple(TenantId(t) for t in read_shared),
        require_sealed=require_sealed,
    )


def _check_tenants(tenants: Sequence[TenantConfig], err: ConfigText) -> None:
    """Unique ids; `read_shared` names only shared tenants."""
    seen: set[str] = set()
    for i, tenant in enumerate(tenants):
        if tenant.id in seen:
            raise err.error(f"tenants[{i}].id", f"tenant {tenant.id!r} is defined twice")
        seen.add(tenant.id)
    shared = {t.id for t in tenants if t.shared}
    for i, tenant in enumerate(tenants):
        for name in tenant.read_shared:
            if name not in shared:
                raise err.error(
                    f"tenants[{i}].read_shared",
                    f"names {name!r}, which is not a tenant with shared = true",
                )


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
    principal = Principal(name, tenants, actions, requests_per_s=rate)
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
) -> AccessConfig:
    err = ConfigText(source, text)
    for array, entries in (("tenants", tenants_raw), ("principals", principals_raw)):
        for i, entry in enumerate(entries):
            if not isinstance(entry, Mapping):
                raise err.error((array, i), f"must be a table: write [[{array}]] and its keys")
    tenants = tuple(_parse_tenant(raw, i, err) for i, raw in enumerate(tenants_raw))
    _check_tenants(tenants, err)
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
    )
