"""The writer's backlog bound, in total and per tenant, so one tenant's slow or held
puts cannot take all of it (docs/isolation.md)."""

from __future__ import annotations

import threading
import time

import pytest

from cacheserver.events import NoEvents
from cacheserver.store.backlog import WriteBacklog
from kvcommon import handoff
from kvcommon.errors import ResourceExhausted
from policy.types import TenantId

A, B, C = TenantId("a"), TenantId("b"), TenantId("c")


def backlog(max_bytes: int = 100, share: int = 0) -> WriteBacklog:
    return WriteBacklog(max_bytes, NoEvents(), hurry=lambda: None, max_tenant_bytes=share)


def test_one_tenant_takes_at_most_its_share_and_others_still_get_theirs() -> None:
    """Two held 16 MiB puts of one tenant used to fill the whole bound for everyone."""
    bound = backlog()  # share: half
    bound.reserve(A, 40, 0.0)
    with pytest.raises(ResourceExhausted, match="its share"):
        bound.reserve(A, 40, 0.0)
    bound.reserve(B, 50, 0.0)  # another tenant is not refused
    with pytest.raises(ResourceExhausted, match="max_pending_write_bytes is 100"):
        bound.reserve(C, 20, 0.0)  # the total bound still holds
    bound.release(A, 40)
    bound.reserve(A, 40, 0.0)  # room again once released


def test_a_block_bigger_than_the_share_is_taken_when_the_tenant_holds_nothing() -> None:
    bound = backlog(share=10)
    bound.reserve(A, 60, 0.0)  # one block, bigger than the share: never refused for ever
    with pytest.raises(ResourceExhausted, match="its share"):
        bound.reserve(A, 1, 0.0)
    with pytest.raises(ResourceExhausted, match="max_pending_write_bytes"):
        bound.reserve(B, 101, 0.0)  # nothing bigger than the whole bound


def test_landed_bytes_may_pass_the_share_while_no_other_tenant_waits() -> None:
    """A tenant alone absorbs a burst in the whole bound (journaled puts acknowledged,
    waiting for the drain); what is still arriving stays within its share."""
    bound = backlog()  # share: 50
    bound.reserve(A, 40, 0.0)
    bound.landed(A, 40)
    bound.reserve(A, 40, 0.0)  # 80 held, 40 arriving: taken
    with pytest.raises(ResourceExhausted, match="its share"):
        bound.reserve(A, 20, 0.0)  # 60 arriving would pass the share
    bound.landed(A, 40)
    bound.reserve(A, 20, 0.0)  # 100 held: the total bound is the limit
    with pytest.raises(ResourceExhausted, match="max_pending_write_bytes is 100"):
        bound.reserve(B, 1, 0.0)


def test_a_waiting_tenant_gets_room_before_a_tenant_over_its_share() -> None:
    hurried = threading.Event()
    bound = WriteBacklog(100, NoEvents(), hurry=hurried.set)
    bound.reserve(A, 80, 0.0)
    bound.landed(A, 80)  # over its share of 50, landed: waiting for the drain
    outcome: list[str] = []

    def b_puts() -> None:
        bound.reserve(B, 30, 5.0)  # 110 > 100: waits for room
        outcome.append("b")

    waiter = threading.Thread(target=b_puts)
    waiter.start()
    assert hurried.wait(5)  # the writer is asked to drain at once
    deadline = time.monotonic() + 5
    while not bound.has_waiters and time.monotonic() < deadline:
        time.sleep(0.01)
    assert bound.has_waiters
    with pytest.raises(ResourceExhausted, match="its share"):
        bound.reserve(A, 10, 0.0)  # there would be room, but B waits and A is over
    bound.release(A, 40, landed=True)  # the drain wrote 40 of A's bytes
    waiter.join(5)
    assert outcome == ["b"] and not bound.has_waiters
    bound.reserve(A, 10, 0.0)  # nobody waits any more


def test_a_put_about_to_wait_for_room_first_lets_its_thread_hand_off() -> None:
    """The bulk ready loop's thread serves other connections: a put that will wait for
    backlog room calls its hand-off hook first (kvcommon.handoff), once; a put that
    fits calls nothing (the positive control)."""
    bound = backlog(max_bytes=100, share=100)
    calls: list[str] = []
    with handoff.hands_off(lambda: calls.append("handed off")):
        bound.reserve(A, 60, 0.0)  # fits: no wait
        assert calls == []
        threading.Timer(0.05, bound.release, (A, 60)).start()
        bound.reserve(B, 60, 5.0)  # waits for A's bytes to land
        assert calls == ["handed off"]
        assert not handoff.armed()  # once only
