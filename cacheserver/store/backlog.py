"""The bound on payload bytes waiting for the store's disk writer.

Invariant: at most `max_bytes` of payloads are queued for, or inside, the writer; a put
that would pass it waits (with the journal, where the writer drains on demand) or is
refused with RESOURCE_EXHAUSTED, so writers faster than the disk never grow the
server's memory without bound.

Known gap (issue 15, F4): the bound is shared by all tenants, and held bytes do not
count against a tenant's quota, so one tenant's held puts can fill it for everyone.
A per-tenant share belongs in `reserve`/`release` here.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cacheserver.events import StoreEvents
from kvcommon.errors import ResourceExhausted
from policy.types import TenantId


class WriteBacklog:
    def __init__(self, max_bytes: int, events: StoreEvents, hurry: Callable[[], None]) -> None:
        """`hurry()` asks the writer to drain now (a put is waiting for room)."""
        self.max_bytes = max_bytes
        self._events = events
        self._hurry = hurry
        self._bytes = 0
        # Futures may complete while the writer holds the store's lock: count under a
        # lock of its own.
        self._room = threading.Condition(threading.Lock())

    def reserve(self, tenant: TenantId, nbytes: int, wait_s: float) -> None:
        """Count `nbytes` against the bound, waiting up to `wait_s` for room, or refuse."""
        deadline = time.monotonic() + wait_s
        with self._room:
            while (
                self._bytes + nbytes > self.max_bytes
                and nbytes <= self.max_bytes
                and time.monotonic() < deadline
            ):
                self._hurry()
                self._room.wait(max(0.0, deadline - time.monotonic()))
            if self._bytes + nbytes > self.max_bytes:
                self._events.put_outcome(tenant, "rejected", nbytes)
                raise ResourceExhausted(
                    f"{self._bytes} bytes already wait for the disk writer; "
                    f"max_pending_write_bytes is {self.max_bytes}: retry later, "
                    "or raise it in [storage]"
                )
            self._bytes += nbytes

    def release(self, nbytes: int) -> None:
        with self._room:
            self._bytes -= nbytes
            self._room.notify_all()
