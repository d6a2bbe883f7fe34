"""A replica's credentials, re-read when their files change: the token and the keyring.

Invariant: a credential in use was parsed whole from one version of its file. A change
is noticed by the file's identity (device, inode, size, mtime, ctime), looked at no
more often than every `check_interval_s`, on the call path (a stat: about a
microsecond). A changed file is read and parsed in full, and taken only when its
identity did not change while it was read and its last write is at least `settle_s`
old: a writer that rewrites the file in place may pause half way, and half a token is
still a well-formed token. A file that cannot be read or parsed (or has become
readable by others) leaves the credential in use as it was, with one log line per
version of the file. To rotate, write the new file beside the old one and rename it
over (atomic; a Kubernetes secret volume swaps a symlink, which is the same).

What follows from a change: a new token is sent from the next call on (bulk
connections already open keep the principal they were opened with until the server
closes them); a keyring's newest version seals new blocks, every version it still
lists opens old ones, and a version it no longer lists opens nothing.
"""

from __future__ import annotations

import logging
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypedDict, TypeVar, Unpack

from kvcommon.errors import ConfigError
from policy.sealing import BlockSealer, Keyring

log = logging.getLogger(__name__)
T = TypeVar("T")

# Rotation is an operator's step, so a second is prompt; a stat per second per process
# costs nothing on the call path.
DEFAULT_CHECK_INTERVAL_S = 1.0
# A file written in place is taken once it has been left alone this long.
DEFAULT_SETTLE_S = 0.2


@dataclass(frozen=True)
class _Identity:
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int


def _identity(path: Path) -> _Identity:
    info = path.stat()  # follows symlinks: a swapped secret-volume link is a change
    return _Identity(info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


class WatchTimes(TypedDict, total=False):
    """How a credential file is watched, as TokenFile and KeyringFileSealer take it;
    each left out is WatchedFile's default."""

    check_interval_s: float
    settle_s: float
    clock: Callable[[], float]


class WatchedFile(Generic[T]):
    """The parsed content of a file, re-read when the file changes (see the module)."""

    def __init__(
        self,
        path: Path,
        parse: Callable[[Path], T],
        *,
        what: str,
        check_interval_s: float = DEFAULT_CHECK_INTERVAL_S,
        settle_s: float = DEFAULT_SETTLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Reads the file now: a file that is not usable at start-up raises ConfigError.
        `what` names the credential in log lines ("token_file")."""
        self.path = path
        self.what = what
        self._parse = parse
        self._check_interval_s = check_interval_s
        self._settle_ns = int(settle_s * 1e9)
        self._clock = clock
        self._lock = threading.Lock()
        try:
            loaded = _identity(path)
        except OSError as error:
            raise ConfigError(f"{what}: cannot read {path}: {error.strerror}") from None
        self._value = parse(path)
        self._loaded = loaded
        self._complained: object = None
        self._next_check = clock() + check_interval_s
        self.generation = 1  # counts the versions taken

    def current(self) -> T:
        """The credential to use now (the file is looked at if it is time to)."""
        if self._clock() < self._next_check:
            return self._value
        with self._lock:
            now = self._clock()
            if now >= self._next_check:
                self._next_check = now + self._check_interval_s
                self._refresh()
            return self._value

    def _refresh(self) -> None:
        try:
            seen = _identity(self.path)
        except OSError as error:
            self._complain(("stat", error.errno), f"cannot be read ({error.strerror})")
            return
        if seen == self._loaded:
            return
        if time.time_ns() - seen.mtime_ns < self._settle_ns:
            return  # maybe still being written: look again at the next check
        try:
            value = self._parse(self.path)
            still = _identity(self.path)
        except ConfigError as error:
            self._complain(seen, str(error))
            return
        except OSError as error:
            self._complain(seen, f"cannot be read ({error.strerror})")
            return
        if still != seen:
            return  # changed while it was read: the next check reads the new version
        self._value, self._loaded, self._complained = value, seen, None
        self.generation += 1
        log.warning("%s %s changed: the new version is in use", self.what, self.path)

    def _complain(self, version: object, reason: str) -> None:
        """One line per version of the file that cannot be used."""
        if version == self._complained:
            return
        self._complained = version
        log.warning(
            "%s %s changed but cannot be used: %s; the previous version stays in use until "
            "the file is fixed",
            self.what,
            self.path,
            reason,
        )


def read_secret_file(path: Path, key: str) -> str:
    """A credential from a file that only its owner may read (as the server's dev
    token is written): a world-readable token is someone else's token too."""
    try:
        info = path.stat()
        text = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise ConfigError(f"{key}: cannot read {path}: {error.strerror}") from None
    if stat.S_IMODE(info.st_mode) & 0o077:
        raise ConfigError(f"{key}: {path} is readable by group or others; chmod 600 it")
    if not text:
        raise ConfigError(f"{key}: {path} is empty")
    return text


class TokenFile(WatchedFile[str]):
    """A bearer token file (owner-only), re-read when it changes: pass it to
    `BlockClient` (or `ReplicaAgent.connect`) in place of the token."""

    def __init__(self, path: Path, **watch: Unpack[WatchTimes]) -> None:
        super().__init__(
            path, lambda p: read_secret_file(p, "token_file"), what="token_file", **watch
        )

    def __call__(self) -> str:
        return self.current()


class KeyringFileSealer(BlockSealer):
    """A `BlockSealer` over a keyring file that is re-read when it changes: each seal
    uses the newest version the file lists now, each open the versions it lists now."""

    def __init__(self, path: Path, **watch: Unpack[WatchTimes]) -> None:
        # BlockSealer's own attribute is the property below: no super().__init__.
        self._file = WatchedFile(path, Keyring.from_file, what="keyring_file", **watch)

    @property
    def keyring(self) -> Keyring:
        return self._file.current()

    @keyring.setter
    def keyring(self, keyring: Keyring) -> None:
        raise AttributeError("the keyring comes from its file: rewrite the file instead")

    @property
    def generation(self) -> int:
        """How many versions of the keyring file were taken (1: the first)."""
        return self._file.generation
