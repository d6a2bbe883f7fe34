"""The put journal's files: where they live, how they are opened, how their pages are
made ahead of use, and which are left over by servers that never came back.

Invariant: the server only ever opens (to write or to replay) a journal that is a
private regular file of this user: mode 0600, one link, opened without following
links. The default directory (/dev/shm) is world-writable, so a file someone else
planted under our name (or a link to one) must never be used.

Known gap (issue 15, F8): the default name is computable by anyone (uid + a hash of the
data dir), so a planted file stops the server from starting (a clear ConfigError), and a
planted link or a file of another user can still surface as an unhandled OSError from
`open_private` (PermissionError) instead of a ConfigError. The fix belongs here: a
private directory (0700, owned, checked) or an unpredictable name in
`default_journal_path`, and every OSError of `open_private` turned into a ConfigError.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from cacheserver.journal.format import SUPERBLOCK_READ_BYTES, Record, owner_of, records_after
from cacheserver.tiers import Position
from kvcommon.errors import ConfigError

FALLOCATE_STEP_BYTES = 1 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL)

_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME, use_errno=True) if _LIBC_NAME else None


def open_private(path: Path, create: bool) -> int:
    """Open `path` read-write without following links; refuse files others could read."""
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


def replay(path: Path, after: Position) -> Iterator[Record]:
    """The committed records after `after` in the journal at `path`, in order
    (`format.records_after`); nothing when the file is gone (a reboot cleared tmpfs)."""
    try:
        fd = open_private(path, create=False)
    except FileNotFoundError:
        return
    try:
        yield from records_after(fd, after)
    finally:
        os.close(fd)


def default_journal_path(data_dir: Path, journal_dir: str) -> Path | None:
    """Where the journal of `data_dir` lives: in `journal_dir` when set, else on
    /dev/shm when that is a writable tmpfs; None when neither (no journal)."""
    digest = hashlib.sha256(str(data_dir.resolve()).encode("utf-8")).hexdigest()[:16]
    name = f"kvshare-{os.getuid()}-{digest}.journal"
    if journal_dir:
        return Path(journal_dir) / name
    # Not a temporary file: a fixed, per-user, per-data-dir name opened with O_NOFOLLOW
    # and checked to be a private regular file (open_private).
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
            fd = open_private(candidate, create=False)
        except (OSError, ConfigError):
            continue
        try:
            raw = os.pread(fd, SUPERBLOCK_READ_BYTES, 0)
        finally:
            os.close(fd)
        owner = owner_of(raw)
        if owner and not Path(owner).exists():
            candidate.unlink(missing_ok=True)
            removed.append(candidate)
    return removed


def fallocate_in_steps(fd: int, start: int, end: int) -> None:
    """Reserve the file's blocks from `start` to `end`, in small steps: fallocate holds
    the file's lock throughout, and a put's header write (pwrite) waits for it
    spinning, ~4 ms for 32 MiB at once. Raises OSError when the file system is full."""
    for step in range(start, end, FALLOCATE_STEP_BYTES):
        os.posix_fallocate(fd, step, min(FALLOCATE_STEP_BYTES, end - step))


def populate(address: int, length: int) -> None:
    """Make the mapped pages at `address` now (MADV_POPULATE_WRITE), through ctypes,
    which lets go of the GIL: mmap.madvise holds it for the whole call (~4 ms per
    32 MiB), stalling every connection thread. The range must start on a page
    boundary. Where the kernel refuses it, pages are made on first touch instead."""
    if _LIBC is not None:
        _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE)
