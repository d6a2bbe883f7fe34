"""The put journal's ring, open for writing: reserve, commit, drain, reclaim, readers.

Invariants (all under `Journal._lock`):
- Space is written again only once the ledger (`cacheserver.store.journal.ledger`) has
  released it: drained, and covered by the position LMDB records.
- No record is handed out past the file space taken so far (`space`: pages made, or
  blocks reserved, `cacheserver.store.journal.space`): touching a page of the mapping
  that tmpfs cannot back would kill the server with SIGBUS.
- Released space is not written while a reader that entered before the release may
  still be sending views of it (`enter_read`/`exit_read`, by generation: `readers`).

Records finished behind a slow one are the ledger's to pass (see there). A reader that
stays entered (a stalled GET's `pin()`) keeps `_wait_for_room` from wrapping
(`ReaderGenerations.any_stale`); the transports bound how long that can be: the bulk
channel closes a connection whose reply is not taken at `[bulk]
min_transfer_bytes_per_s`, and gRPC copies a batch's views before it waits on its
client (docs/isolation.md).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import xxhash

from cacheserver.store.journal.files import open_private, remove_journal
from cacheserver.store.journal.format import (
    ALIGN,
    DATA_START,
    FLAG_COMMITTED,
    FLAG_WRAP,
    ID_BYTES,
    MAC_KEY_BYTES,
    NO_CHECKSUM,
    next_start,
    pack_header,
    pack_superblock,
    record_bytes,
)
from cacheserver.store.journal.ledger import Ledger
from cacheserver.store.journal.readers import ReaderGenerations
from cacheserver.store.journal.space import RingSpace
from cacheserver.tiers import NO_MODEL_TAG, Position
from kvcommon import handoff
from kvcommon.errors import ConfigError, ResourceExhausted
from policy.types import ModelTag, StorageKey, TenantId

MIN_CAPACITY = 16 << 20


@dataclass(slots=True)
class Reservation:
    """A record being filled: write the payload into `view`, then commit or abort."""

    seq: int
    offset: int
    end: int
    view: memoryview
    key: StorageKey
    tenant: TenantId
    epoch: int
    model_tag: ModelTag
    # The xxh3-128 of the payload, computed once at commit for the record's header; the
    # drain stores it in LMDB beside the block rather than hashing the bytes again.
    checksum: bytes | None = None


class JournalFull(ResourceExhausted):
    pass


class Journal:
    """The ring, open for writing. Thread-safe."""

    def __init__(
        self, path: Path, capacity: int, after_seq: int = 0, owner: Path | None = None
    ) -> None:
        """A fresh journal at `path` whose sequence numbers continue after `after_seq`;
        `owner` (the data dir) is recorded so that a journal left by a server that never
        came back can be recognised once its data dir is gone (`remove_orphans`)."""
        if capacity < MIN_CAPACITY:
            raise ConfigError(
                f"journal_bytes {capacity} is below the minimum {MIN_CAPACITY}; raise it, "
                "or set it to 0 to acknowledge puts after their LMDB commit"
            )
        self.path = path
        self.capacity = capacity
        self.journal_id = secrets.token_bytes(ID_BYTES)
        self._mac_key = secrets.token_bytes(MAC_KEY_BYTES)
        self._fd = open_private(path, create=True)
        try:
            os.ftruncate(self._fd, capacity)
            owner_path = str(owner.resolve()) if owner else ""
            superblock = pack_superblock(capacity, self.journal_id, self._mac_key, owner_path)
            os.pwrite(self._fd, superblock, 0)
            self._map = mmap.mmap(self._fd, capacity, flags=mmap.MAP_SHARED)
        except OSError as error:
            os.close(self._fd)
            raise ConfigError(f"cannot create journal {path}: {error.strerror}") from None
        self._view = memoryview(self._map)
        self._lock = threading.Lock()
        # Space released, a reader left, the prefaulter stopped.
        self._changed = threading.Condition(self._lock)
        self._waiting = 0  # reservations waiting for room
        self.on_full: Callable[[], None] = lambda: None  # asks the drainer to hurry
        self._seq = after_seq
        self._head = DATA_START
        self._ledger = Ledger(self.journal_id, after_seq)  # what holds space, what is done
        self._wrapped = False  # space is being written a second time
        self._readers = ReaderGenerations()  # who may still send released space
        # The file's space, taken ahead of the records (no record past it: SIGBUS).
        self.space = RingSpace(self._fd, self._map, DATA_START, capacity, self._changed)

    @property
    def start(self) -> Position:
        """Where recovery begins for this journal before anything is drained."""
        return Position(self.journal_id, self._ledger.drained.seq, DATA_START)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq

    @property
    def ring_bytes(self) -> int:
        """The bytes records may take: the file less its superblock."""
        return self.capacity - DATA_START

    @property
    def undrained_bytes(self) -> int:
        """Ring bytes of records not yet drained into LMDB (or given up), wrap waste
        included: what fills the ring when the disk falls behind (a metric)."""
        with self._lock:
            return self._ledger.undrained_bytes

    @property
    def drained_seq(self) -> int:
        """Every record up to this one is in LMDB (or was given up), as LMDB records."""
        with self._lock:
            return self._ledger.drained.seq

    # -- writing ------------------------------------------------------------------

    def reserve(
        self,
        key: StorageKey,
        tenant: TenantId,
        epoch: int,
        model_tag: ModelTag,
        size: int,
        wait_s: float = 0.0,
    ) -> Reservation:
        """Take room for a record of `size` payload bytes and mark it RESERVED.

        Waits up to `wait_s` for the drainer to free room, then raises JournalFull."""
        need = record_bytes(size)
        if need > self.capacity - DATA_START:
            raise JournalFull(
                f"a {size}-byte block does not fit the {self.capacity}-byte put journal; "
                "raise [storage] journal_bytes"
            )
        deadline = time.monotonic() + wait_s
        with self._lock:
            offset, waste, wrapping = self._wait_for_room(need, deadline)
            end = offset + need
            try:
                self.space.take(end)
            except OSError as error:
                raise JournalFull(
                    f"no space for the put journal in {self.path.parent} ({error.strerror}): "
                    "free space there, lower [storage] journal_bytes, or set journal_dir"
                ) from None
            seq = self._seq + 1
            if waste >= ALIGN:  # an explicit wrap marker at the old head
                self._write_header(self._head, FLAG_WRAP, seq, b"", "", 0, NO_MODEL_TAG, 0)
            self._write_header(offset, 0, seq, key, tenant, epoch, model_tag, size)
            self._seq = seq
            self._wrapped = wrapping
            self._head = next_start(end, self.capacity)
            self._ledger.add(seq, waste + need, end)
            view = self._view[offset + ALIGN : offset + ALIGN + size]
        return Reservation(seq, offset, end, view, key, tenant, epoch, model_tag)

    def _wait_for_room(self, need: int, deadline: float) -> tuple[int, int, bool]:
        """Where the next record of `need` bytes goes: (offset, bytes wasted before a
        wrap, whether the ring is being written again), once it fits and a wrap would
        overwrite nothing a reader may still send. Waits for the drainer until
        `deadline`, then raises JournalFull. Under `_lock`."""
        ring = self.capacity - DATA_START
        while True:
            offset, waste = self._head, 0
            if offset + need > self.capacity:
                waste, offset = self.capacity - offset, DATA_START
            wrapping = self._wrapped or waste > 0
            used = self._ledger.used_bytes
            if used + waste + need <= ring and not (wrapping and self._readers.any_stale()):
                return offset, waste, wrapping
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if used + waste + need <= ring:  # room, but a reader still sends from it
                    raise JournalFull(
                        "the put journal has room, but replies still being sent from it "
                        "keep its space from being reused (each has at most its transfer "
                        "deadline, [bulk] min_transfer_bytes_per_s); retry shortly"
                    )
                raise JournalFull(
                    f"the put journal holds {used} bytes not yet reclaimed and has no "
                    f"room for {need} more: puts arrive faster than the disk takes them; "
                    "retry later, or raise [storage] journal_bytes"
                )
            self._waiting += 1
            handoff.before_blocking()  # a thread serving other connections goes on
            try:
                self.on_full()
                self._changed.wait(remaining)
            finally:
                self._waiting -= 1

    def commit(self, reservation: Reservation) -> Position:
        """The payload is complete: mark the record COMMITTED (acknowledgeable)."""
        r = reservation
        r.checksum = self._write_header(
            r.offset, FLAG_COMMITTED, r.seq, r.key, r.tenant, r.epoch, r.model_tag, len(r.view)
        )
        return Position(self.journal_id, r.seq, r.end)

    def _write_header(
        self,
        offset: int,
        flags: int,
        seq: int,
        key: bytes,
        tenant: str,
        epoch: int,
        model_tag: bytes,
        size: int,
    ) -> bytes | None:
        """Write a record's header; returns the payload's checksum for a committed one."""
        checksum = NO_CHECKSUM
        if flags & FLAG_COMMITTED:
            checksum = xxhash.xxh3_128_digest(self._view[offset + ALIGN : offset + ALIGN + size])
        header = pack_header(
            self._mac_key,
            self.journal_id,
            flags,
            seq,
            key,
            tenant,
            epoch,
            model_tag,
            size,
            checksum,
        )
        # One pwrite inside one page: a crash leaves the old header or the new one.
        os.pwrite(self._fd, header, offset)
        return checksum if flags & FLAG_COMMITTED else None

    # -- draining -----------------------------------------------------------------

    def drain_point(self, seqs: set[int]) -> Position | None:
        """How far the chain is covered once records `seqs` are in LMDB (Ledger)."""
        with self._lock:
            return self._ledger.drain_point(seqs)

    def finish(self, seqs: set[int], through: Position | None) -> None:
        """Records `seqs` are drained (or given up), and LMDB records the chain going on
        after `through`. Their space stays in use (the memory tier may still hold
        views of them) until `reclaim`."""
        with self._lock:
            self._ledger.finish(seqs, through)

    def reclaimable(self, keep_bytes: int) -> int | None:
        """The last seq of the oldest drained records whose space, reclaimed, brings
        the ring down to `keep_bytes` in use (None: nothing to reclaim)."""
        with self._lock:
            return self._ledger.reclaimable(keep_bytes)

    def reclaim(self, through_seq: int) -> None:
        """Reuse the space of drained records up to `through_seq`. The caller has made
        sure no new reader can find views of them (the store dropped them first)."""
        with self._lock:
            if self._ledger.reclaim(through_seq):
                self._readers.released()
                self._changed.notify_all()

    def waiting_for_room(self) -> bool:
        with self._lock:
            return self._waiting > 0

    def under_pressure(self) -> bool:
        """Whether the drainer should not wait for a quiet moment: half the ring is not
        drained yet, or a put waits for room."""
        with self._lock:
            undrained = self._ledger.undrained_bytes
            return self._waiting > 0 or 2 * undrained >= self.capacity - DATA_START

    # -- readers ------------------------------------------------------------------

    def enter_read(self) -> int:
        """A reader is about to send views of records; returns its token."""
        with self._lock:
            return self._readers.enter()

    def exit_read(self, token: int) -> None:
        with self._lock:
            # A put may wait for room (every GET from memory ends here).
            if self._readers.exit(token) and self._waiting:
                self._changed.notify_all()

    def close(self, *, remove: bool) -> None:
        with self._lock:
            self.space.close()  # the prefaulter uses the mapping and the descriptor
            self._view.release()
            with contextlib.suppress(BufferError):  # views still held: unmapped at exit
                self._map.close()
            os.close(self._fd)
        if remove:
            remove_journal(self.path)
