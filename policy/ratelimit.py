"""Per-principal request-rate limits: one token bucket per principal.

A principal may make `requests_per_s` calls per second on average and up to
`requests_per_s * burst_s` in a burst (a bucket that starts full). 0 means unlimited.
The clock is passed in (monotonic seconds) so tests need not sleep.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvcommon.errors import ResourceExhausted
from policy.identity import Principal

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


class RequestRateLimiter:
    def __init__(
        self,
        default_requests_per_s: int = DEFAULT_REQUESTS_PER_S,
        burst_s: int = DEFAULT_BURST_S,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.default_requests_per_s = default_requests_per_s
        self.burst_s = max(1, burst_s)
        self._clock = clock
        self._buckets: dict[str, TokenBucket] = {}
        self._lock = threading.Lock()

    def rate_of(self, principal: Principal) -> int:
        if principal.requests_per_s is not None:
            return principal.requests_per_s
        return self.default_requests_per_s

    def admit(self, principal: Principal) -> None:
        """Take one request from the principal's bucket, or raise RateLimited.

        `RateLimited.first_in_episode` marks the first refusal after accepted calls, so
        a flood costs one audit record, not one per refused call.
        """
        rate = self.rate_of(principal)
        if rate <= 0:
            return
        now = self._clock()
        with self._lock:
            bucket = self._buckets.get(principal.name)
            if bucket is None:
                capacity = float(max(1, rate * self.burst_s))
                bucket = TokenBucket(float(rate), capacity, capacity, now)
                self._buckets[principal.name] = bucket
            if bucket.take(now):
                bucket.limited = False
                return
            first = not bucket.limited
            bucket.limited = True
        raise RateLimited(principal.name, rate, first)


class RateLimited(ResourceExhausted):
    def __init__(self, name: str, requests_per_s: int, first_in_episode: bool) -> None:
        super().__init__(
            f"principal {name!r} is over its rate of {requests_per_s} requests/s; slow down, "
            "batch digests into fewer calls, or raise requests_per_s on its [[principals]] "
            "entry (or [limits] requests_per_s)"
        )
        self.principal_name = name
        self.first_in_episode = first_in_episode
