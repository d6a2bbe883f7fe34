"""The server's bulk read workers' processes: `[bulk] workers = N` puts N processes to
work on requests.

One Python process serves with one GIL, whatever the host's cores. With N > 1 the
server starts N - 1 read worker processes (cacheserver.transport.bulk.readworker) and,
after each plain-TCP bulk connection's hello, keeps it or hands it to a worker in turn
(N connections: one each). A worker serves the reads it can answer from LMDB; everything else comes
back whole to the server over the connection's hand-back pair, and the server serves
it on its own descriptor of the same connection (cacheserver.transport.bulk.listener).

What is shared, and how (docs/architecture.md, "Bulk workers"):
- LMDB: one environment, opened read-only by each worker; every read transaction is a
  consistent snapshot of committed blocks, never held while a peer is waited on.
  Puts, deletes and evictions are the server's: a block leaves LMDB synchronously on
  Delete, so no worker serves it after; one a journaled put evicted stays in LMDB
  until that put is drained, and is marked meanwhile (cacheserver.tiers.retiring), so
  a worker hands its reads back and the server's index answers them.
- The memory tier, the put journal, the index, quotas and eviction stay in the
  server. A block still only in the journal is a worker's miss: handed back.
- Rate limits: one bucket per principal in shared memory (SharedBuckets).
- Recency and figures: each worker's report (delegation.Report) touches the keys it
  served in the index and adds its counts to the server's metrics and Stats.

Never delegated: TLS connections, the sealed channel, same-host arenas (their state
is the server's), and the public scope (its readers' recency and figures stay where
C70 audits them). A worker that dies is started again a second later; its
connections close, and their clients reconnect. LMDB's reader slots that it held (a
worker killed mid-read) are freed by the reader check of the worker started in its
place (as it opens LMDB, once the dead one has been reaped) and by the server's own,
every second (cacheserver.tiers.lmdb).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cacheserver.core.served import TenantReport
from cacheserver.transport.bulk import delegation as d
from policy.ratelimit import SharedBuckets
from policy.types import TenantId

log = logging.getLogger(__name__)
RESTART_DELAY_S = 1.0
REAP_TIMEOUT_S = 5.0
REPO_ROOT = Path(__file__).resolve().parents[3]  # where `cacheserver` is imported from

# Applies one tenant's report in the server (index recency, metrics, Stats).
OnReport = Callable[[TenantId, TenantReport], None]


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker is started with."""

    lmdb_path: Path
    map_bytes: int
    buckets: SharedBuckets
    log_format: str = "text"


class _Process:
    """One worker process and the server's end of its control socket."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.control, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.lock = threading.Lock()  # delegations are whole datagrams, one at a time
        args = [
            sys.executable, "-m", "cacheserver.transport.bulk.readworker",
            "--control-fd", str(child.fileno()),
            "--buckets-fd", str(spec.buckets.fd),
            "--slots", json.dumps(spec.buckets.slots),
            "--lmdb", str(spec.lmdb_path),
            "--map-bytes", str(spec.map_bytes),
            "--log-format", spec.log_format,
        ]  # fmt: skip
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        try:
            self.proc = subprocess.Popen(
                args,
                pass_fds=(child.fileno(), spec.buckets.fd),
                stdin=subprocess.DEVNULL,
                env={**os.environ, "PYTHONPATH": path},
            )
        finally:
            child.close()

    def reap(self) -> int:
        """Its exit status, once it has ended (its control socket closed, the process is
        exiting): waited for, so that the worker started in its place runs LMDB's reader
        check after the dead one has let go of its locks (cacheserver.tiers.lmdb)."""
        try:
            return self.proc.wait(REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # it closed its control socket yet lives on
            self.proc.kill()
            return self.proc.wait()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.control.shutdown(socket.SHUT_RDWR)
        self.control.close()
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class WorkerProcesses:
    """N - 1 worker processes, and the turn that decides who serves a connection."""

    def __init__(self, count: int, spec: WorkerSpec, on_report: OnReport) -> None:
        self.count = count
        self._spec = spec
        self._on_report = on_report
        self._lock = threading.Lock()
        self._procs: list[_Process | None] = [None] * (count - 1)
        self._turn = itertools.count()
        self._stopping = False
        self.reports = 0  # report datagrams applied (tests wait on it)

    def start(self) -> None:
        for slot in range(len(self._procs)):
            self._launch(slot)

    def _launch(self, slot: int) -> None:
        with self._lock:
            if self._stopping:
                return
            proc = self._procs[slot] = _Process(self._spec)
        threading.Thread(
            target=self._listen, args=(slot, proc), name="kvshare-worker-reports", daemon=True
        ).start()

    def _listen(self, slot: int, proc: _Process) -> None:
        """The worker's reports, until its control socket closes; then, unless the
        server is stopping, a new worker in its slot."""
        try:
            while datagram := proc.control.recv(d.MAX_REPORT_BYTES + 1024):
                try:
                    tenant, report = d.decode_report(datagram)
                except (ValueError, UnicodeDecodeError):
                    log.error("a malformed report from bulk worker %d; ignored", slot)
                    continue
                self._on_report(tenant, report)
                self.reports += 1
        except OSError:
            pass
        with self._lock:
            if self._stopping or self._procs[slot] is not proc:
                return
            self._procs[slot] = None
        code = proc.reap()
        log.error("bulk worker %d ended (exit status %s); starting another", slot, code)
        with contextlib.suppress(OSError):
            proc.control.close()
        threading.Timer(RESTART_DELAY_S, self._launch, args=(slot,)).start()

    def delegate(
        self, conn: socket.socket, delegation: d.Delegation, to_a_worker: bool = False
    ) -> socket.socket | None:
        """Hand `conn` to the next worker in turn (`to_a_worker`: never the server's own
        turn): the server's end of its hand-back pair, or None when the turn is the
        server's (or that worker is down)."""
        if to_a_worker:
            turn = 1 + next(self._turn) % len(self._procs)
        else:
            turn = next(self._turn) % self.count
        if turn == 0:
            return None
        proc = self._procs[turn - 1]
        if proc is None:
            return None
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with proc.lock:
                socket.send_fds(
                    proc.control, [delegation.encode()], [conn.fileno(), theirs.fileno()]
                )
        except OSError:
            ours.close()
            return None
        finally:
            theirs.close()
        return ours

    def update(self, update: d.Update) -> int:
        """Send `update` (a live reload's) to every live worker; how many took it. A
        worker started later gets the rate slots as they are then (`--slots`) and the
        defaults with its first delegation."""
        raw = update.encode()
        with self._lock:
            procs = [p for p in self._procs if p is not None]
        sent = 0
        for proc in procs:
            try:
                with proc.lock:
                    proc.control.sendall(raw)
                sent += 1
            except OSError as error:  # it is ending (the one in its place starts new)
                log.error("bulk worker not updated after a reload: %s", error)
        return sent

    def pids(self) -> list[int]:
        """The live workers' process ids, in slot order (for operators and tests)."""
        with self._lock:
            return [p.proc.pid for p in self._procs if p is not None]

    def stop(self) -> None:
        with self._lock:
            self._stopping = True
            procs = [p for p in self._procs if p is not None]
            self._procs = [None] * len(self._procs)
        for proc in procs:
            proc.stop()
