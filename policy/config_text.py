"""Where a config value is in its file, and what it may hold.

`key_line` finds a key's real line by scanning the text (tomllib gives no positions);
the spec types (`int_in`, `Flag`, `Text`, `PathText`, `Address`, `Choice`) state each
key's type and range once; `ConfigText` builds the errors, which name the file, the
line, the key and what is allowed. Every config table of the server uses them.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvcommon.errors import ConfigError
from kvcommon.hostport import parse_host_port

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
