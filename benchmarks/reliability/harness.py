"""Real servers for the reliability campaign: configs, `kvshare serve` processes, RSS.

Everything here drives the server through its public interfaces only: a TOML config,
the `kvshare serve` command in a child process (so it can be killed with -9, paused
with SIGSTOP, or die on its own), and `BlockClient`. The server's stderr goes to a
file, never to an unread pipe (a pipe that fills would stall the server itself), so a
campaign can count the tracebacks the server logged.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]
SERVING_RE = re.compile(r"serving on (\S+)")
# What the server writes to its log when a request failed in a way that is a bug: the
# gRPC wrapper's "internal error in <method>", the bulk listener's "bulk connection
# failed" (an exception other than a client going away), and any Python traceback.
INTERNAL_MARKERS = ("internal error in", "bulk connection failed", "Traceback (most recent")


@dataclass(frozen=True)
class TenantSpec:
    id: str
    quota_bytes: int = 0


@dataclass(frozen=True)
class PrincipalSpec:
    name: str
    tenants: tuple[str, ...]
    actions: tuple[str, ...]


@dataclass
class Tenancy:
    """A config file and the bearer tokens of its principals."""

    path: Path
    data_dir: Path
    tokens: dict[str, str] = field(default_factory=dict)


def toml_list(values: Sequence[str]) -> str:
    return "[" + ", ".join(f'"{v}"' for v in values) + "]"


def write_tenancy(
    directory: Path,
    tenants: Sequence[TenantSpec],
    principals: Sequence[PrincipalSpec],
    *,
    storage: Mapping[str, int | bool | str] | None = None,
    limits: Mapping[str, int] | None = None,
    tokens: Mapping[str, str] | None = None,
    name: str = "kvshare.toml",
) -> Tenancy:
    """A config with these tenants and principals (no rate limit unless `limits` sets
    one), data in `directory/data`. `tokens` reuses earlier tokens by principal name, so
    a rewritten config (another journal setting) keeps the clients' credentials."""
    directory.mkdir(parents=True, exist_ok=True)
    tenancy = Tenancy(directory / name, directory / "data")
    lines = [f'data_dir = "{tenancy.data_dir}"', 'listen = "127.0.0.1:0"']
    lines += ["[storage]", *(f"{k} = {_toml_value(v)}" for k, v in (storage or {}).items())]
    lines += ["[limits]", "requests_per_s = 0"]
    lines += [f"{k} = {v}" for k, v in (limits or {}).items() if k != "requests_per_s"]
    for tenant in tenants:
        lines += ["[[tenants]]", f'id = "{tenant.id}"', f"quota_bytes = {tenant.quota_bytes}"]
    for principal in principals:
        token = (tokens or {}).get(principal.name) or secrets.token_urlsafe(24)
        tenancy.tokens[principal.name] = token
        lines += [
            "[[principals]]",
            f'name = "{principal.name}"',
            f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"',
            f"tenants = {toml_list(principal.tenants)}",
            f"actions = {toml_list(principal.actions)}",
        ]
    tenancy.path.write_text("\n".join(lines) + "\n")
    return tenancy


def _toml_value(value: int | bool | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    return str(value)


class ServerProc:
    """`kvshare serve --config FILE` as a child process of this one."""

    def __init__(
        self,
        config: Path,
        log_path: Path,
        *,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 60.0,
        extra_args: Sequence[str] = (),
        max_descriptors: int = 0,
    ) -> None:
        """`max_descriptors`: the server's RLIMIT_NOFILE (0: inherited)."""
        self.config = config
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "ab")  # noqa: SIM115 - kept for the process
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvshare.cli", "serve", "--config", str(config), *extra_args],
            stdout=subprocess.PIPE,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            preexec_fn=descriptor_limit(max_descriptors) if max_descriptors else None,
        )
        self.address = self._wait_ready(startup_timeout_s)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _wait_ready(self, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                self.proc.wait(timeout=10)
                self._log.close()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"server exited ({self.proc.returncode}): {tail}")
            match = SERVING_RE.search(line)
            if match:
                # Nothing else is printed to stdout until "stopped cleanly": no pipe fills.
                return match.group(1)
        self.kill9()
        raise RuntimeError("server did not print 'serving on' in time")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(sig)

    def kill9(self) -> None:
        self.signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._close()

    def terminate(self, timeout_s: float = 60.0) -> int:
        """SIGTERM, then wait (SIGCONT first, in case it was paused); -9 after timeout_s."""
        self.signal(signal.SIGCONT)
        self.signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill9()
            raise RuntimeError(f"server did not stop within {timeout_s} s of SIGTERM") from None
        self._close()
        return self.proc.returncode

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        self._log.close()

    def rss_bytes(self) -> int:
        return rss_bytes(self.pid)

    def owned_rss_bytes(self) -> int:
        return owned_rss_bytes(self.pid)


def descriptor_limit(count: int) -> Callable[[], None]:
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))

    return limit


def rss_bytes(pid: int, fields: tuple[str, ...] = ("VmRSS",)) -> int:
    """Resident set size of process `pid` (0 once it is gone): the sum of `fields` of
    /proc/PID/status (kB each)."""
    total = 0
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in fields:
                total += int(rest.split()[0]) * 1024
    except OSError:
        return 0
    return total


def owned_rss_bytes(pid: int) -> int:
    """What process `pid` holds in memory of its own: anonymous pages (heap, buffers)
    and shared-memory pages (the journal and the arenas live on tmpfs). Not LMDB's
    data file mapped read-only, whose resident pages are the page cache, dropped by the
    kernel under pressure and grown by every read of a large database."""
    return rss_bytes(pid, ("RssAnon", "RssShmem"))


def count_internal_errors(log_path: Path, start: int = 0) -> int:
    """Lines in the server log after byte `start` that mark a bug (INTERNAL_MARKERS)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return 0
    return sum(1 for line in text.splitlines() if any(m in line for m in INTERNAL_MARKERS))


def log_size(log_path: Path) -> int:
    try:
        return log_path.stat().st_size
    except OSError:
        return 0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(predicate: object, timeout_s: float, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(interval_s)
    return bool(predicate())  # type: ignore[operator]


SIGSTOP, SIGCONT = signal.SIGSTOP, signal.SIGCONT


@contextlib.contextmanager
def private_journal_dir(prefix: str = "kvshare-rel-") -> Iterator[Path]:
    """A fresh 0700 directory on /dev/shm (tmpfs, where the server's journal belongs)
    for `[storage] journal_dir`, removed at the end with whatever a killed server left."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
