"""The put journal: acknowledged blocks in shared memory until LMDB holds them.

Why it exists. An acknowledged block must survive `kill -9` of the server (DESIGN §6),
so it has to be in a file before the ack, not only in process memory. Writing it
straight into LMDB does that, but every byte then becomes a dirty page of a disk-backed
file, and once dirty pages pass the kernel's threshold (about 2 GB here) writers are
throttled to what the disk writes back: ~350-500 MB/s on this machine, measured with
plain LMDB commits and with `dd`. A file on tmpfs is never written back, so copying a
block into it runs at memory speed (~10 GB/s once its pages exist) and still survives
the process. The journal is that file: a ring of records on tmpfs (`/dev/shm` by
default). A put is acknowledged once its record is in the ring; the store's writer
thread moves blocks into LMDB behind it and then frees their space. After a crash the
store replays the records LMDB does not have yet, so nothing acknowledged is lost. A
host reboot clears tmpfs: what was acknowledged but not yet in LMDB then is gone —
at most the ring's capacity, and only cache entries, which replicas recompute.

The ring is mapped into the server, and the bulk channel receives a block straight
into its record (`reserve`, then `recv_into` the record's view, then `commit`): one
copy from the socket into memory whose pages exist already (prefaulted in the
background), where a heap buffer would first fault in every page (~4x slower here).
The memory tier then holds that view instead of a copy until the record's space is
reused; readers pin the views they send (`enter_read`), and space is not written
again while a reader that may hold a view of it is still sending.

Layout. A superblock in the first `DATA_START` bytes (magic, version, capacity, a
random journal id and a random MAC key), then records at `ALIGN`-aligned offsets: a
header in the first `ALIGN` bytes, then the payload. The header carries the sequence
number, the state (RESERVED, then COMMITTED once the payload is complete), the
block's storage key, tenant, epoch, model tag and size, the xxh3-128 of the payload,
and a keyed BLAKE2b MAC over all of that. Headers are written with one `pwrite` that
never crosses a page, so a crash cannot tear one. Several records may be receiving at
once (one per connection), so a crash can leave RESERVED records anywhere after the
last drained one: recovery skips them (they were never acknowledged) and goes on. A
record that does not fit before the end of the file is preceded by a wrap marker (a
header with `FLAG_WRAP`) and goes to `DATA_START`; when not even a header fits, the
wrap is implicit.

Recovery follows the chain from the first record LMDB does not have (its offset and
sequence are committed with every drain, see `LmdbTier.write`) and stops at the first
header that fails its MAC or breaks the sequence. Because headers are MAC'd under a
key that never leaves the server, bytes a tenant put in a payload can never be taken
for a record, even where the chain runs into stale space after a crash. Space is
reused only after LMDB has recorded that the chain goes on past it.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import mmap
import os
import secrets
import stat
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvcommon.errors import ConfigError, ResourceExhausted
from policy.types import ModelTag, StorageKey, TenantId

SUPER_MAGIC = b"KVSJRNL1"
RECORD_MAGIC = b"KVSJREC1"
VERSION = 1
DATA_START = 4096
ALIGN = 256
FLAG_WRAP = 1
FLAG_COMMITTED = 2
MAX_KEY_BYTES = 64
MAX_TENANT_BYTES = 64
ID_BYTES = 16
MAC_KEY_BYTES = 32
MAC_BYTES = 16
MIN_CAPACITY = 16 << 20
MAX_OWNER_BYTES = 2048  # the data dir's path, after the superblock's fixed fields
PREFAULT_CHUNK_BYTES = 32 << 20
FALLOCATE_STEP_BYTES = 1 << 20
PREFAULT_AHEAD_BYTES = 128 << 20  # how far ahead of use the ring's pages are made
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL)

_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME, use_errno=True) if _LIBC_NAME else None

# magic | version | capacity | journal id | MAC key
_SUPER = struct.Struct(f">8sIQ{ID_BYTES}s{MAC_KEY_BYTES}s")
# magic | flags | key length | tenant length | epoch | seq | size | key | model tag |
# tenant | payload checksum; then the MAC over these bytes
_HEAD = struct.Struct(f">8sBBBxIQQ{MAX_KEY_BYTES}s16s{MAX_TENANT_BYTES}s16s")
HEADER_BYTES = _HEAD.size + MAC_BYTES  # 216: inside one ALIGN slot, never across a page
assert HEADER_BYTES <= ALIGN and 4096 % ALIGN == 0

Buffer = bytes | bytearray | memoryview


def record_bytes(payload_size: int) -> int:
    """Space one record of `payload_size` takes in the ring."""
    return ALIGN + (payload_size + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True, slots=True)
class Record:
    seq: int
    key: StorageKey
    tenant: TenantId
    epoch: int
    model_tag: ModelTag
    payload: bytes
    end: int  # offset just past this record: where the chain continues


@dataclass(frozen=True, slots=True)
class Position:
    """Where the chain continues after everything up to `seq` (inclusive)."""

    journal_id: bytes
    seq: int
    offset: int


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


@dataclass(slots=True)
class _Slot:
    taken: int  # ring bytes, a wrap's waste included
    end: int
    done: bool = False  # drained into LMDB, or abandoned


class JournalFull(ResourceExhausted):
    pass


def _mac(key: bytes, journal_id: bytes, fields: bytes) -> bytes:
    return hashlib.blake2b(journal_id + fields, key=key, digest_size=MAC_BYTES).digest()


def _next_start(offset: int, capacity: int) -> int:
    """Where a record may begin at or after `offset` (an implicit wrap if no header fits)."""
    return DATA_START if capacity - offset < ALIGN else offset


def _open_private(path: Path, create: bool) -> int:
    """Open `path` read-write without following links; refuse files others could read.

    The default directory (/dev/shm) is world-writable: a file someone else planted
    under our name (or a link to one) must never be used."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(f"journal {path} is a symbolic link; remove it") from None
        raise
    info = os.fstat(fd)
    if (
        not stat.S_ISREG(info.st_mode)
        or info.st_uid != os.getuid()
        or info.st_mode & 0o077
        or info.st_nlink != 1
    ):
        os.close(fd)
        raise ConfigError(
            f"journal {path} is not a private regular file of this user (mode 0600, one "
            "link); remove it or set [storage] journal_dir elsewhere"
        )
    return fd


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
        self._fd = _open_private(path, create=True)
        try:
            os.ftruncate(self._fd, capacity)
            superblock = _SUPER.pack(SUPER_MAGIC, VERSION, capacity, self.journal_id, self._mac_key)
            owner_raw = str(owner.resolve()).encode("utf-8")[:MAX_OWNER_BYTES] if owner else b""
            owner_field = struct.pack(">H", len(owner_raw)) + owner_raw
            os.pwrite(self._fd, superblock + owner_field, 0)
            self._map = mmap.mmap(self._fd, capacity, flags=mmap.MAP_SHARED)
        except OSError as error:
            os.close(self._fd)
            raise ConfigError(f"cannot create journal {path}: {error.strerror}") from None
        self._view = memoryview(self._map)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(self._map))
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # space released, a reader left
        self._waiting = 0  # reservations waiting for room
        self.on_full: Callable[[], None] = lambda: None  # asks the drainer to hurry
        self._seq = after_seq
        self._head = DATA_START
        self._used = 0  # bytes from the oldest unreclaimed record to the head
        self._undrained = 0  # of which records not yet drained (or given up)
        self._slots: OrderedDict[int, _Slot] = OrderedDict()  # unreclaimed, by seq
        self._undone: OrderedDict[int, _Slot] = OrderedDict()  # of which not drained
        self._drained = Position(self.journal_id, after_seq, DATA_START)
        self._wrapped = False  # space is being written a second time
        self._generation = 0  # bumped each time space is released
        self._readers: dict[int, int] = {}  # generation entered -> readers still sending
        # The file's blocks are reserved (fallocate) up to here: touching a page of the
        # mapping past what tmpfs can back would kill the server with SIGBUS, so no
        # record is handed out beyond it (`_allocate`).
        self._allocated = DATA_START
        self._furthest = DATA_START  # the end of the furthest record reserved yet
        self.prefault_wanted = threading.Event()
        self.prefault_wanted.set()
        self._closed = False

    @property
    def start(self) -> Position:
        """Where recovery begins for this journal before anything is drained."""
        return Position(self.journal_id, self._drained.seq, DATA_START)

    @property
    def last_seq(self) -> int:
        with self._lock:
            return self._seq

    @property
    def drained_seq(self) -> int:
        """Every record up to this one is in LMDB (or was given up), as LMDB records."""
        with self._lock:
            return self._drained.seq

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
        ring = self.capacity - DATA_START
        if need > ring:
            raise JournalFull(
                f"a {size}-byte block does not fit the {self.capacity}-byte put journal; "
                "raise [storage] journal_bytes"
            )
        deadline = time.monotonic() + wait_s
        with self._lock:
            while True:
                offset, waste = self._head, 0
                if offset + need > self.capacity:
                    waste, offset = self.capacity - offset, DATA_START
                wrapping = self._wrapped or waste > 0
                if self._used + waste + need <= ring and not (wrapping and self._stale_readers()):
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise JournalFull(
                        f"the put journal holds {self._used} bytes not yet in LMDB and has "
                        f"no room for {need} more: puts arrive faster than the disk takes "
                        "them; retry later, or raise [storage] journal_bytes"
                    )
                self._waiting += 1
                try:
                    self.on_full()
                    self._changed.wait(remaining)
                finally:
                    self._waiting -= 1
            end = offset + need
            if end > self._allocated:
                self._allocate(end)
            seq = self._seq + 1
            if waste >= ALIGN:  # an explicit wrap marker at the old head
                self._write_header(self._head, FLAG_WRAP, seq, b"", "", 0, bytes(16), 0)
            self._write_header(offset, 0, seq, key, tenant, epoch, model_tag, size)
            self._seq = seq
            self._wrapped = wrapping
            if end > self._furthest:
                self._furthest = end
                if self._allocated < min(self.capacity, end + PREFAULT_AHEAD_BYTES):
                    self.prefault_wanted.set()
            self._head = _next_start(end, self.capacity)
            self._used += waste + need
            self._undrained += waste + need
            self._slots[seq] = self._undone[seq] = _Slot(waste + need, end)
            view = self._view[offset + ALIGN : offset + ALIGN + size]
        return Reservation(seq, offset, end, view, key, tenant, epoch, model_tag)

    def commit(self, reservation: Reservation) -> Position:
        """The payload is complete: mark the record COMMITTED (acknowledgeable)."""
        r = reservation
        self._write_header(
            r.offset, FLAG_COMMITTED, r.seq, r.key, r.tenant, r.epoch, r.model_tag, len(r.view)
        )
        return Position(self.journal_id, r.seq, r.end)

    def append(
        self,
        key: StorageKey,
        tenant: TenantId,
        epoch: int,
        model_tag: ModelTag,
        payload: Buffer,
        wait_s: float = 0.0,
    ) -> Reservation:
        """Reserve, copy `payload` in and commit: one whole record."""
        reservation = self.reserve(key, tenant, epoch, model_tag, len(payload), wait_s)
        reservation.view[:] = memoryview(payload).cast("B")
        self.commit(reservation)
        return reservation

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
    ) -> None:
        checksum = bytes(16)
        if flags & FLAG_COMMITTED:
            checksum = xxhash.xxh3_128_digest(self._view[offset + ALIGN : offset + ALIGN + size])
        tenant_raw = tenant.encode("utf-8")
        if len(key) > MAX_KEY_BYTES or len(tenant_raw) > MAX_TENANT_BYTES:
            raise ValueError("storage key or tenant too long for a journal record")
        fields = _HEAD.pack(
            RECORD_MAGIC,
            flags,
            len(key),
            len(tenant_raw),
            epoch,
            seq,
            size,
            bytes(key),
            model_tag,
            tenant_raw,
            checksum,
        )
        # One pwrite inside one page: a crash leaves the old header or the new one.
        os.pwrite(self._fd, fields + _mac(self._mac_key, self.journal_id, fields), offset)

    # -- draining -----------------------------------------------------------------

    def drain_point(self, seqs: set[int]) -> Position | None:
        """How far the chain is covered once records `seqs` are in LMDB: the last of
        the unbroken run of finished records from the oldest unreleased one."""
        with self._lock:
            point = None
            for seq, slot in self._undone.items():  # drained ones are not walked again
                if seq not in seqs:
                    break
                point = Position(self.journal_id, seq, slot.end)
            return point

    def finish(self, seqs: set[int], through: Position | None) -> None:
        """Records `seqs` are drained (or given up), and LMDB records the chain going on
        after `through`. Their space stays in use (the memory tier may still hold
        views of them) until `reclaim`."""
        with self._lock:
            for seq in seqs:
                slot = self._undone.pop(seq, None)
                if slot is not None:
                    slot.done = True
                    self._undrained -= slot.taken
            if through is not None and through.seq > self._drained.seq:
                self._drained = through

    def reclaimable(self, keep_bytes: int) -> int | None:
        """The last seq of the oldest drained records whose space, reclaimed, brings
        the ring down to `keep_bytes` in use (None: nothing to reclaim)."""
        with self._lock:
            used, last = self._used, None
            for seq, slot in self._slots.items():
                if used <= keep_bytes or not slot.done or seq > self._drained.seq:
                    break
                used -= slot.taken
                last = seq
            return last

    def reclaim(self, through_seq: int) -> None:
        """Reuse the space of drained records up to `through_seq`. The caller has made
        sure no new reader can find views of them (the store dropped them first)."""
        with self._lock:
            freed = False
            while self._slots:
                seq, slot = next(iter(self._slots.items()))
                if seq > through_seq or not slot.done or seq > self._drained.seq:
                    break
                self._slots.popitem(last=False)
                self._used -= slot.taken
                freed = True
            if freed:
                self._generation += 1
                self._changed.notify_all()

    def waiting_for_room(self) -> bool:
        with self._lock:
            return self._waiting > 0

    def under_pressure(self) -> bool:
        """Whether the drainer should not wait for a quiet moment: half the ring is not
        drained yet, or a put waits for room."""
        with self._lock:
            return self._waiting > 0 or 2 * self._undrained >= self.capacity - DATA_START

    # -- readers ------------------------------------------------------------------

    def enter_read(self) -> int:
        """A reader is about to send views of records; returns its token."""
        with self._lock:
            generation = self._generation
            self._readers[generation] = self._readers.get(generation, 0) + 1
            return generation

    def exit_read(self, token: int) -> None:
        with self._lock:
            left = self._readers[token] - 1
            if left:
                self._readers[token] = left
            else:
                del self._readers[token]
                self._changed.notify_all()

    def _stale_readers(self) -> bool:
        """Whether a reader that entered before the latest release may still hold a
        view of released space (under `_lock`)."""
        return any(generation < self._generation for generation in self._readers)

    # -- upkeep -------------------------------------------------------------------

    def _allocate(self, end: int) -> None:
        """Reserve the file's blocks up to `end` (under `_lock`), or refuse the put.
        Usually the prefaulter got there first; this covers what it has not."""
        end = min(self.capacity, end + -end % mmap.PAGESIZE)  # whole pages: see prefault
        try:
            os.posix_fallocate(self._fd, self._allocated, end - self._allocated)
        except OSError as error:
            raise JournalFull(
                f"no space for the put journal in {self.path.parent} ({error.strerror}): "
                "free space there, lower [storage] journal_bytes, or set journal_dir"
            ) from None
        self._allocated = end

    def prefault(self, chunk_bytes: int = PREFAULT_CHUNK_BYTES) -> bool:
        """Reserve and map the next chunk of the ring, while it is less than
        `PREFAULT_AHEAD_BYTES` ahead of the furthest record yet (a first touch of a page
        costs ~4x the copy into it), without holding the lock meanwhile. Never changes
        bytes. Returns whether it did work; `prefault_wanted` is set when more is wanted."""
        with self._lock:
            limit = min(self.capacity, self._furthest + PREFAULT_AHEAD_BYTES)
            if self._closed or self._allocated >= limit:
                return False
            # Whole chunks from a page boundary (`_allocated` always is one): madvise
            # refuses a start inside a page, and would leave every page to fault.
            start = self._allocated
            end = min(self.capacity, start + chunk_bytes)
        try:
            # In small steps: fallocate holds the file's lock throughout, and a put's
            # header write (pwrite) waits for it spinning, ~4 ms for 32 MiB at once.
            for step in range(start, end, FALLOCATE_STEP_BYTES):
                os.posix_fallocate(self._fd, step, min(FALLOCATE_STEP_BYTES, end - step))
        except OSError:
            return False  # tmpfs is full: reserve() refuses what does not fit
        with self._lock:
            if self._closed:
                return False
            self._allocated = max(self._allocated, end)
        # madvise through ctypes, which lets go of the GIL: mmap.madvise holds it for
        # the whole call (~4 ms per 32 MiB), stalling every connection thread.
        if _LIBC is not None:  # an older kernel refuses it: pages then map on first touch
            address, length = ctypes.c_void_p(self._base + start), ctypes.c_size_t(end - start)
            _LIBC.madvise(address, length, MADV_POPULATE_WRITE)
        return True

    def close(self, *, remove: bool) -> None:
        with self._lock:
            self._closed = True
            self.prefault_wanted.set()
            self._view.release()
            with contextlib.suppress(BufferError):  # views still held: unmapped at exit
                self._map.close()
            os.close(self._fd)
        if remove:
            self.path.unlink(missing_ok=True)


