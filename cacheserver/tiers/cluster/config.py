"""`[redis_cluster]`: where the shared tier lives, parsed once at start-up.

The keys `nodes`, `username`, `password_file`, `tls`, `tls_ca` and `key_prefix` are a
contract (DESIGN §6); the others are optional with the defaults below. Credentials are
not read here: the password file is read (and refused unless owner-only) when the
server connects, so a config can be checked on a host that does not hold it.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvcommon.hostport import HostPort, parse_host_port
from policy.config_text import (
    DAY_MS,
    SECOND_MS,
    ConfigText,
    Flag,
    MiB,
    PathText,
    Refused,
    Spec,
    Text,
    TiB,
    int_in,
    shown,
)

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


@dataclass(frozen=True)
class _Nodes:
    def allowed(self) -> str:
        return 'a non-empty list of "HOST:PORT" strings, each a node\'s real address'

    def check(self, value: Any) -> tuple[HostPort, ...]:
        return _parse_nodes(value)


@dataclass(frozen=True)
class _KeyPrefix:
    def allowed(self) -> str:
        return "1-64 of A-Z a-z 0-9 : . _ / -"

    def check(self, value: Any) -> str:
        if not isinstance(value, str) or not _PREFIX.fullmatch(value):
            raise Refused(
                f"{shown(value)}: use {self.allowed()} (no braces: they would put every "
                "block in one hash slot)"
            )
        return value


# One spec per key (see cacheserver/config for the reasons of the bounds): a call
# timeout past an hour would make a dead node look alive for that long.
REDIS_CLUSTER_SPECS: dict[str, Spec] = {
    "nodes": _Nodes(),
    "username": Text(0, 256),
    "password_file": PathText(empty="no password"),
    "tls": Flag(),
    "tls_ca": PathText(empty="the system trust store"),
    "key_prefix": _KeyPrefix(),
    "timeout_ms": int_in(1, 3600 * SECOND_MS, "ms"),
    "retry_after_ms": int_in(0, DAY_MS, "ms"),
    "write_queue_bytes": int_in(1, TiB, "bytes"),
    "local_copies": Flag(),
    "delete_stream_entries": int_in(1, 100_000_000),
}


def parse_redis_cluster(raw: Mapping[str, Any], cfg: ConfigText) -> RedisClusterConfig | None:
    """`raw` (the table) as a RedisClusterConfig, or None when the table is absent;
    errors name `cfg`'s file, the line and the key."""
    if not raw:
        return None
    values = cfg.check_table(raw, REDIS_CLUSTER_SPECS, ("redis_cluster",))
    if "nodes" not in values:
        raise cfg.error(
            ("redis_cluster", "nodes"),
            'name at least one seed node, e.g. nodes = ["10.0.0.7:7000"]',
        )
    for key in ("password_file", "tls_ca"):
        if key in values:
            values[key] = Path(values[key]) if values[key] else None
    config = RedisClusterConfig(**values)
    if config.tls_ca is not None and not config.tls:
        raise cfg.error(("redis_cluster", "tls_ca"), "set tls = true as well, or remove tls_ca")
    return config


def _parse_nodes(value: Any) -> tuple[HostPort, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise Refused('must be a non-empty list of "HOST:PORT" strings')
    nodes = []
    for text in value:
        try:
            node = parse_host_port(text, what="node")
        except ValueError as error:
            raise Refused(str(error)) from None
        if node.port == 0 or node.is_wildcard:
            raise Refused(f"{text!r}: name a node's real address and port")
        nodes.append(node)
    return tuple(nodes)
