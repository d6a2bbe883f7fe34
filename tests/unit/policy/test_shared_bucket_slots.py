"""The shared rate table's spare slots (policy.ratelimit.SharedBuckets.assign): a live
reload gives each principal it adds a slot every process draws from, keeps the slots
(and buckets) of those it leaves, and frees a removed one's for the next."""

from __future__ import annotations

from policy.identity import Principal
from policy.ratelimit import RateLimited, RequestRateLimiter, SharedBuckets
from policy.types import TenantId


class Clock:
    now_s = 50.0

    def __call__(self) -> float:
        return self.now_s


def principal(name: str) -> Principal:
    return Principal(name, frozenset({TenantId("alpha")}), frozenset())


def drain(limiter: RequestRateLimiter, name: str) -> int:
    """Requests admitted before the first refusal."""
    admitted = 0
    try:
        while admitted < 100:
            limiter.admit(principal(name))
            admitted += 1
    except RateLimited:
        pass
    return admitted


def test_an_added_principal_draws_from_one_bucket_in_every_process() -> None:
    clock = Clock()
    server = SharedBuckets(["a"], spare=2)
    # A worker attached before the reload; the reload's table reaches it in an update.
    worker = SharedBuckets.attach(server.fd, server.slots)
    slots = server.assign(["a", "new"])
    assert set(slots) == {"a", "new"} and slots["a"] == 0
    worker.slots = dict(slots)
    one = RequestRateLimiter(5, burst_s=1, clock=clock, shared=server)
    two = RequestRateLimiter(5, burst_s=1, clock=clock, shared=worker)
    assert drain(one, "new") + drain(two, "new") == 5  # one bucket of 5, not two


def test_a_removed_principals_slot_is_emptied_for_the_next_and_a_full_table_falls_back() -> None:
    clock = Clock()
    buckets = SharedBuckets(["a", "b"], spare=0)
    limiter = RequestRateLimiter(3, burst_s=1, clock=clock, shared=buckets)
    assert drain(limiter, "b") == 3  # b's bucket is empty now
    slot_of_b = buckets.slots["b"]
    slots = buckets.assign(["a", "c"])  # b removed, c added: c takes b's slot, full
    assert slots == {"a": 0, "c": slot_of_b}
    assert drain(limiter, "c") == 3  # emptied first: c's bucket starts full
    assert buckets.assign(["a", "c", "d"]) == {"a": 0, "c": slot_of_b}  # no room for d
    assert drain(limiter, "d") == 3  # d keeps a bucket of this process's own
