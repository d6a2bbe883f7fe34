"""`BlockStore(drain_within_s=...)`: with bulk workers, while they hand reads back,
journaled puts reach LMDB soon even while requests never pause (the writer otherwise
waits for a pause); puts alone still wait for one."""

from __future__ import annotations

import time
from pathlib import Path

from cacheserver.store import BlockStore
from tests.support.block_store import TAG, A, FillSource, keys, storage

BUSY_S = 1.5


def busy_puts(store: BlockStore, seconds: float, *, reads_handed_back: bool) -> tuple[int, int]:
    """Puts one block after another for `seconds` (the store never idles), with a read
    handed back by a worker after each put if `reads_handed_back`: how many, and how
    many of them were still undrained at the end."""
    end, made = time.monotonic() + seconds, 0
    for key in keys(100000):
        store.put(A, key, TAG, FillSource(b"x" * 4096)).result()
        made += 1
        if reads_handed_back:
            store.reads_handed_back()
        time.sleep(0.002)
        if time.monotonic() > end:
            break
    return made, store.undrained_blocks


def open_busy(tmp_path: Path, within_s: float | None) -> BlockStore:
    config = storage(tmp_path, journaled=True, drain_idle_ms=60_000)
    return BlockStore(tmp_path / "data", config, {}, {A: 0}, drain_within_s=within_s)


def test_puts_reach_lmdb_within_the_bound_while_workers_hand_reads_back(
    tmp_path: Path,
) -> None:
    store = open_busy(tmp_path / "within", 0.05)
    try:
        made, left = busy_puts(store, BUSY_S, reads_handed_back=True)
    finally:
        store.close()
    assert left < made / 2, (made, left)  # only the latest puts wait (about 50 ms of them)


def test_puts_alone_wait_for_a_pause_even_with_the_bound(tmp_path: Path) -> None:
    """No worker asked for a block: draining them as they arrive would only cost CPU."""
    store = open_busy(tmp_path / "puts-alone", 0.05)
    try:
        made, left = busy_puts(store, BUSY_S, reads_handed_back=False)
    finally:
        store.close()
    assert left == made, (made, left)


def test_control_without_the_bound_nothing_drains_while_busy(tmp_path: Path) -> None:
    store = open_busy(tmp_path / "plain", None)
    try:
        made, left = busy_puts(store, BUSY_S, reads_handed_back=True)
    finally:
        store.close()
    assert left == made, (made, left)  # a busy store waits for a pause (drain_idle_ms)
