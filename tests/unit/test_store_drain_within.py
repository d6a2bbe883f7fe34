"""`BlockStore(drain_within_s=...)`: with bulk workers, journaled puts reach LMDB soon
even while requests never pause (the writer otherwise waits for a pause)."""

from __future__ import annotations

import time
from pathlib import Path

from cacheserver.store import BlockStore
from tests.unit.test_store_facade import TAG, A, FillSource, keys, storage

BUSY_S = 1.5


def busy_puts(store: BlockStore, seconds: float) -> tuple[int, int]:
    """Puts one block after another for `seconds` (the store never idles): how many,
    and how many of them were still undrained at the end."""
    end, made = time.monotonic() + seconds, 0
    for key in keys(100000):
        store.put(A, key, TAG, FillSource(b"x" * 4096)).result()
        made += 1
        time.sleep(0.002)
        if time.monotonic() > end:
            break
    return made, store.undrained_blocks


def open_busy(tmp_path: Path, within_s: float | None) -> BlockStore:
    config = storage(tmp_path, journaled=True, drain_idle_ms=60_000)
    return BlockStore(tmp_path / "data", config, {}, {A: 0}, drain_within_s=within_s)


def test_puts_reach_lmdb_within_the_bound_while_requests_never_pause(tmp_path: Path) -> None:
    store = open_busy(tmp_path / "within", 0.05)
    try:
        made, left = busy_puts(store, BUSY_S)
    finally:
        store.close()
    assert left < made / 2, (made, left)  # only the latest puts wait (about 50 ms of them)


def test_control_without_the_bound_nothing_drains_while_busy(tmp_path: Path) -> None:
    store = open_busy(tmp_path / "plain", None)
    try:
        made, left = busy_puts(store, BUSY_S)
    finally:
        store.close()
    assert left == made, (made, left)  # a busy store waits for a pause (drain_idle_ms)
