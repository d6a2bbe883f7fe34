"""The put journal's file space: taken ahead of use, so that no record is handed out
where the file system cannot back it.

The ring is a memory-backed file mapped whole; touching a page of the mapping that
tmpfs cannot back kills the server with SIGBUS. So the file's space is taken before
records use it: pages made in the background by the prefaulter (`prefault`, run by
`cacheserver.store.upkeep`), or, where a reservation overtakes it, the file's blocks
reserved at once (`take`, which raises OSError when the file system is full: the
ring refuses that put). The state here shares the ring's lock (`Journal._lock`).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
import time

from cacheserver.store.journal.files import fallocate_in_steps, give_back, populate

# Pages are made a chunk at a time. The kernel holds the process's memory-map lock
# (for reading) while it makes a chunk, and anything in the process that maps memory
# meanwhile (the allocator, for one) waits for it, and every page fault behind that;
# the prefaulter runs at nice 19, so on a busy host it may hold the lock, preempted,
# for milliseconds. Bursts of 4,096 64 KiB puts from 4 clients (loopback), p50 / p99:
# 32 MiB chunks ~0.5 / 2.5-3.3 ms, 2 MiB 0.46-0.52 / 1.8-2.2, 1 MiB 0.48-0.53 /
# 1.6-2.3, 512 KiB 0.53-0.58 / 1.2-1.6, 256 KiB 0.57-0.65 / 1.2-1.6 (the more calls,
# the more the thread takes the GIL); no prefaulter at all 0.62-0.65 / 1.3-1.5. Two
# hosts (`kvshare bench`, 2 runs each), PUT p99 / p50 at 1 / 4 / 16 clients: 2 MiB
# 6.8-7.4x / 3.8-4.1x / 2.9-3.1x, 512 KiB 2.6-2.9x / 3.1-3.6x / 2.4-2.8x.
PREFAULT_CHUNK_BYTES = 512 << 10
PREFAULT_AHEAD_BYTES = 128 << 20  # how far ahead of use the ring's pages are made


class RingSpace:
    """The file space of one journal's ring (`fd`, mapped as `mapping`), from `start`
    (the first record's offset, DATA_START) to `capacity`. `changed` is the ring's
    condition: its lock guards the state here, and it is notified when the
    prefaulter stops."""

    def __init__(
        self,
        fd: int,
        mapping: mmap.mmap,
        start: int,
        capacity: int,
        changed: threading.Condition,
    ) -> None:
        self._fd = fd
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self._capacity = capacity
        self._changed = changed
        # The file's space is taken up to here (pages made by the prefaulter, or blocks
        # reserved by fallocate): touching a page of the mapping past what tmpfs can
        # back would kill the server with SIGBUS, so no record is handed out beyond it.
        self._allocated = start
        self._furthest = start  # the end of the furthest record reserved yet
        # When the last record was reserved (monotonic seconds): the prefaulter makes
        # pages while puts come, and otherwise only when the store is quiet (upkeep).
        self.last_reserved = time.monotonic()
        self._prefaulting = False  # `prefault` is making pages (outside the lock)
        self.prefault_wanted = threading.Event()
        self.prefault_wanted.set()
        self._closed = False

    @property
    def made_to(self) -> int:
        """The offset up to which the file's space is taken (pages made or reserved)."""
        return self._allocated

    def take(self, end: int) -> None:
        """A record is reserved up to `end` (under the ring's lock): the file's blocks
        up to it are reserved now where the prefaulter has not made them yet (raises
        OSError when the file system is full), and the prefaulter is asked for more
        when it is less than `PREFAULT_AHEAD_BYTES` ahead."""
        self.last_reserved = time.monotonic()
        if end > self._allocated:
            self._allocate(end)
        if end > self._furthest:
            self._furthest = end
            if self._allocated < min(self._capacity, end + PREFAULT_AHEAD_BYTES):
                self.prefault_wanted.set()

    def _allocate(self, end: int) -> None:
        """Reserve the file's blocks up to `end` (under the lock). Usually the
        prefaulter got there first; this covers what it has not."""
        end = min(self._capacity, end + -end % mmap.PAGESIZE)  # whole pages: see prefault
        os.posix_fallocate(self._fd, self._allocated, end - self._allocated)
        self._allocated = end

    def prefault(self, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> bool:
        """Reserve and map the next chunk of the ring, while it is less than
        `PREFAULT_AHEAD_BYTES` ahead of the furthest record yet (a first touch of a page
        costs ~4x the copy into it), without holding the lock meanwhile (`close` waits
        for it). Never changes bytes. Returns whether it did work; `prefault_wanted` is
        set when more is wanted."""
        with self._changed:
            limit = min(self._capacity, self._furthest + PREFAULT_AHEAD_BYTES)
            if self._closed or self._allocated >= limit:
                return False
            # Whole chunks from a page boundary (`_allocated` always is one, but for the
            # first, DATA_START, on a kernel with pages larger than 4 KiB): madvise
            # refuses a start inside a page.
            start = self._allocated
            end = min(self._capacity, start + chunk_bytes)
            self._prefaulting = True
        try:
            return self._make_pages(start, end)
        finally:
            with self._changed:
                self._prefaulting = False
                self._changed.notify_all()

    def _make_pages(self, start: int, end: int) -> bool:
        # Pages made ahead take the file system's space as fallocate would, without
        # the file's lock: fallocate holds it while it works, and a put's header write
        # (pwrite) waits behind it; with this thread at nice 19 on a busy host that wait
        # made the puts' tail. Measured with 4 clients of 64 KiB puts on 2 cores, the
        # same throughput: p50 / p99 0.50-0.53 / 4.5-6.0 ms with fallocate, 0.58-0.62 /
        # 2.1-2.6 ms with pages made here.
        page_start = start - start % mmap.PAGESIZE
        made = populate(self._base + page_start, end - page_start)
        if made is None:  # a kernel before 5.14: reserve the blocks, pages come on touch
            try:
                fallocate_in_steps(self._fd, start, end)
            except OSError:
                return False  # tmpfs is full: reserve() refuses what does not fit
        elif not made:
            with self._changed:  # tmpfs is full: what was made past the records goes back
                give_back(self._fd, self._allocated, end - self._allocated)
            return False  # reserve() refuses what does not fit
        with self._changed:
            self._allocated = max(self._allocated, end)
        return True

    def close(self) -> None:
        """No more pages are made; waits for the prefaulter to stop (it uses the mapping
        and the descriptor). Under the ring's lock."""
        self._closed = True
        self.prefault_wanted.set()
        while self._prefaulting:
            self._changed.wait()
