"""What the server and its bulk workers tell each other (framing only; no I/O).

A bulk read worker (cacheserver.transport.bulk.readworker) is a process of its own,
with a GIL of its own, that serves the plain-TCP bulk connections the server hands it.
Messages, each one SOCK_SEQPACKET datagram:

- server -> worker, on the worker's control socket: a `Delegation` (JSON) with two
  descriptors, the connection (already past its hello: authenticated, bound to one
  principal and tenant) and the worker's end of that connection's hand-back pair;
- server -> worker, on the control socket, after a live reload: an `Update` (SETTINGS
  and JSON, no descriptor): the config's defaults for every connection the worker
  serves (the public scope, `[limits]`, tagged with the config generation; the worker
  keeps the newest it was sent, by an update or a delegation) and the shared rate
  table's slots, which the reload may have given to principals it added;
- worker -> server, on a connection's hand-back pair: `HAND_BACK` (+ whether the
  request's rate was already drawn): "serve the request at the head of the socket";
  the server answers `SERVED_ON` or `CLOSED` once its reply went out. `GIVE_BACK`:
  the same, and the connection is the server's from then on (it only writes: each of
  its requests would come back anyway, at the cost of a round trip here), until it
  reads again (`REDELEGATE_AFTER_READS`): then the server hands it to a worker anew;
- worker -> server, on the control socket, every `REPORT_INTERVAL_S`: a report of
  what the worker served (per tenant: the store events its reads fired, summed, and
  the storage keys read, so the server's index sees them as recently used), which the
  server replays into its own events (cacheserver.core.served).

A delegation carries data, never a decision made for the worker: the principal's
grants and rate, the tenant's naming key (policy.naming.TenantNamer, never the server
secret), the limits and the public scope, from which the worker runs the request
core's own admission (cacheserver.core.readonly). Only storage keys cross, never
digests or payloads.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

from cacheserver.core.readonly import Defaults, Grants
from cacheserver.core.served import TenantReport
from policy import Action, Principal
from policy.permissions import PublicScope
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
SETTINGS = b"S"  # heads an Update on the control socket (a Delegation is JSON: "{")
REPORT_INTERVAL_S = 0.2
STORAGE_KEY_BYTES = 32
# A report datagram stays well below the socket's send buffer.
MAX_REPORT_BYTES = 48 << 10
# tenant length | the counts (cacheserver.core.served.TenantReport.counts) | keys
_TENANT_REPORT = struct.Struct(">H8QI")


@dataclass(frozen=True)
class Delegation:
    """One connection as a worker serves it: the data of its `Grants` (the principal
    as its config has it, the connection's tenant and its naming key, the limits and
    the public scope) and its pace."""

    principal: str
    tenants: list[str]
    actions: list[str]
    requests_per_s: int | None  # the principal's own (None: the default; 0: unlimited)
    tenant: str
    naming_key: bytes = field(repr=False)
    default_requests_per_s: int
    burst_s: int
    max_digests: int
    public: bool  # whether the server has a public scope
    public_readers: list[str]  # tenants whose readers may read it (read_public)
    idle_s: float
    min_transfer_bytes_per_s: int
    generation: int = 0  # the config generation of the public scope and limits

    @classmethod
    def of(cls, grants: Grants, idle_s: float, min_transfer_bytes_per_s: int) -> Delegation:
        principal = grants.principal
        return cls(
            principal=principal.name,
            tenants=sorted(principal.tenants),
            actions=sorted(principal.actions),
            requests_per_s=principal.requests_per_s,
            tenant=grants.tenant,
            naming_key=grants.naming_key,
            default_requests_per_s=grants.default_requests_per_s,
            burst_s=grants.burst_s,
            max_digests=grants.max_digests_per_call,
            public=grants.public.configured,
            public_readers=sorted(grants.public.reader_tenants),
            idle_s=idle_s,
            min_transfer_bytes_per_s=min_transfer_bytes_per_s,
            generation=grants.generation,
        )

    def grants(self) -> Grants:
        principal = Principal(
            self.principal,
            frozenset(TenantId(t) for t in self.tenants),
            frozenset(Action(a) for a in self.actions),
            self.requests_per_s,
        )
        public = PublicScope(self.public, frozenset(TenantId(t) for t in self.public_readers))
        return Grants(
            principal,
            TenantId(self.tenant),
            self.naming_key,
            public,
            self.default_requests_per_s,
            self.burst_s,
            self.max_digests,
            self.generation,
        )

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


@dataclass(frozen=True)
class Update:
    """What a live reload changes on every connection a worker serves: the config's
    `Defaults`, and the shared rate table's slots (name -> slot, the whole table)."""

    defaults: Defaults
    slots: dict[str, int]

    def encode(self) -> bytes:
        defaults = self.defaults
        fields = {
            "generation": defaults.generation,
            "public": defaults.public.configured,
            "public_readers": sorted(defaults.public.reader_tenants),
            "default_requests_per_s": defaults.default_requests_per_s,
            "burst_s": defaults.burst_s,
            "max_digests": defaults.max_digests_per_call,
            "slots": self.slots,
        }
        return SETTINGS + json.dumps(fields).encode("utf-8")

    @classmethod
    def decode(cls, raw: bytes) -> Update:
        if not raw.startswith(SETTINGS):
            raise ValueError("not an update")
        fields = json.loads(raw[len(SETTINGS) :].decode("utf-8"))
        public = PublicScope(
            bool(fields["public"]), frozenset(TenantId(t) for t in fields["public_readers"])
        )
        defaults = Defaults(
            int(fields["generation"]),
            public,
            int(fields["default_requests_per_s"]),
            int(fields["burst_s"]),
            int(fields["max_digests"]),
        )
        slots = {str(name): int(slot) for name, slot in fields["slots"].items()}
        if defaults.max_digests_per_call < 1 or any(slot < 0 for slot in slots.values()):
            raise ValueError("an update with a malformed limit or slot")
        return cls(defaults, slots)


def encode_reports(reports: dict[TenantId, TenantReport]) -> Iterator[bytes]:
    """Datagrams of at most MAX_REPORT_BYTES; a tenant with many keys spans several
    (its counts in the first)."""
    for tenant, report in reports.items():
        name = tenant.encode("utf-8")
        keys = sorted(report.keys)
        counts = report.counts()
        room = (MAX_REPORT_BYTES - _TENANT_REPORT.size - len(name)) // STORAGE_KEY_BYTES
        first = True
        while first or keys:
            part, keys = keys[:room], keys[room:]
            figures = counts if first else (0,) * len(counts)
            head = _TENANT_REPORT.pack(len(name), *figures, len(part))
            yield head + name + b"".join(part)
            first = False


def decode_report(raw: bytes) -> tuple[TenantId, TenantReport]:
    size, *figures, count = _TENANT_REPORT.unpack_from(raw)
    start = _TENANT_REPORT.size
    tenant = TenantId(raw[start : start + size].decode("utf-8"))
    start += size
    if len(raw) != start + count * STORAGE_KEY_BYTES:
        raise ValueError("a worker report of the wrong length")
    keys = {
        StorageKey(raw[offset : offset + STORAGE_KEY_BYTES])
        for offset in range(start, len(raw), STORAGE_KEY_BYTES)
    }
    return tenant, TenantReport.of(figures, keys)
