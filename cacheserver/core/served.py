"""What a bulk read worker served, counted as the store counts its own reads.

The store's events (cacheserver.events.StoreEvents) are the one counting path: metrics
and the Stats RPC's per-tenant figures both consume them. A read worker
(cacheserver.core.readonly) fires the same events as it serves, into `EventSums`, which
sums them per tenant with the storage keys they read; every report interval the sums
cross to the server (cacheserver.transport.bulk.delegation frames them), and `replay`
fires them into the server's store events, so they are counted exactly where and how
the server's own reads are, and the keys become recently used in the server's index.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cacheserver.events import NoEvents, StoreEvents, Tier
from policy.types import StorageKey, TenantId


@dataclass
class TenantReport:
    """What a worker served for one tenant since its last report: the store events its
    reads fired, summed, and the keys they read."""

    lookups: int = 0  # looked_up: calls, digests asked, digests present
    lookup_digests: int = 0
    lookup_hits: int = 0
    gets: int = 0  # got: calls, blocks asked, blocks served
    get_asked: int = 0
    get_blocks: int = 0
    served_blocks: int = 0  # served (from LMDB, the one tier a worker reads): blocks, bytes
    bytes_served: int = 0
    keys: set[StorageKey] = field(default_factory=set)

    def __bool__(self) -> bool:
        return bool(self.lookups or self.gets or self.served_blocks or self.keys)

    def counts(self) -> tuple[int, ...]:
        """The sums, in field order (what a report datagram carries before its keys)."""
        return (
            self.lookups,
            self.lookup_digests,
            self.lookup_hits,
            self.gets,
            self.get_asked,
            self.get_blocks,
            self.served_blocks,
            self.bytes_served,
        )

    @classmethod
    def of(cls, counts: Sequence[int], keys: set[StorageKey]) -> TenantReport:
        """The report `counts()` came from, with its keys."""
        report = cls(keys=keys)
        (
            report.lookups,
            report.lookup_digests,
            report.lookup_hits,
            report.gets,
            report.get_asked,
            report.get_blocks,
            report.served_blocks,
            report.bytes_served,
        ) = counts
        return report


class EventSums(NoEvents):
    """A worker's `ServedEvents` (cacheserver.core.readonly): the events of what it
    served, summed per tenant until `take`n for a report. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._reports: dict[TenantId, TenantReport] = {}

    def _report(self, tenant: TenantId) -> TenantReport:
        report = self._reports.get(tenant)
        if report is None:
            report = self._reports[tenant] = TenantReport()
        return report

    def looked_up(self, tenant: TenantId, asked: int, present: int, calls: int = 1) -> None:
        with self._lock:
            report = self._report(tenant)
            report.lookups += calls
            report.lookup_digests += asked
            report.lookup_hits += present

    def got(self, tenant: TenantId, asked: int, served: int) -> None:
        with self._lock:
            report = self._report(tenant)
            report.gets += 1
            report.get_asked += asked
            report.get_blocks += served

    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None:
        assert tier == "lmdb", "a worker reads LMDB alone"
        with self._lock:
            report = self._report(tenant)
            report.served_blocks += blocks
            report.bytes_served += nbytes

    def used(self, tenant: TenantId, keys: Sequence[StorageKey]) -> None:
        with self._lock:
            self._report(tenant).keys.update(keys)

    def take(self) -> dict[TenantId, TenantReport]:
        """What was served since the last `take`, per tenant (tenants with nothing left
        out)."""
        with self._lock:
            reports, self._reports = self._reports, {}
        return {tenant: report for tenant, report in reports.items() if report}


class ServingStore(Protocol):
    """What the server's side of read workers needs of the store
    (cacheserver.store.BlockStore): where LMDB is, its events, its index's recency."""

    lmdb_path: Path
    events: StoreEvents

    def touch(self, keys: Iterable[StorageKey]) -> None: ...


def replay(store: ServingStore, tenant: TenantId, report: TenantReport) -> None:
    """A worker's report, counted in the server: its keys recently used in the index,
    its events fired into the store's (so metrics and Stats count them as they count
    the server's own reads)."""
    store.touch(report.keys)
    events = store.events
    if report.lookups:
        events.looked_up(tenant, report.lookup_digests, report.lookup_hits, calls=report.lookups)
    if report.served_blocks:
        events.served(tenant, "lmdb", report.served_blocks, report.bytes_served)
    if report.gets:
        events.got(tenant, report.get_asked, report.get_blocks)
