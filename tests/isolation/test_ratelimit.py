"""Per-principal request-rate limits: a token bucket per principal, RESOURCE_EXHAUSTED
with a message that says the limit and how to raise it."""

from __future__ import annotations

import os
import time
from pathlib import Path

import grpc
import pytest

from kvcommon.errors import ResourceExhausted
from policy.audit import read_records
from policy.identity import Principal
from policy.ratelimit import RateLimited, RequestRateLimiter
from policy.types import TenantId
from tests.support.isolation import MODEL, isolation_config, serve


class FakeClock:
    def __init__(self) -> None:
        self.now_s = 100.0

    def __call__(self) -> float:
        return self.now_s


def principal(name: str, requests_per_s: int | None = None) -> Principal:
    return Principal(name, frozenset({TenantId("alpha")}), frozenset(), requests_per_s)


def test_the_bucket_allows_a_burst_then_the_rate() -> None:
    clock = FakeClock()
    limiter = RequestRateLimiter(10, burst_s=2, clock=clock)
    p, other = principal("p"), principal("other")
    for _ in range(20):  # a full bucket: 10/s for 2 s
        limiter.admit(p)
    with pytest.raises(RateLimited) as first:
        limiter.admit(p)
    assert first.value.first_in_episode
    with pytest.raises(RateLimited) as second:
        limiter.admit(p)
    assert not second.value.first_in_episode  # one audit record per episode
    limiter.admit(other)  # control: buckets are per principal
    clock.now_s += 0.15  # refills one and a half requests at 10/s
    limiter.admit(p)
    with pytest.raises(RateLimited):
        limiter.admit(p)


def test_overrides_and_unlimited() -> None:
    clock = FakeClock()
    limiter = RequestRateLimiter(1, burst_s=1, clock=clock)
    for _ in range(1000):
        limiter.admit(principal("free", requests_per_s=0))
    limiter.admit(principal("slow"))
    with pytest.raises(RateLimited, match=r"rate of 1 requests/s.*raise requests_per_s"):
        limiter.admit(principal("slow"))
    for _ in range(3):
        limiter.admit(principal("fast", requests_per_s=3))


def test_a_principal_over_its_rate_gets_resource_exhausted(tmp_path: Path) -> None:
    tenancy = isolation_config(tmp_path, extra="[limits]\nrequests_per_s = 5\nrequest_burst_s = 2")
    text = tenancy.path.read_text()
    tenancy.path.write_text(text.replace('name = "b"', 'name = "b"\nrequests_per_s = 0'))
    running = serve(tenancy)
    digest = os.urandom(32)
    try:
        # gRPC only, so each call is exactly one request (the bulk channel adds an
        # OpenBulk per connection; tests/e2e/test_bulk.py covers its counting).
        with running.client("a", bulk=False) as a, running.client("b", bulk=False) as b:
            started = time.monotonic()
            a.put("alpha", MODEL, [digest], [b"x"])
            served = 0
            with pytest.raises(ResourceExhausted) as info:
                while served < 100:
                    assert a.lookup("alpha", MODEL, [digest]) == 1
                    served += 1
            # The rest of a's burst of 10, and no more than the bucket refilled while
            # the calls ran (5 a second: on a busy machine, a few calls' worth).
            refilled = int((time.monotonic() - started) * 5) + 1
            assert 9 <= served <= 9 + refilled
            assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # type: ignore[attr-defined]
            assert "5 requests/s" in str(info.value) and "requests_per_s" in str(info.value)
            for _ in range(50):  # control: b (unlimited) is not slowed by a's limit
                assert b.lookup("beta", MODEL, [digest]) == 0
            time.sleep(0.3)  # refills about 1.5 requests
            assert a.lookup("alpha", MODEL, [digest]) == 1
    finally:
        running.stop()
    limited = [
        r for r in read_records(running.config.audit_log_path) if r["event"] == "rate_limited"
    ]
    assert [(r["principal"], r["requests_per_s"]) for r in limited] == [("a", 5)]
