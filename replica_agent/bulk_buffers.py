"""A bulk connection's receive buffers: where the blocks of a reply land.

Page-aligned anonymous mappings that grow to the largest reply seen and are kept, so
steady-state transfers touch no fresh memory (a fresh buffer per call caps near
1 GB/s on these machines: PERF-BASELINES). Used by every kind of bulk connection
(replica_agent.bulk_connect), the sealed-payload channel's included
(replica_agent.bulk_sealed).
"""

from __future__ import annotations

import contextlib
import mmap

PAGE = mmap.PAGESIZE
FIRST_BUFFER_BYTES = 1 << 20


class Buffers:
    """A connection's receive buffers (anonymous, page-aligned mappings, kept).

    `take(size)` hands out where the next block lands: at the start of the first
    buffer when only the latest block must stay valid (`keep=False`), else after the
    blocks taken since `reset`, in a further buffer when this one is full — existing
    buffers are never resized, so views handed out stay valid until the next `reset`."""

    def __init__(self) -> None:
        self._maps = [mmap.mmap(-1, FIRST_BUFFER_BYTES)]
        self._index = 0
        self._offset = 0

    def reset(self) -> None:
        self._index = self._offset = 0

    def take(self, size: int, *, keep: bool) -> memoryview:
        if not keep:
            self._replace_if_smaller(0, size)
            return memoryview(self._maps[0])[:size]
        if self._offset + size > len(self._maps[self._index]):
            self._index, self._offset = self._index + 1, 0
            if self._index == len(self._maps):
                grown = max(size, 2 * len(self._maps[-1]))
                self._maps.append(mmap.mmap(-1, _pages(grown)))
            else:
                self._replace_if_smaller(self._index, size)
        start = self._offset
        # The next block starts on a page boundary (`_pages`, written out: every block).
        self._offset = (start + size + PAGE - 1) // PAGE * PAGE
        return memoryview(self._maps[self._index])[start : start + size]

    def _replace_if_smaller(self, index: int, size: int) -> None:
        if len(self._maps[index]) < size:
            old, self._maps[index] = self._maps[index], mmap.mmap(-1, _pages(size))
            with contextlib.suppress(BufferError):  # views still held: freed with them
                old.close()

    def close(self) -> None:
        for mapping in self._maps:
            with contextlib.suppress(BufferError):
                mapping.close()


def _pages(size: int) -> int:
    return (size + PAGE - 1) // PAGE * PAGE
