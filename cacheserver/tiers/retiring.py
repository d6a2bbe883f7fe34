"""Blocks on their way out of LMDB: dropped from the index, their delete not yet committed.

The server's index drops a block the moment a put evicts it, but with puts journaled
the block leaves LMDB only when that put is drained into it, which under load can be
seconds later. The server never reads such a block (its reads go through the index);
a bulk worker reads LMDB directly, and without this table would serve it meanwhile.

So the server counts, per slot of a shared table, the keys it has retired (`retire`:
evicted from the index, called under the store's lock as the eviction is planned) and
takes each count back once the LMDB commit that deletes the key has succeeded
(`settled`). A worker asks `any_retiring(keys)` before it opens its read transaction:
a key whose slot counts anything is handed back to the server, which answers from its
index. The check comes first so that a delete committed after it is already in the
transaction's snapshot; an eviction that happens after it is concurrent with the read.

A slot is the storage key's first bytes (keys are HMAC outputs, uniform): two keys may
share one, and then a live block is handed back until the other's delete commits (a
hand-back, never a wrong answer). A count is never taken back without its delete, so
one whose commit failed (the index lists the block again) only costs hand-backs.

The table is a file beside LMDB's lock file, mapped by the server (read-write) and by
every worker (read-only); the server makes a fresh one at each start (a rename: a
worker of a previous server still mapping the old one is not disturbed).
"""

from __future__ import annotations

import mmap
import os
import threading
from collections.abc import Iterable
from pathlib import Path

RETIRING_FILE = "retiring"
# 2^18 four-byte counts: 1 MiB, its pages made as keys land in them. With 10,000 keys
# awaiting their delete, a live key shares a slot with one of them 4% of the time.
RETIRING_SLOTS = 1 << 18
_SLOT_MASK = RETIRING_SLOTS - 1
_BYTES = RETIRING_SLOTS * 4


def _slot(key: bytes) -> int:
    return int.from_bytes(key[:4], "little") & _SLOT_MASK


class RetiringKeys:
    """The server's side: counts retired keys until their LMDB delete commits."""

    def __init__(self, directory: Path) -> None:
        path = directory / RETIRING_FILE
        fresh = path.with_name(RETIRING_FILE + ".new")
        fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fd, _BYTES)
            self._map = mmap.mmap(fd, _BYTES, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        fresh.replace(path)
        self._counts = memoryview(self._map).cast("I")
        self._lock = threading.Lock()  # retired under the store's lock, settled by the writer

    def retire(self, key: bytes) -> None:
        """The index no longer lists `key`; a later commit deletes it from LMDB."""
        slot = _slot(key)
        with self._lock:
            self._counts[slot] += 1

    def settled(self, keys: Iterable[bytes]) -> None:
        """A commit that deleted `keys` from LMDB succeeded."""
        with self._lock:
            for key in keys:
                slot = _slot(key)
                if self._counts[slot]:
                    self._counts[slot] -= 1

    def any_retiring(self, keys: Iterable[bytes]) -> bool:
        counts = self._counts
        return any(counts[_slot(key)] for key in keys)

    def close(self) -> None:
        self._counts.release()
        self._map.close()


class RetiringView:
    """A worker's side: which keys the server has retired (read-only)."""

    def __init__(self, directory: Path) -> None:
        fd = os.open(directory / RETIRING_FILE, os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._map = mmap.mmap(fd, _BYTES, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._counts = memoryview(self._map).cast("I")

    def any_retiring(self, keys: Iterable[bytes]) -> bool:
        """Whether any of `keys` may be a block the index no longer lists."""
        counts = self._counts
        return any(counts[_slot(key)] for key in keys)

    def close(self) -> None:
        self._counts.release()
        self._map.close()
