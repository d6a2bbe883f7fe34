"""The writer's backlog bound, in total and per tenant (issue 15 F4)."""

from __future__ import annotations

import pytest

from cacheserver.events import NoEvents
from cacheserver.store.backlog import WriteBacklog
from kvcommon.errors import ResourceExhausted
from policy.types import TenantId

A, B, C = TenantId("a"), TenantId("b"), TenantId("c")


def backlog(max_bytes: int = 100, share: int = 0) -> WriteBacklog:
    return WriteBacklog(max_bytes, NoEvents(), hurry=lambda: None, max_tenant_bytes=share)


def test_one_tenant_takes_at_most_its_share_and_others_still_get_theirs() -> None:
    """F4: two held 16 MiB puts of one tenant filled the whole bound for everyone."""
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
