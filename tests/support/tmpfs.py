"""A small tmpfs of a test's own, for what a full or small file system does (a
container's /dev/shm, a data dir out of space). Mounting needs root and mount(8): where
either is missing, or the mount is refused, the test is skipped saying so."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest


@contextmanager
def small_tmpfs(where: Path, size_mib: int, purpose: str) -> Iterator[Path]:
    """A `size_mib` MiB tmpfs (mode 0700) mounted at `where` (made here), unmounted
    after; `purpose` ends the skip reason ("to make a small tmpfs")."""
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip(f"needs root and mount(8) {purpose}")
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)
