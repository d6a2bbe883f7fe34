"""The benchmark's settings, parsed once from the command line into a frozen value."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

KIB = 1024
MIB = 1024 * KIB
DEFAULT_SIZES = (64 * KIB, 512 * KIB, 2 * MIB, 8 * MIB)
QUICK_SIZES = (64 * KIB, 2 * MIB)
DEFAULT_CLIENT_COUNTS = (1, 4)
QUICK_CLIENT_COUNTS = (1,)
DEFAULT_SYSTEMS = (
    "tcp",
    "redis",
    "redis-unix",
    "lmcache",
    "kvshare",
    "kvshare-tcp",
    "kvshare-tls",
    "kvshare-sealed",
    "kvshare-tls-sealed",
)
# Over a 3-node Redis Cluster on loopback (docs/scale-out.md): opt-in, each starts a cluster.
CLUSTER_SYSTEMS = ("redis-cluster", "kvshare-cluster", "kvshare-cluster-warm")
KNOWN_SYSTEMS = (
    *DEFAULT_SYSTEMS,
    "tcp-tls",
    "kvshare-nosync",
    "kvshare-grpc",
    "kvshare-tcp-2w",
    "kvshare-tcp-4w",
    *CLUSTER_SYSTEMS,
)
# Across hosts: no Unix socket (redis-unix), and plain `kvshare` would measure what
# kvshare-tcp does (its same-host transport finds another namespace and uses TCP).
TWO_HOST_SYSTEMS = tuple(s for s in DEFAULT_SYSTEMS if s not in ("redis-unix", "kvshare"))
BATCH_BLOCK_BYTES = 64 * KIB
DEFAULT_BATCH_BLOCKS = 64  # one restore of 64 blocks: 16k tokens at 256 tokens per block
# Digests per lookup: the prefix of a 16k-token request, asked about once per new request.
DEFAULT_LOOKUP_BLOCKS = 64
MAX_LOOKUP_BLOCKS = 4096  # the raw-TCP peer's keys per request (tcp_wire.MAX_KEYS_PER_REQUEST)
# Client processes per cell: kvshare's bulk listener lets one principal hold 64
# connections (cacheserver.transport.bulk.slots.MAX_PER_PRINCIPAL), and the bench's
# clients share one principal; past it a client would fall back to gRPC.
MAX_CLIENTS = 64

_SIZE = re.compile(r"^\s*(\d+)\s*([kmg]i?b?|b)?\s*$", re.IGNORECASE)
_UNIT_BYTES = {"": 1, "b": 1, "k": KIB, "m": MIB, "g": 1024 * MIB}


@dataclass(frozen=True)
class BenchConfig:
    sizes: tuple[int, ...]
    client_counts: tuple[int, ...]
    rounds: int
    systems: tuple[str, ...]
    seconds_per_cell: float
    put_bytes_per_client: int  # caps what one client writes per PUT cell (server memory)
    min_calls_per_cell: int
    batch_blocks: int  # blocks per batched GET call; 0 or 1 leaves the batch rows out
    lmcache_python: str | None
    workdir: Path | None  # keep server logs and data here instead of a temporary dir
    is_json: bool
    # Servers in one network namespace, clients in another, joined by a veth pair
    # (kvshare.bench.netns; root only). Rows carry "topology": "two-host" / "loopback".
    is_two_host: bool = False
    lookup_blocks: int = DEFAULT_LOOKUP_BLOCKS  # digests per lookup call; 0: no lookup rows


def parse_size(text: str) -> int:
    """'64KiB', '2MiB', '512k', '4096' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if match is None:
        raise ValueError(f"cannot read size {text!r}; write e.g. 64KiB, 2MiB or 4096")
    unit = (match.group(2) or "").lower()[:1]
    size = int(match.group(1)) * _UNIT_BYTES[unit]
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def parse_sizes(text: str) -> tuple[int, ...]:
    return tuple(parse_size(part) for part in text.split(",") if part.strip())


def parse_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"client counts {text!r}: write integers, e.g. 1,4,16") from None
    if not counts or min(counts) < 1:
        raise ValueError(f"client counts {text!r} must be positive integers")
    if max(counts) > MAX_CLIENTS:
        raise ValueError(
            f"client count {max(counts)} is over {MAX_CLIENTS}: kvshare's bulk listener "
            f"lets one principal (all the bench's clients) hold {MAX_CLIENTS} connections"
        )
    return counts


def parse_systems(text: str) -> tuple[str, ...]:
    systems = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [name for name in systems if name not in KNOWN_SYSTEMS]
    if unknown:
        raise ValueError(f"unknown systems {unknown}; choose from {', '.join(KNOWN_SYSTEMS)}")
    return systems


def format_size(value_bytes: int) -> str:
    for unit, scale in (("MiB", MIB), ("KiB", KIB)):
        if value_bytes >= scale and value_bytes % scale == 0:
            return f"{value_bytes // scale} {unit}"
    return f"{value_bytes} B"
