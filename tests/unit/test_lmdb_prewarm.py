"""LMDB file prewarming: zero-fills only space no transaction owns, never stored data."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from cacheserver.lmdb_tier import LmdbTier, PendingWrite
from policy.types import StorageKey, TenantId

MiB = 1 << 20


def writes(n: int, size: int, clock: int = 0) -> list[PendingWrite]:
    return [
        PendingWrite(StorageKey(os.urandom(32)), TenantId("t"), 0, clock + i, os.urandom(size))
        for i in range(n)
    ]


def test_prewarm_extends_the_file_without_touching_stored_blocks(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, map_bytes=256 * MiB, sync_writes=False)
    first = writes(4, MiB)
    tier.write(first, [])
    before = (tmp_path / "data.mdb").stat().st_size
    while tier.prewarm(32 * MiB):
        pass
    assert (tmp_path / "data.mdb").stat().st_size >= before + 30 * MiB
    later = writes(20, MiB, clock=10)  # land in the zero-filled region
    for w in later:
        tier.write([w], [])
    blocks = first + later
    assert tier.read_many([w.key for w in blocks]) == [bytes(w.payload) for w in blocks]
    assert tier.integrity_failures == 0
    tier.close()


def test_prewarm_stops_at_the_map_size(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, map_bytes=16 * MiB, sync_writes=False)
    while tier.prewarm(1 << 30):
        pass
    assert (tmp_path / "data.mdb").stat().st_size <= 16 * MiB
    tier.close()


def test_prewarm_is_safe_beside_concurrent_write_transactions(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path, map_bytes=512 * MiB, sync_writes=False)
    stored = writes(40, 256 * 1024)
    done = threading.Event()

    def warm() -> None:
        while not done.is_set():
            if not tier.prewarm(64 * MiB, chunk_bytes=256 * 1024):
                tier.prewarm(0)

    warmer = threading.Thread(target=warm)
    warmer.start()
    try:
        for i, w in enumerate(stored):  # commits and deletes race the warmer
            tier.write([w], [])
            if i % 5 == 4:
                tier.delete([stored[i - 4].key])
    finally:
        done.set()
        warmer.join()
    kept = [w for i, w in enumerate(stored) if i % 5 != 0 or i + 4 >= len(stored)]
    assert tier.read_many([w.key for w in kept]) == [bytes(w.payload) for w in kept]
    assert tier.integrity_failures == 0
    tier.close()
