"""`LmdbReader`: the bulk workers' read-only view of the server's LMDB tier, from
another process (cacheserver.transport.bulk.readworker, through
cacheserver.core.readonly), and the blocks of one read transaction
(`BlockReads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import lmdb

from cacheserver.tiers.lmdb import environment
from cacheserver.tiers.lmdb.records import StoredMeta, intact, unpack_meta
from cacheserver.tiers.retiring import RetiringView
from policy.types import StorageKey, TenantId


class LmdbReader:
    """A read-only view of a server's LMDB tier from another process (a bulk read
    worker): LMDB serves readers in several processes at once, each read
    transaction a consistent snapshot of committed blocks. It writes nothing: a block
    that fails its checksum is reported as absent, and the server, reading it next,
    drops it (LmdbTier.read_many). Opening it runs LMDB's reader check: a worker that
    replaces one that died frees the dead one's slots before it reads."""

    def __init__(self, path: Path, map_bytes: int) -> None:
        self._env = lmdb.open(
            str(path),
            readonly=True,
            map_size=map_bytes,
            max_dbs=environment.MAX_DBS,
            subdir=True,
            readahead=False,
            lock=True,
            # The server's table, as sized, wins (it opened the environment first).
            max_readers=environment.MAX_READERS,
        )
        self._env.reader_check()
        self._blocks = self._env.open_db(environment.BLOCKS_DB, create=False)
        self._meta = self._env.open_db(environment.META_DB, create=False)
        self._retiring = RetiringView(path)

    def close(self) -> None:
        self._env.close()
        self._retiring.close()

    def any_retiring(self, keys: Sequence[StorageKey]) -> bool:
        """Whether any of `keys` may be a block the server's index no longer lists (its
        delete from LMDB still to commit): ask before `reads`, then hand such a read
        back (cacheserver.tiers.retiring)."""
        return self._retiring.any_retiring(keys)

    def reads(self) -> BlockReads:
        """A read transaction, `with` it: the views it returns are valid until the
        block ends, and its reader slot is free then. Unavailable when LMDB's reader
        table is full."""
        return BlockReads(environment.begin_read(self._env), self._blocks, self._meta)


class BlockReads:
    """The blocks of one read transaction (LmdbReader.reads)."""

    def __init__(self, txn: lmdb.Transaction, blocks: lmdb._Database, meta: lmdb._Database) -> None:
        self._txn: lmdb.Transaction | None = txn
        self._blocks = blocks
        self._meta = meta

    def __enter__(self) -> BlockReads:
        return self

    def __exit__(self, *exc: object) -> None:
        txn, self._txn = self._txn, None
        if txn is not None:
            txn.abort()  # a read transaction: nothing to commit; dropped, its slot is free

    @property
    def _open(self) -> lmdb.Transaction:
        assert self._txn is not None, "read after the transaction ended"
        return self._txn

    def leading_present(self, keys: Sequence[StorageKey]) -> int:
        """How many of `keys`, leading, are committed (checksums not read)."""
        txn = self._open
        for index, key in enumerate(keys):
            if txn.get(key, db=self._meta) is None:
                return index
        return len(keys)

    def leading(
        self, tenant: TenantId, keys: Sequence[StorageKey], max_bytes: int
    ) -> list[memoryview] | None:
        """Zero-copy views of the leading blocks of `keys` that are committed for
        `tenant` and whose checksum matches; the first that is not ends the list. None
        when they come to more than `max_bytes` (known from their sizes before any of
        their pages is touched). Valid until the transaction ends."""
        txn = self._open
        found: list[tuple[memoryview, bytes, StoredMeta]] = []
        total = 0
        for key in keys:
            raw_meta = txn.get(key, db=self._meta)
            raw = txn.get(key, db=self._blocks)
            if raw_meta is None or raw is None:
                break
            digest, meta = unpack_meta(key, raw_meta)
            if meta.tenant != tenant:
                break
            total += meta.size
            if total > max_bytes:
                return None
            found.append((memoryview(raw), digest, meta))
        out: list[memoryview] = []
        for view, digest, meta in found:
            if not intact(view, digest, meta):
                break
            out.append(view)
        return out
