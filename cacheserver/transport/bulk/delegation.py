"""What the server and its bulk workers tell each other (framing only; no I/O).

A bulk worker (cacheserver.worker) is a process of its own, with a GIL of its own,
that serves the plain-TCP bulk connections the server hands it. Messages, each one
SOCK_SEQPACKET datagram:

- server -> worker, on the worker's control socket: a `Delegation` (JSON) with two
  descriptors, the connection (already past its hello: authenticated, bound to one
  principal and tenant) and the worker's end of that connection's hand-back pair;
- worker -> server, on a connection's hand-back pair: `HAND_BACK` (+ whether the
  request's rate was already drawn): "serve the request at the head of the socket";
  the server answers `SERVED_ON` or `CLOSED` once its reply went out. `GIVE_BACK`:
  the same, and the connection is the server's from then on (it only writes: each of
  its requests would come back anyway, at the cost of a round trip here), until it
  reads again (`REDELEGATE_AFTER_READS`): then the server hands it to a worker anew;
- worker -> server, on the control socket, every `REPORT_INTERVAL_S`: a `Report` of
  what the worker served (per tenant: calls, digests, blocks, bytes, and the storage
  keys read, so the server's index sees them as recently used).

Only storage keys cross, never digests or payloads; the delegation carries the
tenant's naming key (policy.naming.TenantNamer), never the server secret.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from policy.types import StorageKey, TenantId

HAND_BACK = b"H"
GIVE_BACK = b"G"
# A connection whose requests were this many puts in a row is given back (an agent saves
# on threads, and so connections, of their own); one the server then sees make this many
# reads in a row goes to a worker again. At most one move per 8 requests.
GIVE_BACK_AFTER_PUTS = 8
REDELEGATE_AFTER_READS = 8
RATE_DRAWN = b"R"  # follows HAND_BACK: the worker drew the request's rate already
SERVED_ON = b"D"  # the server served the request; the worker reads the next one
CLOSED = b"C"  # the server refused the request and closed the connection
REPORT_INTERVAL_S = 0.2
STORAGE_KEY_BYTES = 32
# A report datagram stays well below the socket's send buffer.
MAX_REPORT_BYTES = 48 << 10
# tenant length | lookups | lookup digests | gets | get blocks | bytes served | keys
_TENANT_REPORT = struct.Struct(">HQQQQQI")


@dataclass(frozen=True)
class Delegation:
    """One connection as a worker serves it: who it is bound to, and its limits."""

    principal: str
    tenant: str
    naming_key: bytes = field(repr=False)
    may_read: bool
    requests_per_s: int  # the principal's rate (0: unlimited), drawn from shared buckets
    burst_s: int
    max_digests: int
    idle_s: float
    min_transfer_bytes_per_s: int

    def encode(self) -> bytes:
        fields = asdict(self)
        fields["naming_key"] = self.naming_key.hex()
        return json.dumps(fields).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> Delegation:
        fields = json.loads(raw.decode("utf-8"))
        fields["naming_key"] = bytes.fromhex(fields["naming_key"])
        delegation = cls(**fields)
        if len(delegation.naming_key) != 32 or delegation.max_digests < 1:
            raise ValueError("a delegation with a malformed naming key or limit")
        return delegation


@dataclass
class TenantReport:
    """What a worker served for one tenant since its last report. The worker answers
    only lookups and GETs whose every block it found, so hits are all it counts."""

    lookups: int = 0
    lookup_digests: int = 0
    gets: int = 0
    get_blocks: int = 0
    bytes_served: int = 0
    keys: set[StorageKey] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.lookups or self.gets or self.keys)


def encode_reports(reports: dict[TenantId, TenantReport]) -> Iterator[bytes]:
    """Datagrams of at most MAX_REPORT_BYTES; a tenant with many keys spans several
    (its counts in the first)."""
    for tenant, report in reports.items():
        name = tenant.encode("utf-8")
        keys = sorted(report.keys)
        counts = (report.lookups, report.lookup_digests, report.gets, report.get_blocks)
        room = (MAX_REPORT_BYTES - _TENANT_REPORT.size - len(name)) // STORAGE_KEY_BYTES
        first = True
        while first or keys:
            part, keys = keys[:room], keys[room:]
            figures = (*counts, report.bytes_served) if first else (0, 0, 0, 0, 0)
            head = _TENANT_REPORT.pack(len(name), *figures, len(part))
            yield head + name + b"".join(part)
            first = False


def decode_report(raw: bytes) -> tuple[TenantId, TenantReport]:
    size, lookups, digests, gets, blocks, nbytes, count = _TENANT_REPORT.unpack_from(raw)
    start = _TENANT_REPORT.size
    tenant = TenantId(raw[start : start + size].decode("utf-8"))
    start += size
    if len(raw) != start + count * STORAGE_KEY_BYTES:
        raise ValueError("a worker report of the wrong length")
    keys = {
        StorageKey(raw[offset : offset + STORAGE_KEY_BYTES])
        for offset in range(start, len(raw), STORAGE_KEY_BYTES)
    }
    return tenant, TenantReport(lookups, digests, gets, blocks, nbytes, keys)