def replay(path: Path, after: Position) -> Iterator[Record]:
    """The committed records after `after` in the journal at `path`, in order.

    Yields nothing when the file is gone (a reboot cleared tmpfs) or belongs to another
    journal; skips records still RESERVED at the crash (never acknowledged); stops at
    the first header that fails its MAC or breaks the sequence."""
    try:
        fd = _open_private(path, create=False)
    except FileNotFoundError:
        return
    try:
        raw = os.pread(fd, _SUPER.size, 0)
        if len(raw) < _SUPER.size:
            return
        magic, version, capacity, journal_id, mac_key = _SUPER.unpack(raw)
        if magic != SUPER_MAGIC or version != VERSION or journal_id != after.journal_id:
            return
        capacity = min(capacity, os.fstat(fd).st_size)
        offset, seq = _next_start(after.offset, capacity), after.seq
        while True:
            head = os.pread(fd, HEADER_BYTES, offset)
            if len(head) < HEADER_BYTES:
                return
            fields, mac = head[: _HEAD.size], head[_HEAD.size :]
            if not secrets.compare_digest(mac, _mac(mac_key, journal_id, fields)):
                return
            (_, flags, key_len, tenant_len, epoch, rec_seq, size, key, tag, tenant, checksum) = (
                _HEAD.unpack(fields)
            )
            if rec_seq != seq + 1:
                return
            if flags & FLAG_WRAP:
                offset = DATA_START
                continue
            end = offset + record_bytes(size)
            if end > capacity:
                return
            seq = rec_seq
            if flags & FLAG_COMMITTED:
                payload = os.pread(fd, size, offset + ALIGN)
                if len(payload) == size and xxhash.xxh3_128_digest(payload) == checksum:
                    yield Record(
                        rec_seq,
                        StorageKey(key[:key_len]),
                        TenantId(tenant[:tenant_len].decode("utf-8")),
                        epoch,
                        ModelTag(tag),
                        payload,
                        end,
                    )
            offset = _next_start(end, capacity)
    finally:
        os.close(fd)


