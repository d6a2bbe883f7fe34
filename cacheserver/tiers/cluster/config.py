"""`[redis_cluster]`: where the shared tier lives, parsed once at start-up.

The keys `nodes`, `username`, `password_file`, `tls`, `tls_ca` and `key_prefix` are a
contract (DESIGN §6); the others are optional with the defaults below. Credentials are
not read here: the password file is read (and refused unless owner-only) when the
server connects, so a config can be checked on a host that does not hold it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kvcommon.errors import ConfigError
from kvcommon.hostport import HostPort, parse_host_port

MiB = 1 << 20
DEFAULT_KEY_PREFIX = "kvshare:"
# A prefix is part of every key: braces in it would become a hash tag and put every
# block in one slot; spaces and control characters make keys awkward to inspect.
_PREFIX = re.compile(r"[A-Za-z0-9:._/-]{1,64}")


@dataclass(frozen=True)
class RedisClusterConfig:
    nodes: tuple[HostPort, ...]  # seed nodes; the client learns the rest from them
    username: str = ""  # a Redis ACL user; "": the default user
    password_file: Path | None = None  # owner-only file holding the password
    tls: bool = False
    tls_ca: Path | None = None  # None with tls: the system trust store
    key_prefix: str = DEFAULT_KEY_PREFIX
    # Longest wait for one Redis call; a node slower than this counts as down for
    # retry_after_ms, and its blocks are misses meanwhile.
    timeout_ms: int = 2000
    retry_after_ms: int = 1000
    # Blocks waiting to be written to the cluster (behind the put's acknowledgement);
    # past it, writes to the cluster are dropped (the block stays local) and counted.
    write_queue_bytes: int = 256 * MiB
    # Keep blocks read from the cluster in this server's memory tier and LMDB (warm
    # reads are local); off, every read of a block another server wrote goes to Redis.
    local_copies: bool = True
    # Entries the delete stream keeps (each up to 256 keys, 8 KiB): a server behind by
    # more reconciles its local copies against the cluster instead of replaying them.
    delete_stream_entries: int = 10_000


_CONTRACT_DEFAULTS = RedisClusterConfig(nodes=())
_KNOWN = {f.name for f in fields(RedisClusterConfig)}


def parse_redis_cluster(
    raw: Mapping[str, Any], source: str, line_of: Callable[[str], int]
) -> RedisClusterConfig | None:
    """`raw` (the table) as a RedisClusterConfig, or None when the table is absent.
    `line_of(key)`: the key's line in `source`, for error messages (0: unknown)."""
    if not raw:
        return None

    def fail(key: str, message: str) -> ConfigError:
        line = line_of(key)
        where = f"{source}:{line}" if line else source
        return ConfigError(f"{where}: redis_cluster.{key}: {message}")

    for key in raw:
        if key not in _KNOWN:
            raise fail(key, f"unknown key; allowed: {', '.join(sorted(_KNOWN))}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        default = getattr(_CONTRACT_DEFAULTS, key)
        if key == "nodes":
            values[key] = _parse_nodes(value, fail)
        elif key in ("password_file", "tls_ca"):
            if not isinstance(value, str):
                raise fail(key, "must be a path (a string)")
            values[key] = Path(value) if value else None
        elif type(value) is not type(default) or (isinstance(value, int) and value < 0):
            kind = type(default).__name__
            raise fail(key, f"must be {kind}" + (" >= 0" if kind == "int" else ""))
        else:
            values[key] = value
    if "nodes" not in values:
        raise fail("nodes", 'name at least one seed node, e.g. nodes = ["10.0.0.7:7000"]')
    config = RedisClusterConfig(**values)
    if not _PREFIX.fullmatch(config.key_prefix):
        raise fail(
            "key_prefix",
            f"{config.key_prefix!r}: use 1-64 of A-Z a-z 0-9 : . _ / - (no braces: they "
            "would put every block in one hash slot)",
        )
    if config.tls_ca is not None and not config.tls:
        raise fail("tls_ca", "set tls = true as well, or remove tls_ca")
    if config.timeout_ms == 0 or config.write_queue_bytes == 0:
        raise fail("timeout_ms" if config.timeout_ms == 0 else "write_queue_bytes", "must be > 0")
    return config


def _parse_nodes(value: Any, fail: Callable[[str, str], ConfigError]) -> tuple[HostPort, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise fail("nodes", 'must be a non-empty list of "HOST:PORT" strings')
    nodes = []
    for text in value:
        try:
            node = parse_host_port(text, what="node")
        except ValueError as error:
            raise fail("nodes", str(error)) from None
        if node.port == 0 or node.is_wildcard:
            raise fail("nodes", f"{text!r}: name a node's real address and port")
        nodes.append(node)
    return tuple(nodes)
