"""Allocator settings for processes that move multi-megabyte buffers.

glibc serves allocations above M_MMAP_THRESHOLD (128 KiB at start, adapting upwards)
with fresh mmaps and returns freed heap tops past M_TRIM_THRESHOLD to the kernel; each
fresh page then costs a fault on first touch (~4 µs per 4 KiB page measured here), which
caps a path that allocates per request near 1 GB/s (docs/design.md §12). Raising both
keeps freed block buffers in the heap for reuse. Process-wide and idempotent: called by
`kvshare serve`, the bench workers and `ReplicaAgent`; harmless where glibc is absent.
"""

from __future__ import annotations

import ctypes
import ctypes.util

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # glibc's maximum on 64-bit: blocks up to 32 MiB reuse heap
TRIM_THRESHOLD_BYTES = 1 << 30

_tuned = False


def tune_allocator() -> bool:
    """Apply the settings once; False when this libc has no mallopt."""
    global _tuned
    if _tuned:
        return True
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    ok = bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and ok
    _tuned = ok
    return ok
