"""The put journal's ledger: which records hold ring space, which of them are done, and
how far LMDB covers the chain. Pure bookkeeping, no I/O and no lock of its own: the
ring (`cacheserver.store.journal.ring`) calls it under its lock.

Invariants:
- `used_bytes` is the ring space from the oldest unreclaimed record to the head (wrap
  waste included); `undrained_bytes` is the part of it not yet drained or given up.
- A record's space is reclaimed only once the record is done (drained into LMDB, or
  given up) and `drained` — the position LMDB records as covered — has reached it: a
  replay after a crash starts at `drained`, so it never needs space that was reused.
- `drained` only moves forward.

Several records may be receiving at once (one per connection), so records are done
out of order: `_slots` holds every unreclaimed record by sequence number, `_ahead` the
ones after `drained` (done or not), and `drain_point` finds how far an unbroken run of
done records reaches from `drained` — records done while an older one was still
receiving included, so the moment that older one finishes (or is given up), `drained`
passes all of them at once. (Walking only the records not yet done missed them: the
ring they filled was never reclaimed, puts were refused and deletes' barriers waited
forever.)
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from cacheserver.store.journal.format import DATA_START
from cacheserver.tiers import Position


@dataclass(slots=True)
class _Slot:
    taken: int  # ring bytes, a wrap's waste included
    end: int
    done: bool = False  # drained into LMDB, or given up


class Ledger:
    def __init__(self, journal_id: bytes, after_seq: int) -> None:
        self.journal_id = journal_id
        self.used_bytes = 0
        self.undrained_bytes = 0
        self.drained = Position(journal_id, after_seq, DATA_START)
        self._slots: OrderedDict[int, _Slot] = OrderedDict()  # unreclaimed, by seq
        self._ahead: OrderedDict[int, _Slot] = OrderedDict()  # of which after `drained`

    def add(self, seq: int, taken: int, end: int) -> None:
        """Record `seq` takes `taken` bytes of the ring, up to offset `end`."""
        self.used_bytes += taken
        self.undrained_bytes += taken
        self._slots[seq] = self._ahead[seq] = _Slot(taken, end)

    def drain_point(self, seqs: set[int]) -> Position | None:
        """How far the chain is covered once records `seqs` are in LMDB: the last of
        the unbroken run of finished records from the oldest unreleased one."""
        point = None
        for seq, slot in self._ahead.items():  # covered ones are not walked again
            if not slot.done and seq not in seqs:
                break
            point = Position(self.journal_id, seq, slot.end)
        return point

    def finish(self, seqs: set[int], through: Position | None) -> None:
        """Records `seqs` are done, and LMDB records the chain going on after `through`."""
        for seq in seqs:
            slot = self._slots.get(seq)
            if slot is not None and not slot.done:
                slot.done = True
                self.undrained_bytes -= slot.taken
        if through is not None and through.seq > self.drained.seq:
            self.drained = through
            while self._ahead and next(iter(self._ahead)) <= through.seq:
                self._ahead.popitem(last=False)

    def reclaimable(self, keep_bytes: int) -> int | None:
        """The last seq of the oldest done records whose space, reclaimed, brings the
        ring down to `keep_bytes` in use (None: nothing to reclaim)."""
        used, last = self.used_bytes, None
        for seq, slot in self._slots.items():
            if used <= keep_bytes or not slot.done or seq > self.drained.seq:
                break
            used -= slot.taken
            last = seq
        return last

    def reclaim(self, through_seq: int) -> bool:
        """Release the space of done records up to `through_seq`; whether any was."""
        freed = False
        while self._slots:
            seq, slot = next(iter(self._slots.items()))
            if seq > through_seq or not slot.done or seq > self.drained.seq:
                break
            self._slots.popitem(last=False)
            self.used_bytes -= slot.taken
            freed = True
        return freed
