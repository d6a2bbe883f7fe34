"""Two hosts on one machine (kvshare.bench.netns): `kvshare serve` inside the server's
namespace (`RemoteServer`) and replica runs inside another (`run_in`)."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from kvshare.bench.netns import Host
from tests.support.repo import REPO
from tests.support.scrape import Samples, parse

SERVING_RE = re.compile(r"serving on (\S+)")


BULK_RE = re.compile(r"kvshare bulk on (\S+) \(announced: (\S+)\)")


METRICS_RE = re.compile(r"metrics on (\S+)")


CLIENT_TIMEOUT_S = 240.0


class RemoteServer:
    """`kvshare serve` inside the server's namespace; stderr goes to a file."""

    def __init__(self, host: Host, log_dir: Path, *args: str) -> None:
        self.host = host
        self.args = args
        self._log_dir = log_dir
        self.starts = 0
        self.start()

    def start(self) -> None:
        self.starts += 1
        self.log_path = self._log_dir / f"server-{self.starts}.log"
        with self.log_path.open("w") as log:
            self.proc = subprocess.Popen(
                self.host.command([sys.executable, "-m", "kvshare.cli", "serve", *self.args]),
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                cwd=REPO,
            )
        self.lines: list[str] = []
        self.address = self.bulk_bound = self.bulk_announced = self.metrics = ""
        self._read_startup()

    def _read_startup(self, timeout_s: float = 60) -> None:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"server exited: {self.log_path.read_text()[-2000:]}")
            self.lines.append(line)
            if match := METRICS_RE.search(line):
                self.metrics = match.group(1)
            if match := SERVING_RE.search(line):
                self.address = match.group(1)
            if match := BULK_RE.search(line):
                self.bulk_bound, self.bulk_announced = match.group(1), match.group(2)
                return
        raise RuntimeError("server did not print its bulk line in time")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill9()

    def scrape(self) -> Samples:
        """The server's metrics, fetched from inside its namespace."""
        report = run_in(self.host, "scrape", {"metrics": self.metrics})
        return parse(report["text"])


def replica_command(host: Host, mode: str, args: dict[str, Any]) -> list[str]:
    payload = json.dumps({**args, "namespace": host.namespace})
    return host.command([sys.executable, "-m", "tests.twohost.replica", mode, payload])


def run_in(host: Host, mode: str, args: dict[str, Any]) -> dict[str, Any]:
    """One `tests.twohost.replica` run inside `host`; its JSON report."""
    result = subprocess.run(
        replica_command(host, mode, args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    report: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return report


def namespaces() -> set[str]:
    """The names of the machine's network namespaces (`ip netns list`)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return {line.split()[0] for line in listing.stdout.splitlines() if line.strip()}
