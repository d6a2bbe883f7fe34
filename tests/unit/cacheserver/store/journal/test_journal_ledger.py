"""The journal's ledger: ring space held, records done, and how far LMDB covers."""

from __future__ import annotations

from cacheserver.store.journal.format import DATA_START
from cacheserver.store.journal.ledger import Ledger
from cacheserver.tiers import Position

ID = bytes(16)


def ledger_of(*sizes: int) -> Ledger:
    """Records 1.. of `sizes` bytes each, back to back from DATA_START."""
    ledger, end = Ledger(ID, after_seq=0), DATA_START
    for seq, size in enumerate(sizes, start=1):
        end += size
        ledger.add(seq, size, end)
    return ledger


def test_space_is_held_until_done_and_covered_then_released_oldest_first() -> None:
    ledger = ledger_of(100, 200, 300)
    assert (ledger.used_bytes, ledger.undrained_bytes) == (600, 600)
    assert ledger.reclaimable(keep_bytes=0) is None  # nothing done yet
    point = ledger.drain_point({1, 2})
    assert point == Position(ID, 2, DATA_START + 300)
    ledger.finish({1, 2}, point)
    assert (ledger.used_bytes, ledger.undrained_bytes, ledger.drained) == (600, 300, point)
    assert ledger.reclaimable(keep_bytes=500) == 1  # down to 500: the oldest one will do
    assert ledger.reclaimable(keep_bytes=0) == 2  # never past what is done
    assert ledger.reclaim(1) is True
    assert ledger.used_bytes == 500
    assert ledger.reclaim(1) is False  # nothing more up to 1
    assert ledger.reclaim(3) is True  # record 2; record 3 is not done
    assert ledger.used_bytes == 300


def test_records_done_out_of_order_are_covered_once_the_run_is_unbroken() -> None:
    ledger = ledger_of(10, 10, 10, 10)
    assert ledger.drain_point({2, 3}) is None  # record 1 still receiving
    ledger.finish({2, 3}, None)
    assert ledger.drained.seq == 0
    assert ledger.reclaimable(keep_bytes=0) is None  # done, but not covered in LMDB
    ledger.finish({1, 4}, ledger.drain_point({1, 4}))
    assert ledger.drained.seq == 4  # the run 1..4: 2 and 3 were done already
    assert ledger.reclaimable(keep_bytes=0) == 4


def test_records_done_behind_the_last_one_not_done_are_covered_when_it_finishes() -> None:
    ledger = ledger_of(10, 10, 10)
    ledger.finish({2, 3}, ledger.drain_point({2, 3}))  # done while record 1 receives
    ledger.finish({1}, ledger.drain_point({1}))  # given up (or drained) at last
    assert ledger.drained.seq == 3  # today: 1, until a later record drains


def test_the_drained_position_never_moves_back() -> None:
    ledger = ledger_of(10, 10)
    ahead = Position(ID, 2, DATA_START + 20)
    ledger.finish({1, 2}, ahead)
    ledger.finish(set(), Position(ID, 1, DATA_START + 10))
    assert ledger.drained == ahead
