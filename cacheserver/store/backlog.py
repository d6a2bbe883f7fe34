"""The bound on payload bytes waiting for the store's disk writer, in total and per tenant.

Invariants: at most `max_bytes` of payloads are queued for, or inside, the writer, and
at most `max_tenant_bytes` of them are one tenant's. A put that would pass either bound
waits (with the journal, where the writer drains on demand) or is refused with
RESOURCE_EXHAUSTED, so writers faster than the disk never grow the server's memory
without bound — and one tenant's held or flooding puts can take at most its share,
never the whole bound from everyone else (issue 15, F4).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from cacheserver.events import StoreEvents
from kvcommon.errors import ResourceExhausted
from policy.types import TenantId


class WriteBacklog:
    def __init__(
        self,
        max_bytes: int,
        events: StoreEvents,
        hurry: Callable[[], None],
        max_tenant_bytes: int = 0,
    ) -> None:
        """`hurry()` asks the writer to drain now (a put is waiting for room).
        `max_tenant_bytes`: one tenant's share; 0 means half of `max_bytes`."""
        self.max_bytes = max_bytes
        self.max_tenant_bytes = max_tenant_bytes or max(1, max_bytes // 2)
        self._events = events
        self._hurry = hurry
        self._bytes = 0
        self._by_tenant: Counter[TenantId] = Counter()
        # Futures may complete while the writer holds the store's lock: count under a
        # lock of its own.
        self._room = threading.Condition(threading.Lock())

    def _fits(self, tenant: TenantId, nbytes: int) -> bool:
        return self._bytes + nbytes <= self.max_bytes and self._within_share(tenant, nbytes)

    def _within_share(self, tenant: TenantId, nbytes: int) -> bool:
        """A tenant may always have one block waiting, however big (up to the total
        bound): a share smaller than a block must not refuse the block for ever."""
        held = self._by_tenant[tenant]
        return held == 0 or held + nbytes <= self.max_tenant_bytes

    def reserve(self, tenant: TenantId, nbytes: int, wait_s: float) -> None:
        """Count `nbytes` of `tenant` against the bounds, waiting up to `wait_s` for
        room, or refuse."""
        deadline = time.monotonic() + wait_s
        could_fit = nbytes <= self.max_bytes
        with self._room:
            while not self._fits(tenant, nbytes) and could_fit and time.monotonic() < deadline:
                self._hurry()
                self._room.wait(max(0.0, deadline - time.monotonic()))
            if not self._fits(tenant, nbytes):
                self._events.put_outcome(tenant, "rejected", nbytes)
                raise ResourceExhausted(self._refusal(tenant, nbytes))
            self._bytes += nbytes
            self._by_tenant[tenant] += nbytes

    def _refusal(self, tenant: TenantId, nbytes: int) -> str:
        if self._bytes + nbytes > self.max_bytes:
            return (
                f"{self._bytes} bytes already wait for the disk writer; "
                f"max_pending_write_bytes is {self.max_bytes}: retry later, "
                "or raise it in [storage]"
            )
        return (
            f"this tenant has {self._by_tenant[tenant]} bytes waiting for the disk writer, "
            f"its share (max_pending_write_bytes_per_tenant) is {self.max_tenant_bytes}: "
            "retry later, or raise it in [storage]"
        )

    def release(self, tenant: TenantId, nbytes: int) -> None:
        with self._room:
            self._bytes -= nbytes
            self._by_tenant[tenant] -= nbytes
            if self._by_tenant[tenant] <= 0:
                del self._by_tenant[tenant]
            self._room.notify_all()
