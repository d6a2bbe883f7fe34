"""The journal's prefaulter makes pages while puts come, and waits while only reads do.

Zeroing the ring's pages ahead of its records is work a put burst needs; after the
burst, while the store serves reads, it took the reads' CPU (issue 37). So the
prefaulter now runs while records are being reserved, or once the store is quiet.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheserver.store.journal import Journal
from cacheserver.store.upkeep import PUTS_COMING_S, prefault_wait_s, start_prefaulter
from policy.types import ModelTag, StorageKey, TenantId

TAG = ModelTag(bytes(range(16)))
SETTLE_S = 0.4  # several PUTS_COMING_S: long past the last put


def test_the_prefaulter_waits_while_reads_come_and_puts_do_not() -> None:
    now = 100.0
    # Puts coming: make pages now, however busy the store is.
    assert prefault_wait_s(now, now - PUTS_COMING_S / 2, now, idle_s=0.1) == 0.0
    # No put lately, a read just now: wait until the store will have been quiet.
    assert prefault_wait_s(now, now - 10, now - 0.03, idle_s=0.1) == pytest.approx(0.07)
    # Quiet long enough: make pages.
    assert prefault_wait_s(now, now - 10, now - 0.2, idle_s=0.1) == 0.0
    # drain_idle_ms = 0: never waits (the behaviour before).
    assert prefault_wait_s(now, now - 10, now, idle_s=0.0) == 0.0


@pytest.fixture
def journal() -> Iterator[Journal]:
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("needs a writable /dev/shm")
    ring = Journal(Path("/dev/shm") / f"kvshare-test-upkeep-{os.getpid()}.journal", 256 << 20)
    try:
        yield ring
    finally:
        ring.close(remove=True)


def _made_more(journal: Journal, than: int, within_s: float = 30.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if journal.space.made_to > than:
            return True
        time.sleep(0.01)
    return False


def test_a_store_serving_reads_makes_no_pages_until_a_put_comes(journal: Journal) -> None:
    closing = threading.Event()
    busy = lambda: time.monotonic()  # noqa: E731 - reads every moment: never quiet
    time.sleep(SETTLE_S)  # the journal was opened (reserved nothing) a while ago
    start = journal.space.made_to
    thread = start_prefaulter(journal.space, closing, busy, idle_s=3600.0)
    try:
        time.sleep(SETTLE_S)
        assert journal.space.made_to == start  # reads only: no pages made meanwhile
        # Positive control: a put comes, and the prefaulter makes pages ahead of it.
        reservation = journal.reserve(StorageKey(bytes(32)), TenantId("t"), 1, TAG, 4096)
        reservation.view[:] = bytes(4096)
        journal.commit(reservation)
        assert _made_more(journal, than=journal.space.made_to)
    finally:
        closing.set()
        journal.space.prefault_wanted.set()
        thread.join(timeout=10)


def test_a_quiet_store_makes_pages_ahead_without_puts(journal: Journal) -> None:
    closing = threading.Event()
    time.sleep(SETTLE_S)
    start = journal.space.made_to
    quiet_since = time.monotonic() - 10
    thread = start_prefaulter(journal.space, closing, lambda: quiet_since, idle_s=0.1)
    try:
        assert _made_more(journal, than=start)
    finally:
        closing.set()
        journal.space.prefault_wanted.set()
        thread.join(timeout=10)
