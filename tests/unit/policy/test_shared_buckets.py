"""Shared rate buckets (policy.ratelimit.SharedBuckets): the server and its bulk
workers draw a principal's requests from one bucket, in shared memory."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from policy.identity import Principal
from policy.ratelimit import RateLimited, RequestRateLimiter, SharedBuckets
from policy.types import TenantId


class Clock:
    def __init__(self) -> None:
        self.now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def principal(name: str) -> Principal:
    return Principal(name, frozenset({TenantId("alpha")}), frozenset())


def test_two_limiters_on_one_shared_bucket_admit_one_rate() -> None:
    clock = Clock()
    buckets = SharedBuckets(["a", "b"])
    one = RequestRateLimiter(10, burst_s=1, clock=clock, shared=buckets)
    two = RequestRateLimiter(
        10, burst_s=1, clock=clock, shared=SharedBuckets.attach(buckets.fd, buckets.slots)
    )
    for turn in range(10):  # a full bucket of 10, drawn from both
        (one if turn % 2 else two).admit(principal("a"))
    with pytest.raises(RateLimited) as first:
        one.admit(principal("a"))
    assert first.value.first_in_episode
    with pytest.raises(RateLimited) as again:
        two.admit(principal("a"))
    assert not again.value.first_in_episode  # one audit record per episode, across both
    two.admit(principal("b"))  # control: another principal's bucket is its own
    clock.now_s += 0.1  # one request refills
    two.admit(principal("a"))
    with pytest.raises(RateLimited):
        one.admit(principal("a"))


def test_a_principal_without_a_slot_keeps_a_bucket_of_its_own() -> None:
    limiter = RequestRateLimiter(1, burst_s=1, clock=Clock(), shared=SharedBuckets(["a"]))
    limiter.admit(principal("stranger"))
    with pytest.raises(RateLimited):
        limiter.admit(principal("stranger"))


def test_another_process_draws_from_the_same_bucket() -> None:
    buckets = SharedBuckets(["a"])
    child = f"""
import json, sys, time
from policy.ratelimit import SharedBuckets
buckets = SharedBuckets.attach({buckets.fd}, json.loads(sys.argv[1]))
print(sum(bool(buckets.take("a", 1.0, 5.0, time.monotonic())) for _ in range(3)))
"""
    run = subprocess.run(
        [sys.executable, "-c", child, json.dumps(buckets.slots)],
        pass_fds=(buckets.fd,),
        capture_output=True,
        text=True,
        check=True,
    )
    assert run.stdout.strip() == "3"
    import time

    taken = [buckets.take("a", 1.0, 5.0, time.monotonic()) for _ in range(3)]
    assert taken[:2] == [True, True]  # 5 in the bucket, 3 drawn by the other process
    assert taken[2] is False  # so the third here is refused


@pytest.mark.parametrize("shared", [False, True], ids=["local", "shared"])
def test_try_admit_leaves_a_refusal_for_admit_to_note(shared: bool) -> None:
    clock = Clock()
    buckets = SharedBuckets(["a"]) if shared else None
    limiter = RequestRateLimiter(2, burst_s=1, clock=clock, shared=buckets)
    assert limiter.try_admit(principal("a")) and limiter.try_admit(principal("a"))
    assert not limiter.try_admit(principal("a"))  # empty: refused, not noted
    with pytest.raises(RateLimited) as first:
        limiter.admit(principal("a"))
    assert first.value.first_in_episode  # so the server's refusal still starts the episode
    assert not limiter.try_admit(principal("a"))
    with pytest.raises(RateLimited) as again:
        limiter.admit(principal("a"))
    assert not again.value.first_in_episode
