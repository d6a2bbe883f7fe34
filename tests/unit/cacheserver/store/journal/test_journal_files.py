"""The put journal's files: private opening, where they live, orphans, space."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cacheserver.store.journal import (
    MIN_CAPACITY,
    Journal,
    default_journal_path,
    remove_orphans,
    replay,
)
from cacheserver.store.journal.files import fallocate_in_steps, open_private
from cacheserver.tiers import Position
from kvcommon.errors import ConfigError


def test_a_planted_or_shared_journal_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ConfigError, match="symbolic link"):
        Journal(link, MIN_CAPACITY)
    readable = tmp_path / "readable"
    readable.write_bytes(b"")
    readable.chmod(0o644)
    with pytest.raises(ConfigError, match="mode 0600"):
        Journal(readable, MIN_CAPACITY)


def test_a_file_with_a_second_link_or_not_a_regular_file_is_refused(tmp_path: Path) -> None:
    private = tmp_path / "private"
    os.close(open_private(private, create=True))  # positive control: created, and reopened
    assert private.stat().st_mode & 0o777 == 0o600
    os.close(open_private(private, create=False))
    os.link(private, tmp_path / "second-name")  # someone else can reach it under theirs
    with pytest.raises(ConfigError, match="one link"):
        open_private(private, create=False)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    with pytest.raises(ConfigError, match="regular file"):
        open_private(fifo, create=False)


def test_a_missing_journal_replays_nothing_and_is_not_created(tmp_path: Path) -> None:
    gone = tmp_path / "gone"
    assert list(replay(gone, Position(bytes(16), 0, 4096))) == []
    assert not gone.exists()


def test_each_data_dir_has_its_own_journal_name_for_this_user(tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    path = default_journal_path(one, str(tmp_path / "journals"))
    assert path is not None
    assert path.parent == tmp_path / "journals"
    assert path.name.startswith(f"kvshare-{os.getuid()}-") and path.name.endswith(".journal")
    assert default_journal_path(one, str(tmp_path / "journals")) == path  # stable
    assert default_journal_path(two, str(tmp_path / "journals")) != path


def test_journals_of_data_dirs_that_are_gone_are_removed(tmp_path: Path) -> None:
    """A server killed and never started again leaves its journal on tmpfs (memory);
    the next server to start in that directory removes it once its data dir is gone."""
    shm = tmp_path / "shm"
    shm.mkdir()
    alive, gone = tmp_path / "alive", tmp_path / "gone"
    alive.mkdir()
    gone.mkdir()
    uid = os.getuid()
    own = Journal(shm / f"kvshare-{uid}-own.journal", MIN_CAPACITY, owner=alive)
    other_alive = Journal(shm / f"kvshare-{uid}-a.journal", MIN_CAPACITY, owner=alive)
    orphan = Journal(shm / f"kvshare-{uid}-b.journal", MIN_CAPACITY, owner=gone)
    unrelated = shm / f"kvshare-{uid}-c.journal"
    unrelated.write_bytes(b"not a journal" * 100)
    unrelated.chmod(0o600)
    gone.rmdir()
    assert remove_orphans(shm, keep=own.path) == [orphan.path]
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        [own.path.name, other_alive.path.name, unrelated.name]
    )


def test_file_space_is_reserved_in_steps(tmp_path: Path) -> None:
    fd = open_private(tmp_path / "j", create=True)
    try:
        os.ftruncate(fd, 8 << 20)
        assert os.fstat(fd).st_blocks == 0  # sparse: no block is reserved yet
        fallocate_in_steps(fd, 0, (3 << 20) + 4096)
        assert os.fstat(fd).st_blocks * 512 >= (3 << 20) + 4096
    finally:
        os.close(fd)
