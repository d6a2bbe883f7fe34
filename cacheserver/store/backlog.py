"""The bound on payload bytes waiting for the store's disk writer, in total and per tenant.

Invariants: at most `max_bytes` of payloads are queued for, or inside, the writer. Of
the bytes still arriving (a put reserved, its payload not yet all received) at most
`max_tenant_bytes` are one tenant's, so one tenant's held or trickling puts can take at
most its share, never the whole bound from everyone else. Bytes that
have landed (a journaled put acknowledged, waiting only for the drain into LMDB) may use
the rest of the bound while no other tenant waits for room; once one does, a tenant
over its share gets no more until the waiter has had room, and the writer drains at
once (`has_waiters`): landed bytes free up within one drain batch, which held ones would
not. A put that would pass a bound waits (with the journal, where the writer drains on
demand) or is refused with RESOURCE_EXHAUSTED, so writers faster than the disk never
grow the server's memory without bound.

Why landed bytes may pass the share: a tenant alone on a server (the common case) would
otherwise absorb only half the bound in a burst before its puts wait for the disk, and
the journal is there to absorb bursts (measured: 2 MiB puts of four clients of one
tenant fell from 2.0 to 0.3-0.9 GB/s with the strict share).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Callable

from cacheserver.events import StoreEvents
from kvcommon import handoff
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
        self._by_tenant: Counter[TenantId] = Counter()  # held: arriving and landed
        self._arriving: Counter[TenantId] = Counter()
        self._waiting: Counter[TenantId] = Counter()  # puts waiting for room, by tenant
        # Futures may complete while the writer holds the store's lock: count under a
        # lock of its own.
        self._room = threading.Condition(threading.Lock())

    def _fits(self, tenant: TenantId, nbytes: int) -> bool:
        return self._bytes + nbytes <= self.max_bytes and self._within_share(tenant, nbytes)

    def _within_share(self, tenant: TenantId, nbytes: int) -> bool:
        """Arriving bytes within the share (a tenant may always have one block
        arriving, however big: a share smaller than a block must not refuse the block
        for ever); landed bytes past it only while no other tenant waits."""
        arriving = self._arriving[tenant]
        if arriving and arriving + nbytes > self.max_tenant_bytes:
            return False
        held = self._by_tenant[tenant]
        if held == 0 or held + nbytes <= self.max_tenant_bytes:
            return True
        return not any(n for other, n in self._waiting.items() if other != tenant)

    def reserve(self, tenant: TenantId, nbytes: int, wait_s: float) -> None:
        """Count `nbytes` of `tenant` against the bounds, waiting up to `wait_s` for
        room, or refuse."""
        deadline = time.monotonic() + wait_s
        could_fit = nbytes <= self.max_bytes
        with self._room:
            if not self._fits(tenant, nbytes) and could_fit and time.monotonic() < deadline:
                self._waiting[tenant] += 1
                handoff.before_blocking()  # a thread serving other connections goes on
                try:
                    while True:
                        self._hurry()
                        self._room.wait(max(0.0, deadline - time.monotonic()))
                        if self._fits(tenant, nbytes) or time.monotonic() >= deadline:
                            break
                finally:
                    _less(self._waiting, tenant, 1)
                self._room.notify_all()  # a tenant over its share may go on now
            if not self._fits(tenant, nbytes):
                self._events.put_outcome(tenant, "rejected", nbytes)
                raise ResourceExhausted(self._refusal(tenant, nbytes))
            self._bytes += nbytes
            self._by_tenant[tenant] += nbytes
            self._arriving[tenant] += nbytes

    def pending_bytes(self) -> tuple[int, dict[TenantId, int]]:
        """The bytes counted against the bound now, in total and by tenant (tenants
        with none left out): read at a metrics scrape."""
        with self._room:
            return self._bytes, dict(self._by_tenant)

    @property
    def has_waiters(self) -> bool:
        """Whether a put is waiting for room (one tenant's share or the total): then
        the writer drains at once instead of waiting for the store to be idle, or the
        put waits for a quiet moment that its own waiting makes."""
        return bool(self._waiting)

    def landed(self, tenant: TenantId, nbytes: int) -> None:
        """`nbytes` of `tenant` arrived whole (a journaled put acknowledged): they wait
        only for the drain now, and count against the tenant's share of arriving bytes
        no more."""
        with self._room:
            _less(self._arriving, tenant, nbytes)
            if self._waiting:  # every put lands: wake only when some put waits
                self._room.notify_all()

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

    def release(self, tenant: TenantId, nbytes: int, *, landed: bool = False) -> None:
        """`nbytes` of `tenant` leave the bound: written (or given up). `landed`: they
        had been reported with `landed` already."""
        with self._room:
            self._bytes -= nbytes
            _less(self._by_tenant, tenant, nbytes)
            if not landed:
                _less(self._arriving, tenant, nbytes)
            if self._waiting:
                self._room.notify_all()


def _less(counter: Counter[TenantId], tenant: TenantId, n: int) -> None:
    """Take `n` from `tenant`'s count, forgetting the tenant at zero (the counters stay
    as small as the set of tenants with something pending)."""
    counter[tenant] -= n
    if counter[tenant] <= 0:
        del counter[tenant]
