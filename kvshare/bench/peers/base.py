"""What every benchmarked system provides, and the plumbing to run its server.

A `System` lives in the parent process: it starts and stops one server. The
`ClientSpec` it returns is a small picklable value that a client process (spawned, so
the GIL of one process never caps several clients) turns into a `BenchClient`.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

SERVER_START_TIMEOUT_S = 60.0


class BenchError(RuntimeError):
    """A benchmarked system failed in a way that makes its figures meaningless."""


class BenchClient(Protocol):
    """One connection to one server. Payloads in and out are borrowed views."""

    def prepare(self, value_bytes: int, blocks_per_call: int) -> None:
        """Allocate what a call of this shape needs, so timing never pays for it."""

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        """Store each value under its key; returns once the server acknowledged."""

    def get(self, keys: Sequence[bytes]) -> Sequence[memoryview | bytes]:
        """The values of the leading keys present (a view may be reused by the next call)."""

    def lookup(self, keys: Sequence[bytes]) -> int:
        """How many of `keys` the server holds, in one request where the protocol
        allows (no payload moves): what a scheduler asks per new request."""

    def close(self) -> None: ...


class ClientSpec(Protocol):
    def connect(self) -> BenchClient: ...


class System(Protocol):
    """A benchmarked system: one server process, started and stopped by the harness."""

    name: str
    # False where the protocol has no reply to a PUT: the client then waits for one
    # round trip after it (see the system's module), and the report says so.
    is_put_acknowledged: bool
    supports_batch_get: bool
    # False where the protocol cannot ask whether keys exist without reading them.
    supports_lookup: bool

    def unavailable_reason(self) -> str | None:
        """Why this system cannot run here (not installed, not built yet), or None."""

    def start(self, workdir: Path) -> ClientSpec: ...

    def reserve(self, value_bytes: int, count: int) -> None:
        """Set up, untimed, what the next `count` PUTs of this size need (the ceiling only)."""

    def clear(self) -> bool:
        """Drop stored values between cells; False where the server cannot."""

    def server_pids(self) -> list[int]:
        """The running server's processes, whose CPU time the harness reads around each
        timed cell (kvshare.bench.cpu); [] where it does not know them."""

    def stop(self) -> None: ...


def free_loopback_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (for servers without port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def wait_for_port(host: str, port: int, timeout_s: float, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise BenchError(f"server exited with status {process.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return
        except OSError:
            time.sleep(0.05)
    raise BenchError(f"server did not listen on {host}:{port} within {timeout_s:.0f} s")


@dataclass
class ServerProcess:
    """A server subprocess whose output goes to a log file in the run's work dir."""

    process: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes]

    @classmethod
    def launch(
        cls, argv: Sequence[str], log_path: Path, env: dict[str, str] | None = None
    ) -> ServerProcess:
        log = log_path.open("wb")
        process = subprocess.Popen(
            list(argv),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env if env is not None else os.environ.copy(),
        )
        return cls(process, log_path, log)

    def wait_for_line(
        self, pattern: str, timeout_s: float = SERVER_START_TIMEOUT_S
    ) -> re.Match[str]:
        """The first match of `pattern` in the server's output, waiting until it appears."""
        regex = re.compile(pattern)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            match = regex.search(self.log_path.read_text(errors="replace"))
            if match is not None:
                return match
            if self.process.poll() is not None:
                raise BenchError(
                    f"server exited with status {self.process.returncode} before it was ready; "
                    f"see {self.log_path}: {self.tail()}"
                )
            time.sleep(0.05)
        raise BenchError(
            f"server printed no {pattern!r} within {timeout_s:.0f} s; see {self.log_path}"
        )

    def tail(self, max_chars: int = 400) -> str:
        text = self.log_path.read_text(errors="replace").strip()
        return text[-max_chars:]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        self._log.close()

    @property
    def pid(self) -> int:
        """The server's pid (under `ip netns exec` the same process: it execs)."""
        return self.process.pid
