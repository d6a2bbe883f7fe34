"""Per-principal request-rate limits: one token bucket per principal.

A principal may make `requests_per_s` calls per second on average and up to
`requests_per_s * burst_s` in a burst (a bucket that starts full). 0 means unlimited.
The clock is passed in (monotonic seconds) so tests need not sleep.

With bulk read workers (cacheserver.transport.bulk.readworker), the server and its
worker processes draw from the same buckets: `SharedBuckets` keeps one bucket per
principal in shared memory (a memfd the workers inherit), updated under a record lock on
its bytes, so a principal's rate holds across every process that serves it.
CLOCK_MONOTONIC is one clock for every process on the host. The table has spare slots:
a live reload gives each principal it adds one (`SharedBuckets.assign`) and sends the
workers the new names, so an added principal's rate holds across processes too.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from kvcommon.errors import ResourceExhausted
from policy.identity import Principal

log = logging.getLogger(__name__)
DEFAULT_REQUESTS_PER_S = 5000
DEFAULT_BURST_S = 2


@dataclass
class TokenBucket:
    rate_per_s: float
    capacity: float
    tokens: float
    updated_s: float
    limited: bool = False  # the last call was refused (an audit record per episode)

    def take(self, now_s: float) -> bool:
        elapsed = max(0.0, now_s - self.updated_s)
        self.tokens = min(self.capacity, self.tokens + elapsed * self.rate_per_s)
        self.updated_s = now_s
        if self.tokens >= 1.0:
            self.tokens -= 1.0
            return True
        return False


# One shared bucket: tokens, last update (monotonic s), started (0: never drawn from),
# limited (the last draw was refused).
_SLOT = struct.Struct("<ddBB6x")


# Spare slots a live reload gives to the principals it adds: at least this many, or as
# many as the config started with (24 bytes each).
SPARE_SLOTS = 1024


class SharedBuckets:
    """One token bucket per principal in memory that several processes map: the server
    makes it (`names`: the principals, in the order their slots take, and room for
    `spare` more) and passes its descriptor (`fd`) to each bulk worker, which maps it
    with `attach`. Each draw locks its bucket's bytes (fcntl record locks: between
    processes) and a thread lock (record locks do not exclude threads of one process).
    `slots` (name -> slot) is replaced whole, never changed in place (`assign`)."""

    def __init__(self, names: Sequence[str], spare: int | None = None) -> None:
        self.slots = {name: index for index, name in enumerate(sorted(set(names)))}
        self.capacity = len(self.slots) + (
            max(SPARE_SLOTS, len(self.slots)) if spare is None else spare
        )
        self.fd = os.memfd_create("kvshare-rate-buckets", os.MFD_CLOEXEC)
        size = max(1, self.capacity) * _SLOT.size
        os.ftruncate(self.fd, size)
        self._map = mmap.mmap(self.fd, size)
        self._lock = threading.Lock()

    def assign(self, names: Iterable[str]) -> dict[str, int]:
        """The slots for the principals a live reload leaves (the server's side): each
        name kept keeps its slot (and its bucket), a removed one's slot is free, and each
        added one takes a free slot, emptied first (its bucket starts full). A name past
        the spare slots keeps a bucket per process (logged). Returns the new table, for
        the workers (`slots` is replaced whole)."""
        wanted = sorted(set(names))
        kept = {name: slot for name, slot in self.slots.items() if name in set(wanted)}
        free = sorted(set(range(self.capacity)) - set(kept.values()), reverse=True)
        slots = dict(kept)
        for name in wanted:
            if name in slots:
                continue
            if not free:
                log.warning(
                    "the shared rate table is full (%d slots): principal %r gets a rate "
                    "bucket per serving process until a restart",
                    self.capacity,
                    name,
                )
                continue
            slot = free.pop()
            self._empty(slot)
            slots[name] = slot
        self.slots = slots
        return dict(slots)

    def _empty(self, slot: int) -> None:
        offset = slot * _SLOT.size
        with self._lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, _SLOT.size, offset)
            try:
                _SLOT.pack_into(self._map, offset, 0.0, 0.0, 0, 0)
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, _SLOT.size, offset)

    @classmethod
    def attach(cls, fd: int, slots: dict[str, int]) -> SharedBuckets:
        """The buckets a server made, in a worker that inherited `fd`."""
        buckets = cls.__new__(cls)
        buckets.slots = dict(slots)
        buckets.fd = fd
        size = os.fstat(fd).st_size
        buckets.capacity = size // _SLOT.size
        buckets._map = mmap.mmap(fd, size)
        buckets._lock = threading.Lock()
        return buckets

    def take(
        self,
        name: str,
        rate_per_s: float,
        capacity: float,
        now_s: float,
        *,
        note_refusal: bool = True,
    ) -> bool | None:
        """Draw one request from `name`'s bucket: True (taken), False (refused, and the
        last draw was taken: the first refusal of an episode), None (refused again).
        `note_refusal=False`: a refusal leaves the episode as it was, for whoever answers
        the request to note (and audit)."""
        return self.take_slot(
            self.slots[name], rate_per_s, capacity, now_s, note_refusal=note_refusal
        )

    def take_slot(
        self,
        slot: int,
        rate_per_s: float,
        capacity: float,
        now_s: float,
        *,
        note_refusal: bool = True,
    ) -> bool | None:
        """`take` from the bucket in `slot`."""
        offset = slot * _SLOT.size
        with self._lock:
            fcntl.lockf(self.fd, fcntl.LOCK_EX, _SLOT.size, offset)
            try:
                tokens, updated_s, started, limited = _SLOT.unpack_from(self._map, offset)
                bucket = TokenBucket(rate_per_s, capacity, tokens, updated_s, bool(limited))
                if not started:
                    bucket.tokens, bucket.updated_s = capacity, now_s
                taken = bucket.take(now_s)
                first_refusal = not taken and not bucket.limited
                limited = not taken if note_refusal or taken else bucket.limited
                _SLOT.pack_into(self._map, offset, bucket.tokens, bucket.updated_s, 1, limited)
            finally:
                fcntl.lockf(self.fd, fcntl.LOCK_UN, _SLOT.size, offset)
        if taken:
            return True
        return False if first_refusal else None


class RequestRateLimiter:
    def __init__(
        self,
        default_requests_per_s: int = DEFAULT_REQUESTS_PER_S,
        burst_s: int = DEFAULT_BURST_S,
        *,
        clock: Callable[[], float] = time.monotonic,
        shared: SharedBuckets | None = None,
    ) -> None:
        """`shared`: draw the named principals' requests from buckets in shared memory
        (the server and its bulk workers); others keep buckets of this process's own."""
        self.default_requests_per_s = default_requests_per_s
        self.burst_s = max(1, burst_s)
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()
        self.shared = shared

    def set_defaults(self, requests_per_s: int, burst_s: int) -> None:
        """New `[limits]` (a live reload): each bucket takes its rate on its next draw."""
        with self._lock:
            self.default_requests_per_s = requests_per_s
            self.burst_s = max(1, burst_s)

    def rate_of(self, principal: Principal) -> int:
        if principal.requests_per_s is not None:
            return principal.requests_per_s
        return self.default_requests_per_s

    def admit(self, principal: Principal) -> None:
        """Take one request from the principal's bucket, or raise RateLimited.

        `RateLimited.first_in_episode` marks the first refusal after accepted calls, so
        a flood costs one audit record, not one per refused call.
        """
        taken = self._draw(principal, note_refusal=True)
        if not taken:
            raise RateLimited(principal.name, self.rate_of(principal), taken is False)

    def try_admit(self, principal: Principal) -> bool:
        """Take one request from the principal's bucket if it holds one. A refusal is not
        noted: a bulk worker hands the request to the server, whose `admit` refuses it
        and so starts (and audits) the episode."""
        return bool(self._draw(principal, note_refusal=False))

    def _draw(self, principal: Principal, *, note_refusal: bool) -> bool | None:
        """True (taken), False (the first refusal of an episode), None (refused again)."""
        rate = self.rate_of(principal)
        if rate <= 0:
            return True
        now = self._clock()
        shared = self.shared
        slot = shared.slots.get(principal.name) if shared is not None else None
        if shared is not None and slot is not None:
            capacity = self._capacity(rate)
            return shared.take_slot(slot, float(rate), capacity, now, note_refusal=note_refusal)
        with self._lock:
            bucket = self._buckets.get(principal.name)
            if bucket is None:
                capacity = self._capacity(rate)
                bucket = TokenBucket(float(rate), capacity, capacity, now)
                self._buckets[principal.name] = bucket
            elif bucket.rate_per_s != rate or bucket.capacity != self._capacity(rate):
                # The rate changed (a live reload): what the bucket holds stays, within
                # the new capacity.
                bucket.rate_per_s, bucket.capacity = float(rate), self._capacity(rate)
                bucket.tokens = min(bucket.tokens, bucket.capacity)
            if bucket.take(now):
                bucket.limited = False
                return True
            first = not bucket.limited
            bucket.limited = bucket.limited or note_refusal
        return False if first else None

    def _capacity(self, rate: int) -> float:
        return float(max(1, rate * self.burst_s))


class RateLimited(ResourceExhausted):
    def __init__(self, name: str, requests_per_s: int, first_in_episode: bool) -> None:
        super().__init__(
            f"principal {name!r} is over its rate of {requests_per_s} requests/s; slow down, "
            "batch digests into fewer calls, or raise requests_per_s on its [[principals]] "
            "entry (or [limits] requests_per_s)"
        )
        self.principal_name = name
        self.first_in_episode = first_in_episode
