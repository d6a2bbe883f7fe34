"""LMDB's reader table is sized above what every process can hold at once, and the
table of retired keys that bulk workers consult (cacheserver.tiers.retiring)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

from cacheserver.config import BulkConfig, ServerConfig
from cacheserver.config.specs import AUTO_MAX_WORKERS, MAX_BULK_WORKERS
from cacheserver.tiers import PendingWrite
from cacheserver.tiers.lmdb.environment import MAX_READERS
from cacheserver.tiers.lmdb.tier import LmdbTier
from cacheserver.tiers.retiring import RETIRING_SLOTS, RetiringKeys, RetiringView
from cacheserver.transport.bulk.readworkers import SERVER_OWN_READERS, lmdb_readers_needed
from cacheserver.transport.bulk.slots import MAX_AUTHENTICATED
from cacheserver.transport.grpc.threads import THREADS
from policy.types import StorageKey, TenantId

MiB = 1 << 20


def with_workers(workers: int) -> ServerConfig:
    return dataclasses.replace(ServerConfig(), bulk=BulkConfig(workers=workers))


def test_every_configuration_needs_fewer_readers_than_the_table_holds() -> None:
    # Every bulk connection, every gRPC pool thread, the server's own threads, and one
    # spare transaction per process.
    assert lmdb_readers_needed(with_workers(1)) == (
        MAX_AUTHENTICATED + 2 * THREADS + SERVER_OWN_READERS + 1
    )
    for workers in (1, 2, AUTO_MAX_WORKERS, MAX_BULK_WORKERS):
        assert lmdb_readers_needed(with_workers(workers)) <= MAX_READERS
    # The default (workers = 0: by the host's cores, at most AUTO_MAX_WORKERS).
    assert lmdb_readers_needed(ServerConfig()) <= lmdb_readers_needed(
        with_workers(AUTO_MAX_WORKERS)
    )
    # Headroom: twice the most that any valid configuration needs (the table found
    # full had 256 slots, as many as the bulk connections alone).
    assert 2 * lmdb_readers_needed(with_workers(MAX_BULK_WORKERS)) <= MAX_READERS


def test_the_server_sizes_the_table_and_another_process_takes_its_size(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path / "lmdb", map_bytes=64 * MiB, sync_writes=False)
    try:
        code = (
            "import sys, lmdb; env = lmdb.open(sys.argv[1], readonly=True, max_dbs=8, "
            "max_readers=126); print(env.max_readers())"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path / "lmdb")],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert int(out) == MAX_READERS
    finally:
        tier.close()


def key(first: int, rest: bytes | None = None) -> StorageKey:
    """A storage key whose slot in the retiring table is `first`."""
    return StorageKey(first.to_bytes(4, "little") + (rest or os.urandom(28)))


def test_a_retired_key_is_seen_by_a_worker_until_its_delete_settles(tmp_path: Path) -> None:
    keys = RetiringKeys(tmp_path)
    view = RetiringView(tmp_path)
    try:
        gone, live = key(7), key(8)
        assert not view.any_retiring([gone, live])
        keys.retire(gone)
        assert view.any_retiring([gone]) and view.any_retiring([live, gone])
        assert not view.any_retiring([live])
        keys.retire(gone)  # evicted again, after a put of it: two deletes to come
        keys.settled([gone])
        assert view.any_retiring([gone])
        keys.settled([gone])
        assert not view.any_retiring([gone])
        # A delete that was never retired (a Delete call) takes nothing back: a key
        # sharing its slot stays retired until its own delete.
        keys.retire(key(9))
        keys.settled([key(9), key(9)])
        assert not view.any_retiring([key(9)])
        keys.retire(key(9 + RETIRING_SLOTS))  # the same slot, another key
        assert view.any_retiring([key(9)])  # shared slot: handed back, never served
    finally:
        view.close()
        keys.close()


def test_a_restarted_server_starts_a_fresh_table_and_old_views_keep_theirs(tmp_path: Path) -> None:
    first = RetiringKeys(tmp_path)
    old_view = RetiringView(tmp_path)
    first.retire(key(3))
    first.close()
    second = RetiringKeys(tmp_path)
    new_view = RetiringView(tmp_path)
    try:
        assert not new_view.any_retiring([key(3)])
        assert old_view.any_retiring([key(3)])  # a stale worker's mapping is untouched
    finally:
        for table in (old_view, new_view, second):
            table.close()


def test_the_tier_settles_a_retired_key_once_its_delete_commits(tmp_path: Path) -> None:
    tier = LmdbTier(tmp_path / "lmdb", map_bytes=64 * MiB, sync_writes=False)
    view = RetiringView(tmp_path / "lmdb")
    try:
        victim = key(11)
        tier.write([PendingWrite(victim, TenantId("t"), 0, 0, b"payload")], [])
        tier.retire(victim)
        assert view.any_retiring([victim])
        tier.write([], [victim])
        assert not view.any_retiring([victim])
        assert tier.read_many([victim]) == [None]
    finally:
        view.close()
        tier.close()
