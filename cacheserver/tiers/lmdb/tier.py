"""`LmdbTier`: the persistent tier, the server's side of the LMDB environment (the
package docstring says what it guarantees): commits, deletes, verified reads, disk space
reserved ahead of commits, the health probe, and LMDB's reader check.
"""

from __future__ import annotations

import os
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import lmdb

from cacheserver.tiers import (
    Capability,
    JournalCheckpoint,
    LocalCopies,
    PendingWrite,
    Position,
)
from cacheserver.tiers.lmdb import environment
from cacheserver.tiers.lmdb.records import StoredMeta, checksum, intact, pack_meta, unpack_meta
from cacheserver.tiers.retiring import RetiringKeys
from kvcommon.errors import ConfigError, ResourceExhausted
from policy.types import StorageKey, TenantId

# How often the server clears slots of processes that died (LMDB's reader check).
READER_CHECK_INTERVAL_S = 1.0
_PROBE_KEY = b"probe"
_DRAINED_KEY = b"drained"
# journal id | last sequence number in LMDB | offset where the journal's chain goes on;
# then the journal's path in UTF-8
_DRAINED = struct.Struct(">16sQQ")
# A commit that needs fresh pages fails when the file system is full, yet the probe's
# own tiny write reuses freed pages and still succeeds: so the probe also asks for this
# much free space, about what a burst of new blocks needs before eviction catches up.
MIN_FREE_BYTES = 8 << 20
# Disk space for commits is reserved ahead of LMDB's last page (_ensure_space), by a
# quarter of what the file holds, at least the first and at most the second: an empty
# store holds 1 MiB of disk, not 64 (the test suite starts some 400 servers), and a
# growing one still reserves in few, large steps (8 fallocate calls reach 64 MiB).
SPACE_STEP_MIN_BYTES = 1 << 20
SPACE_STEP_MAX_BYTES = 64 << 20
# New pages a transaction may need besides overflow pages for payloads: copies of the
# B-tree paths it touches in each database, free-list and meta updates.
SMALL_TXN_PAGES = 64
TXN_PAGES_PER_KEY = 8


