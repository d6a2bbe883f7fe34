"""Page-aligned, pre-touched buffers that the harness reuses across requests.

Why: touching fresh memory costs ~4 us per 4 KiB page on these machines, and copies
between buffers whose offsets differ by 16 mod 4096 run ~10x slower (docs/design.md §12).
So every buffer a client sends from or receives into is an anonymous mmap (page
aligned), faulted in once before timing starts, then reused for every request.
"""

from __future__ import annotations

import mmap
import random
import struct

PAGE_BYTES = mmap.PAGESIZE
_STAMP = struct.Struct("<Q")
STAMP_BYTES = _STAMP.size


def aligned_buffer(size_bytes: int) -> mmap.mmap:
    """An anonymous mapping of at least `size_bytes`, every page already faulted in."""
    length = max(size_bytes, 1)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    buffer = mmap.mmap(-1, length, flags=flags)
    # MAP_POPULATE is a hint; writing one byte per page makes the fault-in certain.
    for offset in range(0, length, PAGE_BYTES):
        buffer[offset] = 0
    return buffer


def random_value(size_bytes: int, seed: int) -> mmap.mmap:
    """A page-aligned value of incompressible bytes (one random page, repeated)."""
    buffer = aligned_buffer(size_bytes)
    page = random.Random(seed).randbytes(PAGE_BYTES)
    view = memoryview(buffer)
    for offset in range(0, size_bytes, PAGE_BYTES):
        chunk = min(PAGE_BYTES, size_bytes - offset)
        view[offset : offset + chunk] = page[:chunk]
    view.release()
    return buffer


def stamp(view: memoryview, sequence: int) -> None:
    """Write `sequence` into the first bytes of a value so a GET can tell values apart."""
    if len(view) >= STAMP_BYTES:
        _STAMP.pack_into(view, 0, sequence)


def read_stamp(data: memoryview | bytes) -> int | None:
    """The sequence stamped by `stamp`, or None for values shorter than a stamp."""
    if len(data) < STAMP_BYTES:
        return None
    return int(_STAMP.unpack_from(data, 0)[0])
