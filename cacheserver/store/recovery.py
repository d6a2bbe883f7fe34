"""Start-up: the index rebuilt from LMDB, retired blocks reclaimed, the journal replayed
and a fresh journal opened. Runs once, in `BlockStore.__init__`, before any thread of
the store starts and before any request is served.

Invariants:
- After start-up the index lists exactly the blocks LMDB holds for current epochs of
  configured tenants, within the disk budget: blocks of retired epochs or removed
  tenants are deleted (crypto-shredding plus reclamation), and a lowered budget evicts
  the least recently used blocks.
- Nothing acknowledged is lost by a crash: the records a crash left out of LMDB are
  replayed through the normal admission (quotas, budget, first writer wins) before the
  fresh journal's start position replaces the old one in LMDB. When LMDB cannot take
  them, the start fails and the old journal stays (`JournalNotReplayed`).
- A committed record whose payload fails its checksum at replay is never stored; it is
  counted as an integrity failure, like a corrupt block read from LMDB.
- The fixed-order namespaces (the public scope) are back in the memory tier, in put
  order, before any request: reads never bring them back (`restore_pinned`).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable
from pathlib import Path

from cacheserver.config import StorageConfig
from cacheserver.store.commit import commit_batch
from cacheserver.store.jobs import PutJob, was_stored
from cacheserver.store.journal import (
    Journal,
    new_journal_path,
    remove_journal,
    remove_orphans,
    replay,
)
from cacheserver.store.journal.sizing import journal_capacity
from cacheserver.store.tiering import IndexedTiers
from cacheserver.store.writer import MAX_BATCH_BYTES
from cacheserver.tiers import JournalCheckpoint, Position
from kvcommon.errors import ConfigError, KvshareError
from policy.types import StorageKey, TenantId

log = logging.getLogger(__name__)
DEFAULT_JOURNAL_BYTES = StorageConfig().journal_bytes


def rebuild_index(tiers: IndexedTiers, epochs: dict[TenantId, int]) -> int:
    """Load the disk index; reclaim blocks of retired epochs or removed tenants and
    evict down to the budget. Returns how many blocks were reclaimed."""
    disk, index = tiers.disk, tiers.index
    stale: list[StorageKey] = []
    live = []
    for meta in disk.scan():
        if meta.tenant in epochs and meta.epoch == epochs[meta.tenant]:
            live.append(meta)
        else:
            stale.append(meta.key)
    for meta in sorted(live, key=lambda m: m.clock):
        index.add(meta.key, meta.tenant, meta.size, clock=meta.clock, tag=meta.model_tag)
    reclaimed = 0
    if stale:
        reclaimed = disk.delete(stale)
        log.info("reclaimed %d blocks of retired epochs or removed tenants", len(stale))
    if index.used_bytes > index.budget_bytes:  # the budget was lowered
        victims = []
        excess = index.used_bytes - index.budget_bytes
        for key, entry in index.oldest_first():
            if excess <= 0:
                break
            victims.append(key)
            excess -= entry.size
            tiers.events.evicted("lmdb", "budget", entry.size)
        with tiers.lock:
            tiers.remove_everywhere(victims)
        disk.delete(victims)
    return reclaimed


def restore_pinned(tiers: IndexedTiers) -> int:
    """Read the blocks of fixed-order namespaces from LMDB into the memory tier, oldest
    put first, as their puts had left them there; returns how many. Reads never
    promote these blocks (docs/isolation.md, public scope), so without this a restart
    would leave them on disk for good, each read as fast as the page cache happened to
    make it. Runs before the replay, whose blocks are newer."""
    memory, index = tiers.memory, tiers.index
    keys = [key for tenant in sorted(memory.fixed_order) for key in index.keys_of(tenant)]
    keys.sort(key=lambda key: entry.clock if (entry := index.get(key)) else 0)
    restored = start = 0
    while start < len(keys):
        batch, size = [], 0
        while start < len(keys) and size < MAX_BATCH_BYTES:
            entry = index.get(keys[start])
            batch.append(keys[start])
            size += entry.size if entry is not None else 0
            start += 1
        for key, payload in zip(batch, tiers.disk.read_many(batch), strict=True):
            entry = index.get(key)
            if payload is not None and entry is not None:
                with tiers.lock:
                    restored += memory.admit(key, entry.tenant, payload)
    if restored:
        log.info("restored %d published blocks to the memory tier", restored)
    return restored


def replay_journal(
    tiers: IndexedTiers,
    epochs: dict[TenantId, int],
    recorded: JournalCheckpoint | None,
    on_corrupt: Callable[[TenantId, int], None],
) -> int:
    """Commit to LMDB the journaled puts a crash left out of it; returns how many.

    Runs after the index is rebuilt, so replayed blocks are admitted (quotas,
    budget, first writer wins) like new puts. Blocks of retired epochs or removed
    tenants are skipped, as start-up reclamation would drop them anyway.

    Records whose payload fails its checksum are dropped, counted
    (`IndexedTiers.journal_integrity_failures`) and reported to `on_corrupt(tenant, blocks)`. Raises
    JournalNotReplayed when LMDB cannot take the rest (its map or the disk is full):
    the start fails, and the journal is left as it is for the next one."""
    if recorded is None:
        return 0
    position, path = recorded
    batch: list[PutJob] = []
    size = replayed = 0
    last = position

    def commit() -> int:
        failure = commit_batch(tiers, batch, drained=(last, path))
        if failure is not None:
            raise JournalNotReplayed(path, failure)
        return sum(1 for job in batch if was_stored(job))

    corrupt: collections.Counter[TenantId] = collections.Counter()
    for record in replay(path, position, on_corrupt=lambda tenant: corrupt.update([tenant])):
        last = Position(position.journal_id, record.seq, record.end)
        if epochs.get(record.tenant) != record.epoch:
            continue
        batch.append(
            PutJob(record.key, record.tenant, record.epoch, record.payload, record.model_tag)
        )
        size += len(record.payload)
        if size >= MAX_BATCH_BYTES:
            replayed += commit()
            batch, size = [], 0
    if batch or last != position:
        replayed += commit()
    if last != position:
        log.info("replayed %d journaled puts into LMDB after an unclean stop", replayed)
    if corrupt:
        log.warning(
            "dropped %d journaled puts whose bytes failed their checksum at replay "
            "(counted in integrity_failures)",
            corrupt.total(),
        )
    tiers.journal_integrity_failures += corrupt.total()
    for tenant, blocks in corrupt.items():
        on_corrupt(tenant, blocks)
    return replayed


class JournalNotReplayed(ConfigError):
    """The journal holds acknowledged blocks LMDB cannot take. They exist nowhere else,
    so the server does not start without them: starting would open a fresh journal and
    record its start in LMDB, and the old one, never replayed, would be lost. The start
    fails with what to change instead (a bigger map, a lower disk budget so that the
    start evicts, or disk space); commits made before the failure recorded how far the
    replay got, and the next start goes on from there."""

    def __init__(self, path: Path, failure: KvshareError) -> None:
        super().__init__(
            f"the put journal {path} holds acknowledged blocks that LMDB cannot take: "
            f"{failure}. The journal is kept; start again once that is changed"
        )


def open_journal(
    tiers: IndexedTiers, data_dir: Path, storage: StorageConfig, recorded: JournalCheckpoint | None
) -> tuple[Journal, Path] | None:
    """Start a fresh journal, and record its start in LMDB; `recorded` is the one
    replayed at start-up, if any. None: no tmpfs for it (puts are then acknowledged
    after their LMDB commit). Every failure is a ConfigError saying what to change
    (cacheserver.store.journal.files)."""
    path = new_journal_path(data_dir, storage.journal_dir)
    if path is None:
        log.info(
            "no tmpfs for the put journal (set [storage] journal_dir): puts are "
            "acknowledged after their LMDB commit"
        )
        return None
    if recorded is not None and recorded[1] != path:
        remove_journal(recorded[1])  # replayed above; the journal moved
    # A container's /dev/shm or a memory-backed volume may be far smaller than the
    # default: the default is then fitted to it, a value set in the config refused.
    capacity = journal_capacity(
        path, storage.journal_bytes, default=storage.journal_bytes == DEFAULT_JOURNAL_BYTES
    )
    journal = Journal(path, capacity, recorded[0].seq if recorded else 0, owner=data_dir)
    for orphan in remove_orphans(path.parent, keep=path):
        log.info("removed %s: the put journal of a data dir that no longer exists", orphan)
    # From here on a replay follows the new journal's chain, which starts empty.
    tiers.disk.write([], [], drained=(journal.start, path))
    return journal, path
