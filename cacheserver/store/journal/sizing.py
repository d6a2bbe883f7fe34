"""How big the put journal is: what was asked for, checked against the file system it
goes on.

The journal is a memory-backed file of its full capacity, made page by page ahead of
use; a page the file system cannot back fails a put with "no space" (`space.RingSpace`).
Where the room is much smaller than the 2 GiB default — a container's /dev/shm is
64 MiB, a Kubernetes emptyDir of medium Memory has its sizeLimit — a journal of the
default size would take every byte there and then fail puts. So, at start:

- `journal_bytes` at its default is an upper bound: the journal takes at most
  `FIT_SHARE` of what is free where it goes (the rest is left to whatever else uses
  that file system), logged in one line; below `MIN_CAPACITY` the start is refused.
- `journal_bytes` set to another value is what the operator asked for: used as is when
  that much is free there, else the start is refused. Never shrunk behind their back.

Every refusal is one ConfigError saying what to mount or set.
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path

from cacheserver.store.journal.ring import MIN_CAPACITY
from kvcommon.errors import ConfigError

log = logging.getLogger(__name__)

MiB = 1 << 20
FIT_SHARE = 3 / 4  # of the free space, for a journal sized by default
FIX = (
    "mount a larger memory-backed file system there (podman/docker: --shm-size or a "
    "--tmpfs; Kubernetes: an emptyDir with medium Memory and a larger sizeLimit), set "
    "[storage] journal_dir to one, or set [storage] journal_bytes = 0 (puts are then "
    "acknowledged after their LMDB commit)"
)


def free_bytes(path: Path) -> int:
    """What the file system of `path`'s directory has free for this user, plus what a
    journal already at `path` holds (it is replaced: a fresh journal takes its place)."""
    info = os.statvfs(path.parent)
    free = info.f_bavail * info.f_frsize
    with contextlib.suppress(FileNotFoundError):
        free += path.stat().st_blocks * 512
    return free


def journal_capacity(path: Path, configured: int, *, default: bool) -> int:
    """The journal's capacity at `path`: `configured` when it fits, or, if `default`,
    what fits; else ConfigError."""
    try:
        free = free_bytes(path)
    except OSError as error:
        raise ConfigError(
            f"cannot see the free space for the put journal in {path.parent} "
            f"({error.strerror}); set [storage] journal_dir"
        ) from None
    if configured <= free:
        return configured
    if not default:
        raise ConfigError(
            f"[storage] journal_bytes {configured} ({configured // MiB} MiB) does not fit "
            f"in {path.parent}: {free // MiB} MiB free there; lower journal_bytes, or "
            f"{FIX}"
        )
    fitted = int(free * FIT_SHARE) // MiB * MiB
    if fitted < MIN_CAPACITY:
        raise ConfigError(
            f"the put journal needs at least {MIN_CAPACITY // MiB} MiB in {path.parent}, "
            f"which has {free // MiB} MiB free; {FIX}"
        )
    log.info(
        "put journal: %d MiB in %s (%d MiB free there; the default %d MiB does not fit; "
        "set [storage] journal_bytes to choose)",
        fitted // MiB,
        path.parent,
        free // MiB,
        configured // MiB,
    )
    return fitted