def remove_orphans(directory: Path, keep: Path) -> list[Path]:
    """Remove journals in `directory` whose data dir no longer exists: left by servers
    killed and never started again on their data dir, each holding up to its capacity
    of tmpfs (memory). Only this user's private files of this format are considered;
    a journal whose data dir exists is kept, as its server may come back to replay it.
    Returns what was removed."""
    removed = []
    for candidate in directory.glob(f"kvshare-{os.getuid()}-*.journal"):
        if candidate == keep:
            continue
        try:
            fd = _open_private(candidate, create=False)
        except (OSError, ConfigError):
            continue
        try:
            raw = os.pread(fd, _SUPER.size + 2 + MAX_OWNER_BYTES, 0)
        finally:
            os.close(fd)
        if len(raw) < _SUPER.size + 2 or raw[:8] != SUPER_MAGIC:
            continue
        (length,) = struct.unpack_from(">H", raw, _SUPER.size)
        owner = raw[_SUPER.size + 2 : _SUPER.size + 2 + length].decode("utf-8", "replace")
        if owner and not Path(owner).exists():
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def default_journal_path(data_dir: Path, journal_dir: str) -> Path | None:
    """Where the journal of `data_dir` lives: in `journal_dir` when set, else on
    /dev/shm when that is a writable tmpfs; None when neither (no journal)."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode("utf-8")).hexdigest()[:16]
    name = f"kvshare-{os.getuid()}-{digest}.journal"
    if journal_dir:
        return Path(journal_dir) / name
    # Not a temporary file: a fixed, per-user, per-data-dir name opened with O_NOFOLLOW
    # and checked to be a private regular file (_open_private).
    shm = Path("/dev/shm")  # noqa: S108
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) and _is_tmpfs(shm):
        return shm / name
    return None


def _is_tmpfs(path: Path) -> bool:
    try:
        with open("/proc/mounts", encoding="utf-8") as mounts:
            for line in mounts:
                parts = line.split()
                if len(parts) >= 3 and parts[1] == str(path) and parts[2] == "tmpfs":
                    return True
    except OSError:
        pass
    return False
