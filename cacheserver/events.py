"""What the block store reports as it works, for metrics (cacheserver/telemetry.py).

Events carry tenants, tiers, reasons, counts and sizes: never storage keys, digests or
payloads, so whatever consumes them cannot leak what the store protects.

They are the one counting path: metrics (ServerTelemetry) and the per-tenant figures of
the Stats RPC (`TenantCounters`) both consume the same events, through `FanOut`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, fields
from typing import Literal, Protocol, TypeAlias

from policy.types import TenantId

Tier: TypeAlias = Literal["memory", "lmdb"]
EvictReason: TypeAlias = Literal["quota", "budget"]
PutOutcome: TypeAlias = Literal["stored", "already_present", "rejected", "failed"]


class StoreEvents(Protocol):
    """What the store reports as it works (often under its lock: keep them quick).
    `looked_up`'s `calls`: lookups reported together, their digests summed (a bulk
    worker's report)."""

    def looked_up(self, tenant: TenantId, asked: int, present: int, calls: int = 1) -> None: ...
    def got(self, tenant: TenantId, asked: int, served: int) -> None: ...
    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None: ...
    def stored(self, tenant: TenantId, tier: Tier, nbytes: int) -> None: ...
    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None: ...
    def evicted(self, tier: Tier, reason: EvictReason, nbytes: int) -> None: ...
    def quota_rejected(self, tenant: TenantId) -> None: ...
    def integrity_failure(self, tenant: TenantId, blocks: int) -> None: ...


class NoEvents:
    """A StoreEvents that ignores everything (tools and tests without telemetry)."""

    def looked_up(self, tenant: TenantId, asked: int, present: int, calls: int = 1) -> None:
        pass

    def got(self, tenant: TenantId, asked: int, served: int) -> None:
        pass

    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None:
        pass

    def stored(self, tenant: TenantId, tier: Tier, nbytes: int) -> None:
        pass

    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None:
        pass

    def evicted(self, tier: Tier, reason: EvictReason, nbytes: int) -> None:
        pass

    def quota_rejected(self, tenant: TenantId) -> None:
        pass

    def integrity_failure(self, tenant: TenantId, blocks: int) -> None:
        pass


@dataclass(frozen=True, slots=True)
class TenantCounts:
    """A tenant's figures since the server started, as the Stats RPC reports them."""

    lookups: int = 0
    lookup_hits: int = 0
    lookup_digests: int = 0  # digests asked: lookup_hits / lookup_digests is the hit rate
    blocks_served: int = 0
    bytes_served: int = 0
    blocks_stored: int = 0
    bytes_stored: int = 0


_INDEX = {f.name: i for i, f in enumerate(fields(TenantCounts))}
_FIELDS = len(_INDEX)
_LOOKUPS, _LOOKUP_HITS = _INDEX["lookups"], _INDEX["lookup_hits"]
_LOOKUP_DIGESTS = _INDEX["lookup_digests"]
_BLOCKS_SERVED, _BYTES_SERVED = _INDEX["blocks_served"], _INDEX["bytes_served"]
_BLOCKS_STORED, _BYTES_STORED = _INDEX["blocks_stored"], _INDEX["bytes_stored"]


class TenantCounters(NoEvents):
    """Per-tenant figures for the Stats RPC, counted from the store's events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # Per tenant, the TenantCounts fields in order, as a list counted in place: an
        # event is on every request's path, so no object is made per event (a
        # dataclasses.replace per put cost ~40% of a 64 KiB put's handling).
        self._counts: dict[TenantId, list[int]] = {}

    def of(self, tenant: TenantId) -> TenantCounts:
        with self._lock:
            counts = self._counts.get(tenant)
            return TenantCounts(*counts) if counts is not None else TenantCounts()

    def _row(self, tenant: TenantId) -> list[int]:
        row = self._counts.get(tenant)
        if row is None:
            row = self._counts[tenant] = [0] * _FIELDS
        return row

    def looked_up(self, tenant: TenantId, asked: int, present: int, calls: int = 1) -> None:
        with self._lock:
            row = self._row(tenant)
            row[_LOOKUPS] += calls
            row[_LOOKUP_HITS] += present
            row[_LOOKUP_DIGESTS] += asked

    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None:
        with self._lock:
            row = self._row(tenant)
            row[_BLOCKS_SERVED] += blocks
            row[_BYTES_SERVED] += nbytes

    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None:
        if outcome == "stored":
            with self._lock:
                row = self._row(tenant)
                row[_BLOCKS_STORED] += 1
                row[_BYTES_STORED] += nbytes


class FanOut:
    """Hands every event to each of `sinks`, in order."""

    def __init__(self, *sinks: StoreEvents) -> None:
        self._sinks = sinks

    def looked_up(self, tenant: TenantId, asked: int, present: int, calls: int = 1) -> None:
        for sink in self._sinks:
            sink.looked_up(tenant, asked, present, calls)

    def got(self, tenant: TenantId, asked: int, served: int) -> None:
        for sink in self._sinks:
            sink.got(tenant, asked, served)

    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None:
        for sink in self._sinks:
            sink.served(tenant, tier, blocks, nbytes)

    def stored(self, tenant: TenantId, tier: Tier, nbytes: int) -> None:
        for sink in self._sinks:
            sink.stored(tenant, tier, nbytes)

    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None:
        for sink in self._sinks:
            sink.put_outcome(tenant, outcome, nbytes)

    def evicted(self, tier: Tier, reason: EvictReason, nbytes: int) -> None:
        for sink in self._sinks:
            sink.evicted(tier, reason, nbytes)

    def quota_rejected(self, tenant: TenantId) -> None:
        for sink in self._sinks:
            sink.quota_rejected(tenant)

    def integrity_failure(self, tenant: TenantId, blocks: int) -> None:
        for sink in self._sinks:
            sink.integrity_failure(tenant, blocks)
