"""What the block store reports as it works, for metrics (cacheserver/telemetry.py).

Events carry tenants, tiers, reasons, counts and sizes: never storage keys, digests or
payloads, so whatever consumes them cannot leak what the store protects.

They are the one counting path: metrics (ServerTelemetry) and the per-tenant figures of
the Stats RPC (`TenantCounters`) both consume the same events, through `FanOut`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, replace
from typing import Literal, Protocol, TypeAlias

from cacheserver.index import EvictReason
from policy.types import TenantId

Tier: TypeAlias = Literal["memory", "lmdb"]
PutOutcome: TypeAlias = Literal["stored", "already_present", "rejected", "failed"]


class StoreEvents(Protocol):
    """What the store reports as it works (often under its lock: keep them quick)."""

    def looked_up(self, tenant: TenantId, asked: int, present: int) -> None: ...
    def got(self, tenant: TenantId, asked: int, served: int) -> None: ...
    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None: ...
    def stored(self, tenant: TenantId, tier: Tier, nbytes: int) -> None: ...
    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None: ...
    def evicted(self, tier: Tier, reason: EvictReason, nbytes: int) -> None: ...
    def quota_rejected(self, tenant: TenantId) -> None: ...
    def integrity_failure(self, tenant: TenantId, blocks: int) -> None: ...


class NoEvents:
    """A StoreEvents that ignores everything (tools and tests without telemetry)."""

    def looked_up(self, tenant: TenantId, asked: int, present: int) -> None:
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


class TenantCounters(NoEvents):
    """Per-tenant figures for the Stats RPC, counted from the store's events."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[TenantId, TenantCounts] = {}

    def of(self, tenant: TenantId) -> TenantCounts:
        with self._lock:
            return self._counts.get(tenant, TenantCounts())

    def _add(self, tenant: TenantId, **deltas: int) -> None:
        with self._lock:
            now = self._counts.get(tenant, TenantCounts())
            fields = {name: getattr(now, name) + delta for name, delta in deltas.items()}
            self._counts[tenant] = replace(now, **fields)

    def looked_up(self, tenant: TenantId, asked: int, present: int) -> None:
        self._add(tenant, lookups=1, lookup_hits=present, lookup_digests=asked)

    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None:
        self._add(tenant, blocks_served=blocks, bytes_served=nbytes)

    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None:
        if outcome == "stored":
            self._add(tenant, blocks_stored=1, bytes_stored=nbytes)


class FanOut:
    """Hands every event to each of `sinks`, in order."""

    def __init__(self, *sinks: StoreEvents) -> None:
        self._sinks = sinks

    def looked_up(self, tenant: TenantId, asked: int, present: int) -> None:
        for sink in self._sinks:
            sink.looked_up(tenant, asked, present)

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
