"""What the block store reports as it works, for metrics (cacheserver/telemetry.py).

Events carry tenants, tiers, reasons, counts and sizes: never storage keys, digests or
payloads, so whatever consumes them cannot leak what the store protects.
"""

from __future__ import annotations

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
    def put_outcome(self, tenant: TenantId, outcome: PutOutcome) -> None: ...
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

    def put_outcome(self, tenant: TenantId, outcome: PutOutcome) -> None:
        pass

    def evicted(self, tier: Tier, reason: EvictReason, nbytes: int) -> None:
        pass

    def quota_rejected(self, tenant: TenantId) -> None:
        pass

    def integrity_failure(self, tenant: TenantId, blocks: int) -> None:
        pass