class LmdbTier:
    name = "lmdb"
    capabilities = Capability.NONE

    def __init__(
        self,
        path: Path,
        *,
        map_bytes: int,
        sync_writes: bool,
        on_integrity_failure: Callable[[TenantId, int], None] | None = None,
    ) -> None:
        """`on_integrity_failure(tenant, blocks)` hears of every corrupt block dropped."""
        try:
            path.mkdir(mode=0o700, parents=True, exist_ok=True)
            self._env = lmdb.open(
                str(path),
                mode=0o600,  # data.mdb and lock.mdb: every tenant's blocks, owner-only
                map_size=map_bytes,
                max_dbs=environment.MAX_DBS,
                subdir=True,
                sync=sync_writes,
                metasync=sync_writes,
                readahead=False,
                # Commits write their pages with pwrite, not through a writable mapping
                # (writemap): measured here with the whole server, a 64 KiB put cost
                # 211-253 us of server CPU instead of 280-337, a 2 MiB put 4.1-4.9 ms
                # instead of 4.8-9.3 (dirty pages of a shared mapping cost a fault each
                # when made and a write-protect each when written back). Reads go
                # through the read-only mapping either way; a full disk fails a commit
                # (pwrite) instead of faulting the process.
                writemap=False,
                max_readers=environment.MAX_READERS,
                lock=True,
            )
        except lmdb.Error as error:
            raise ConfigError(
                f"cannot open LMDB in {path}: {error}; check the data dir "
                "is writable and not used by another kvshare server"
            ) from None
        except OSError as error:
            raise ConfigError(f"cannot create data dir {path}: {error.strerror}") from None
        self._blocks = self._env.open_db(environment.BLOCKS_DB)
        self._meta = self._env.open_db(environment.META_DB)
        self._health = self._env.open_db(b"health")
        self._journal = self._env.open_db(b"journal")
        self.path = path
        self.map_bytes = map_bytes
        self.integrity_failures = 0
        self._lock = threading.Lock()  # guards integrity_failures
        self._on_integrity_failure = on_integrity_failure
        self._page_bytes = int(self._env.stat()["psize"])
        self._data_fd = os.open(path / "data.mdb", os.O_RDWR | os.O_CLOEXEC)
        self._space_lock = threading.Lock()
        self._allocated_to = 0  # the data file's blocks are reserved up to here
        self._retiring = RetiringKeys(path)
        self._checking = threading.Event()  # set: the reader check's thread ends
        self._checker: threading.Thread | None = None

    def used_file_bytes(self) -> int:
        """How far into the data file LMDB's pages reach (the file may be longer: space
        reserved ahead, `_ensure_space`)."""
        return (int(self._env.info()["last_pgno"]) + 1) * self._page_bytes

    def _ensure_space(self, new_pages: int) -> None:
        """Reserve disk blocks for `new_pages` past LMDB's last page, before a write
        transaction: a full disk fails it as a DiskError before any work, whatever the
        commit would have written (and the file grows in few, large extents). Reserved
        ahead in steps."""
        end = (int(self._env.info()["last_pgno"]) + 1 + new_pages) * self._page_bytes
        end = min(end, self.map_bytes)
        with self._space_lock:
            if end <= self._allocated_to:
                return
            step = min(SPACE_STEP_MAX_BYTES, max(SPACE_STEP_MIN_BYTES, end // 4))
            ahead = min(self.map_bytes, end + step)
            for target in (ahead, end):
                try:
                    os.posix_fallocate(self._data_fd, 0, target)
                except OSError as error:
                    failure = error
                    continue
                self._allocated_to = target
                return
        raise lmdb.DiskError(f"cannot reserve space for a commit: {failure.strerror}")

    def probe(self) -> str | None:
        """Why the tier cannot take writes now (a short reason), or None when it can."""
        try:
            self._ensure_space(SMALL_TXN_PAGES)
            with self._env.begin(write=True, db=self._health) as txn:
                txn.put(_PROBE_KEY, struct.pack(">d", time.time()))
        except lmdb.Error as error:
            return f"LMDB write failed ({type(error).__name__})"
        try:
            fs = os.statvfs(self.path)
        except OSError as error:
            return f"cannot stat the data dir ({error.strerror})"
        free = fs.f_bavail * fs.f_frsize
        if free < MIN_FREE_BYTES:
            return f"disk full: {free} bytes free under the LMDB tier"
        return None

    def start(self, local: LocalCopies) -> None:
        """LMDB's reader check, every READER_CHECK_INTERVAL_S, on a thread of its own."""
        if self._checker is None:
            self._checker = threading.Thread(
                target=self._check_readers_loop, name="kvshare-lmdb-readers", daemon=True
            )
            self._checker.start()

    def stop(self) -> None:
        self._checking.set()
        if self._checker is not None:
            self._checker.join()

    def _check_readers_loop(self) -> None:
        while not self._checking.wait(READER_CHECK_INTERVAL_S):
            self.check_readers()

    def check_readers(self) -> int:
        """Free the reader slots of processes that ended (a bulk worker killed mid-read):
        how many were freed."""
        try:
            return int(self._env.reader_check())
        except lmdb.Error:
            return 0  # the environment is closing

    def retire(self, key: StorageKey) -> None:
        """The index no longer lists `key` (evicted), and a later `write` deletes it:
        bulk workers hand reads of it back meanwhile (cacheserver.tiers.retiring)."""
        self._retiring.retire(key)

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"integrity_failures": self.integrity_failures}

    def sync(self) -> None:
        """fsync what earlier commits wrote (they are already in the OS page cache)."""
        self._env.sync(True)

    def close(self) -> None:
        self.stop()
        self._env.sync(True)
        self._env.close()
        os.close(self._data_fd)
        self._retiring.close()

    def scan(self) -> Iterator[StoredMeta]:
        with self._env.begin(db=self._meta, buffers=True) as txn:
            for key, raw in txn.cursor():
                yield unpack_meta(key, raw)[1]

    def read_many(self, keys: Sequence[StorageKey]) -> list[bytes | None]:
        """Payloads for `keys` (None where absent or corrupt), one read transaction."""
        out: list[bytes | None] = []
        corrupt: list[tuple[StorageKey, TenantId]] = []
        with environment.begin_read(self._env) as txn:
            for key in keys:
                raw_meta = txn.get(key, db=self._meta)
                raw = txn.get(key, db=self._blocks)
                if raw_meta is None or raw is None:
                    out.append(None)
                    continue
                digest, meta = unpack_meta(key, raw_meta)
                if not intact(raw, digest, meta):
                    corrupt.append((key, meta.tenant))
                    out.append(None)
                    continue
                out.append(bytes(raw))  # the one copy out of the memory map
        if corrupt:
            self._drop_corrupt(corrupt)
        return out

    def _drop_corrupt(self, corrupt: Sequence[tuple[StorageKey, TenantId]]) -> None:
        with self._lock:
            self.integrity_failures += len(corrupt)
        self.delete([key for key, _ in corrupt])
        if self._on_integrity_failure is not None:
            by_tenant: dict[TenantId, int] = {}
            for _, tenant in corrupt:
                by_tenant[tenant] = by_tenant.get(tenant, 0) + 1
            for tenant, blocks in by_tenant.items():
                self._on_integrity_failure(tenant, blocks)

    def journal_position(self) -> JournalCheckpoint | None:
        """How far the put journal has been moved into LMDB, and where that journal is."""
        with self._env.begin(db=self._journal) as txn:
            raw = txn.get(_DRAINED_KEY)
        if raw is None or len(raw) < _DRAINED.size:
            return None
        journal_id, seq, offset = _DRAINED.unpack_from(raw)
        return Position(journal_id, seq, offset), Path(raw[_DRAINED.size :].decode("utf-8"))

    def write(
        self,
        writes: Sequence[PendingWrite],
        deletes: Sequence[StorageKey],
        drained: JournalCheckpoint | None = None,
    ) -> list[bool]:
        """Delete `deletes`, then insert `writes` first-writer-wins, in one durable commit.
        With `drained`, the same commit records how far the put journal is now in LMDB.

        Returns, per write, whether it was stored (False: the key already existed).
        Once it has committed, bulk workers may serve `deletes` again (`retire`).
        """
        new_pages = SMALL_TXN_PAGES + TXN_PAGES_PER_KEY * len(deletes)
        for w in writes:
            new_pages += len(w.payload) // self._page_bytes + 1 + TXN_PAGES_PER_KEY
        try:
            self._ensure_space(new_pages)
            stored = self._commit(writes, deletes, drained)
        except lmdb.MapFullError:
            raise ResourceExhausted(
                f"LMDB map full at {self.map_bytes} bytes; raise [storage] lmdb_map_bytes or "
                "lower [storage] disk_budget_bytes so evictions keep it below the map"
            ) from None
        self._retiring.settled(deletes)
        return stored

    def _commit(
        self,
        writes: Sequence[PendingWrite],
        deletes: Sequence[StorageKey],
        drained: JournalCheckpoint | None,
    ) -> list[bool]:
        with self._env.begin(write=True) as txn:
            if drained is not None:
                position, path = drained
                txn.put(
                    _DRAINED_KEY,
                    _DRAINED.pack(position.journal_id, position.seq, position.offset)
                    + str(path).encode("utf-8"),
                    db=self._journal,
                )
            for key in deletes:
                txn.delete(key, db=self._blocks)
                txn.delete(key, db=self._meta)
            stored = []
            for w in writes:
                fresh = txn.put(w.key, w.payload, db=self._blocks, overwrite=False)
                if fresh:
                    digest = checksum(w.payload) if w.checksum is None else w.checksum
                    txn.put(w.key, pack_meta(w, digest), db=self._meta)
                stored.append(bool(fresh))
            return stored

    def delete(self, keys: Sequence[StorageKey]) -> int:
        self._ensure_space(SMALL_TXN_PAGES + TXN_PAGES_PER_KEY * len(keys))
        with self._env.begin(write=True) as txn:
            deleted = 0
            for key in keys:
                deleted += bool(txn.delete(key, db=self._blocks))
                txn.delete(key, db=self._meta)
            return deleted
