"""The put journal inside a container's limits: on a small memory-backed file system
(a real 32 MiB tmpfs, as a container's /dev/shm is 64 MiB), the default journal_bytes
(2 GiB) is fitted to what is free there, and a journal_bytes set larger than that is
refused at start with one line saying what to mount or set. Needs root to mount."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheserver.config import StorageConfig
from cacheserver.store.journal import default_journal_path
from tests.support.servers import launch, write_config
from tests.support.tmpfs import small_tmpfs as mounted_tmpfs

MiB = 1 << 20
MODEL = "sizing/model@r1;fp32;L2;H2;D8;B4;tp0/1"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def small_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs of its own (root only: mount)."""
    with mounted_tmpfs(tmp_path / "shm", 32, "to make a small tmpfs") as where:
        yield where


def test_default_journal_is_fitted_to_a_small_tmpfs(
    tmp_path: Path, small_tmpfs: Path, caplog: pytest.LogCaptureFixture
) -> None:
    tenancy = write_config(tmp_path)
    journal_dir = small_tmpfs / "journal"
    storage = StorageConfig(journal_dir=str(journal_dir))  # journal_bytes: the default
    assert storage.journal_bytes == 2 << 30
    with caplog.at_level(logging.INFO), launch(tenancy, storage=storage) as running:
        path = default_journal_path(running.data_dir, str(journal_dir))
        assert path is not None
        capacity = path.stat().st_size
        # At most 3/4 of the 32 MiB free, at least the 16 MiB minimum.
        assert 16 * MiB <= capacity <= 24 * MiB
        assert any(
            "put journal:" in r.getMessage() and "does not fit" in r.getMessage()
            for r in caplog.records
        )
        # The fitted journal takes puts past its capacity (it is drained into LMDB).
        with running.client("a", bulk=False) as client:
            blocks = [(os.urandom(32), os.urandom(MiB)) for _ in range(40)]
            for digest, payload in blocks:
                assert client.put("alpha", MODEL, [digest], [payload]) == [True]
            digests = [d for d, _ in blocks]
            assert client.get("alpha", MODEL, digests) == [p for _, p in blocks]


def serve(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "serve", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
    )


def test_a_journal_bytes_set_larger_than_the_tmpfs_is_refused_in_one_line(
    tmp_path: Path, small_tmpfs: Path
) -> None:
    journal_dir = small_tmpfs / "journal"
    extra = f'[storage]\njournal_dir = "{journal_dir}"\njournal_bytes = {64 * MiB}\n'
    done = serve(write_config(tmp_path, extra=extra).path)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith("kvshare serve: error: [storage] journal_bytes 67108864")
    assert f"does not fit in {journal_dir}" in done.stderr
    assert "memory-backed" in done.stderr and "journal_bytes = 0" in done.stderr
    # Positive control: a size that fits starts (and is used as set, never changed).
    ok_dir = tmp_path / "ok"
    ok_dir.mkdir()
    fits = f'[storage]\njournal_dir = "{journal_dir}"\njournal_bytes = {16 * MiB}\n'
    tenancy = write_config(ok_dir, extra=fits)
    with launch(tenancy) as running:
        path = default_journal_path(running.data_dir, str(journal_dir))
        assert path is not None and path.stat().st_size == 16 * MiB


def test_too_small_for_any_journal_is_refused_by_default(tmp_path: Path, small_tmpfs: Path) -> None:
    filler = small_tmpfs / "filler"
    filler.write_bytes(b"\0" * (20 * MiB))  # 12 MiB left: 3/4 of it is under 16 MiB
    journal_dir = small_tmpfs / "journal"
    done = serve(write_config(tmp_path, extra=f'[storage]\njournal_dir = "{journal_dir}"\n').path)
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "the put journal needs at least 16 MiB" in done.stderr
    assert "journal_bytes = 0" in done.stderr
