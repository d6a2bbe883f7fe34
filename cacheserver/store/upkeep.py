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


def start_prefaulter(space: RingSpace, closing: threading.Event) -> threading.Thread:
    """Keep the journal's pages made ahead of its use (RingSpace.prefault), with the CPU
    that serving leaves (a put that overtakes it makes its own pages)."""

    def prefault_loop() -> None:
        lower_this_threads_priority()
        while not closing.is_set():
            if not space.prefault():
                space.prefault_wanted.wait()
                space.prefault_wanted.clear()

    thread = threading.Thread(target=prefault_loop, name="kvshare-prefault", daemon=True)
    thread.start()
    return thread
