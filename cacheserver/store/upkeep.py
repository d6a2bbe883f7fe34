"""The store's background threads besides the writer: the periodic fsync of LMDB and the
journal's page prefaulter.

Invariant: background work takes only the CPU that serving leaves (nice 19, per
thread) and never holds the store's lock; each thread ends when `closing` is set.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable

from cacheserver.store.journal.space import RingSpace
from cacheserver.tiers.lmdb.tier import LmdbTier

log = logging.getLogger(__name__)


def lower_this_threads_priority() -> None:
    """Give the calling thread the lowest CPU priority (nice 19, Linux: per thread).

    Used by the writer when puts are journaled (they are acknowledged already, so moving
    them into LMDB should take only CPU time that serving connections leaves; when the
    journal fills, puts wait, and the CPU is the writer's) and by the threads here."""
    with contextlib.suppress(OSError, AttributeError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)


def start_syncer(disk: LmdbTier, interval_s: float, closing: threading.Event) -> threading.Thread:
    """Bound what a power loss can take when commits are not fsynced one by one."""

    def sync_loop() -> None:
        lower_this_threads_priority()
        while not closing.wait(interval_s):
            try:
                disk.sync()
            except Exception:  # a failing disk shows in the next commit; keep trying
                log.exception("periodic fsync failed")

    thread = threading.Thread(target=sync_loop, name="kvshare-fsync", daemon=True)
    thread.start()
    return thread


# The prefaulter makes pages while puts come: within PUTS_COMING_S of the last record
# reserved. Otherwise (puts paused, reads being served) it waits for the store to be
# quiet for the writer's `drain_idle_s`: zeroing pages up to PREFAULT_AHEAD_BYTES ahead
# took 50-100 ms of CPU in each 2 MiB GET cell that followed a PUT cell (two hosts,
# 4 clients, 2 cores), time the reads' sends had to share.
PUTS_COMING_S = 0.05


def prefault_wait_s(now: float, last_reserved: float, last_activity: float, idle_s: float) -> float:
    """How long the prefaulter should wait before making the next chunk of pages: 0
    while puts come (a record reserved within PUTS_COMING_S) or once requests paused
    `idle_s`; else until they will have, if nothing changes meanwhile."""
    if now - last_reserved <= PUTS_COMING_S:
        return 0.0
    return max(0.0, idle_s - (now - last_activity))


def start_prefaulter(
    space: RingSpace,
    closing: threading.Event,
    last_activity: Callable[[], float],
    idle_s: float,
) -> threading.Thread:
    """Keep the journal's pages made ahead of its use (RingSpace.prefault), with the CPU
    that serving leaves (a put that overtakes it makes its own pages): while puts come,
    or when requests (`last_activity`, monotonic seconds) paused for `idle_s`."""

    def prefault_loop() -> None:
        lower_this_threads_priority()
        while not closing.is_set():
            now = time.monotonic()
            wait_s = prefault_wait_s(now, space.last_reserved, last_activity(), idle_s)
            if wait_s > 0:
                space.prefault_wanted.wait(wait_s)  # a put (or close) wakes it sooner
                space.prefault_wanted.clear()
            elif not space.prefault():
                space.prefault_wanted.wait()
                space.prefault_wanted.clear()

    thread = threading.Thread(target=prefault_loop, name="kvshare-prefault", daemon=True)
    thread.start()
    return thread
