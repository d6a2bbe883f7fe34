"""The put journal's files: where they live, how they are opened, how their pages are
made ahead of use, and which are left over by servers that never came back.

Invariants:
- The server only ever opens (to write or to replay) a journal that is a private
  regular file of this user: mode 0600, one link, opened without following links.
- Its directory is private too. By default each start makes a fresh one in /dev/shm
  with an unpredictable name (mkdtemp: created 0700, atomically, or not at all): /dev/shm
  is world-writable, and a computable name there let anyone plant a file or a link that
  stopped the server from starting. The journal's path is recorded in
  LMDB with every drain, so the next start finds it to replay it. A configured
  `journal_dir` must be a directory of this user that no one else can enter or write.
- Every failure to make, check or open the journal is a ConfigError that says what to
  change: never a traceback.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import hashlib
import os
import stat
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

from cacheserver.store.journal.format import SUPERBLOCK_READ_BYTES, Record, owner_of, records_after
from cacheserver.tiers import Position
from kvcommon.errors import ConfigError
from policy.types import TenantId

FALLOCATE_STEP_BYTES = 1 << 20
MADV_POPULATE_WRITE = 23  # Linux 5.14+; older kernels refuse it (EINVAL)
_FALLOC_FL_KEEP_SIZE, _FALLOC_FL_PUNCH_HOLE = 1, 2

_LIBC_NAME = ctypes.util.find_library("c")
_LIBC = ctypes.CDLL(_LIBC_NAME, use_errno=True) if _LIBC_NAME else None


def open_private(path: Path, create: bool) -> int:
    """Open `path` read-write without following links; refuse files others could read."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags, 0o600)
    except FileNotFoundError:
        if create:
            raise ConfigError(f"cannot create the put journal {path}: no such directory") from None
        raise  # replay: a journal that is gone (a reboot cleared tmpfs) replays nothing
    except OSError as error:
        if error.errno == errno.ELOOP:
            raise ConfigError(f"journal {path} is a symbolic link; remove it") from None
        raise ConfigError(
            f"cannot open the put journal {path} ({error.strerror}); remove it, or set "
            "[storage] journal_dir to a private directory"
        ) from None
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


def replay(
    path: Path, after: Position, on_corrupt: Callable[[TenantId], None] | None = None
) -> Iterator[Record]:
    """The committed records after `after` in the journal at `path`, in order, each
    one whose payload fails its checksum reported to `on_corrupt` instead
    (`format.records_after`); nothing when the file is gone (a reboot cleared tmpfs)."""
    try:
        fd = open_private(path, create=False)
    except FileNotFoundError:
        return
    try:
        yield from records_after(fd, after, on_corrupt)
    finally:
        os.close(fd)


SHM = Path("/dev/shm")  # noqa: S108 (a private directory is made in it: new_journal_path)
JOURNAL_NAME = "put.journal"


def default_journal_path(data_dir: Path, journal_dir: str) -> Path | None:
    """Where the journal of `data_dir` lives when `journal_dir` is set (a per-user,
    per-data-dir name in that private directory); None by default: see
    `new_journal_path`."""
    if not journal_dir:
        return None
    digest = hashlib.sha256(str(data_dir.resolve()).encode("utf-8")).hexdigest()[:16]
    return Path(journal_dir) / f"kvshare-{os.getuid()}-{digest}.journal"


def new_journal_path(data_dir: Path, journal_dir: str) -> Path | None:
    """Where a fresh journal goes: in `journal_dir` (made private, or checked to be),
    else in a new private directory on /dev/shm when that is a writable tmpfs; None
    when neither (no journal: puts are acknowledged after their LMDB commit)."""
    configured = default_journal_path(data_dir, journal_dir)
    if configured is not None:
        _make_private_dir(configured.parent)
        return configured
    if not (SHM.is_dir() and os.access(SHM, os.W_OK | os.X_OK) and _is_tmpfs(SHM)):
        return None
    try:
        return Path(tempfile.mkdtemp(prefix=f"kvshare-{os.getuid()}-", dir=SHM)) / JOURNAL_NAME
    except OSError as error:
        raise ConfigError(
            f"cannot make a private directory for the put journal in {SHM} "
            f"({error.strerror}); set [storage] journal_dir"
        ) from None


def _make_private_dir(directory: Path) -> None:
    """`directory` exists, is a directory (not a link) of this user, and no one else
    may enter or write it; else ConfigError."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        info = directory.lstat()
    except OSError as error:
        raise ConfigError(
            f"cannot make journal_dir {directory} ({error.strerror}); set [storage] "
            "journal_dir to a directory this user can create"
        ) from None
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise ConfigError(
            f"journal_dir {directory} is not a private directory of this user (a real "
            "directory, mode 0700); fix it or pick another [storage] journal_dir"
        )


def remove_journal(path: Path) -> None:
    """Remove a journal no longer needed, and its private directory on /dev/shm."""
    path.unlink(missing_ok=True)
    if _is_own_private_dir(path.parent):
        with contextlib.suppress(OSError):
            path.parent.rmdir()


def _is_own_private_dir(directory: Path) -> bool:
    if directory.parent != SHM or not directory.name.startswith(f"kvshare-{os.getuid()}-"):
        return False
    try:
        info = directory.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & 0o077


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
    """Remove journals whose data dir no longer exists: left by servers killed and never
    started again on their data dir, each holding up to its capacity of tmpfs (memory).
    Looked for in `directory` (named per user and data dir) and in this user's private
    directories on /dev/shm. Only this user's private files of this format are
    considered; a journal whose data dir exists is kept, as its server may come back to
    replay it. Returns what was removed."""
    uid = os.getuid()
    candidates = list(directory.glob(f"kvshare-{uid}-*.journal"))
    candidates += [d / JOURNAL_NAME for d in SHM.glob(f"kvshare-{uid}-*") if d.is_dir()]
    removed = []
    for candidate in candidates:
        if candidate == keep or (
            candidate.parent != directory and not _is_own_private_dir(candidate.parent)
        ):
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
            remove_journal(candidate)
            removed.append(candidate)
    return removed


def fallocate_in_steps(fd: int, start: int, end: int) -> None:
    """Reserve the file's blocks from `start` to `end`, in small steps: fallocate holds
    the file's lock throughout, and a put's header write (pwrite) waits for it
    spinning, ~4 ms for 32 MiB at once. Raises OSError when the file system is full."""
    for step in range(start, end, FALLOCATE_STEP_BYTES):
        os.posix_fallocate(fd, step, min(FALLOCATE_STEP_BYTES, end - step))


def populate(address: int, length: int) -> bool | None:
    """Make the mapped pages at `address` now (MADV_POPULATE_WRITE), through ctypes,
    which lets go of the GIL: mmap.madvise holds it for the whole call (~4 ms per
    32 MiB), stalling every connection thread. The range must start on a page
    boundary. True: every page is made, so the file system backs them (writing them
    cannot fault); False: it could not back them all (full: the kernel stops with
    EFAULT, no SIGBUS); None: the kernel does not know the advice (before Linux 5.14)."""
    if _LIBC is None:
        return None
    if _LIBC.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_POPULATE_WRITE) == 0:
        return True
    return None if ctypes.get_errno() == errno.EINVAL else False


def give_back(fd: int, start: int, length: int) -> None:
    """Free the file's pages from `start` for `length` bytes (a hole; the size stays):
    what a populate that failed partway made beyond what the journal uses. Best effort."""
    if _LIBC is not None and length > 0:
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        _LIBC.fallocate(fd, mode, ctypes.c_int64(start), ctypes.c_int64(length))
