"""Fault scenarios of bulk workers (`[bulk] workers`,
cacheserver.transport.bulk.readworker): a worker killed mid-read (see
fault_scenarios.py for the common parts).

LMDB's reader table is read as LMDB prints it (`Environment.readers()`), from this
process: the server's own readers are in another process, so opening the environment
here is what any other reader does.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import lmdb

from benchmarks.reliability.fault_scenarios import MODEL, Env, MiB, Outcome, block
from benchmarks.reliability.harness import ServerProc, wait_until
from replica_agent.client import BlockClient

BLOCK = 64 << 10
GET_BLOCKS = 15  # one GET a worker answers (at most 1 MiB)
READERS = 4  # client threads, each on a bulk connection of its own
CATCH_TRIES = 2000  # times the worker is stopped to be caught mid-read
CHURN_ROUNDS = 6
CHURN_BLOCKS = 128  # per round: 8 MiB through a 4 MiB disk budget


def _children(pid: int) -> list[int]:
    found: list[int] = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        text = (task / "children").read_text()
        found += [int(child) for child in text.split()]
    return found


class _Lmdb:
    """The server's LMDB as another process sees it: its reader table and its size."""

    def __init__(self, path: Path) -> None:
        self._env = lmdb.open(str(path), readonly=True, lock=True, max_dbs=8, subdir=True)

    def snapshots(self) -> list[tuple[int, str]]:
        """(pid, snapshot) per slot in use; the snapshot is "-" for a slot kept idle."""
        rows = [line.split() for line in self._env.readers().splitlines()[1:]]
        return [(int(row[0]), row[2]) for row in rows if row and row[0].isdigit()]

    def used_bytes(self) -> int:
        return (int(self._env.info()["last_pgno"]) + 1) * int(self._env.stat()["psize"])

    def close(self) -> None:
        self._env.close()


def _drain(address: str, token: str) -> None:
    """Every journaled put into LMDB now: a delete waits for the server's writer."""
    with BlockClient(address, token, bulk=False) as root:
        root.delete("alpha", MODEL, [os.urandom(32)])


def worker_killed_mid_read(env: Env) -> Outcome:
    """A server with one bulk worker serves 4 readers of the same 15 blocks (1 MiB a
    GET, from LMDB); the worker is stopped until it is caught with a read transaction
    open, and killed there with -9. Passes when LMDB's reader table holds no slot of
    the dead worker within 5 s, a new worker serves, no read returned other bytes,
    and 6 rounds of churn (8 MiB put and evicted through a 4 MiB disk budget each) grow
    LMDB's pages by less than one round's worth over the last three: a snapshot left
    pinned by the dead worker would keep the pages freed after it from reuse (about
    4 MiB more each round, measured before the reader check)."""
    storage = {"memory_budget_bytes": 0, "disk_budget_bytes": 4 * MiB, "lmdb_map_bytes": 64 * MiB}
    tenancy = env.config(storage)
    server = ServerProc(
        tenancy.path, env.directory / "server.log", extra_args=["--bulk-workers", "2"]
    )
    env.servers.append(server)
    [worker] = _children(server.pid)
    digests = [os.urandom(32) for _ in range(GET_BLOCKS)]
    payloads = [block(d, BLOCK) for d in digests]
    with BlockClient(server.address, tenancy.tokens["a"], bulk=False) as writer:
        writer.put("alpha", MODEL, digests, payloads)
    _drain(server.address, tenancy.tokens["root"])
    table = _Lmdb(tenancy.data_dir / "lmdb")
    stop = threading.Event()
    wrong: list[int] = []
    failed: list[str] = []
    reads: list[int] = []

    def read() -> None:
        with BlockClient(server.address, tenancy.tokens["a"], same_host=False) as client:
            while not stop.is_set():
                try:
                    got = client.get("alpha", MODEL, digests)
                except Exception as error:  # a failed call is a failed scenario
                    failed.append(type(error).__name__)
                    continue
                reads.append(1)
                if got != payloads:
                    wrong.append(1)

    threads = [threading.Thread(target=read) for _ in range(READERS)]
    for thread in threads:
        thread.start()
    try:
        wait_until(lambda: len(reads) >= 50, 30)
        caught = ""
        for _ in range(CATCH_TRIES):
            os.kill(worker, signal.SIGSTOP)
            caught = next(
                (txn for pid, txn in table.snapshots() if pid == worker and txn != "-"), ""
            )
            if caught:
                break
            os.kill(worker, signal.SIGCONT)
            time.sleep(random.uniform(0.001, 0.01))  # it serves a while before the next try
        os.kill(worker, signal.SIGKILL)
        killed_at = time.monotonic()
        freed = wait_until(lambda: worker not in [pid for pid, _ in table.snapshots()], 5)
        freed_s = time.monotonic() - killed_at
        replaced = wait_until(lambda: bool(set(_children(server.pid)) - {worker}), 10)
        before = len(reads)
        served_on = wait_until(lambda: len(reads) >= before + 50, 30)
    finally:
        stop.set()
        for thread in threads:
            thread.join()
    sizes = []
    with BlockClient(server.address, tenancy.tokens["a"], bulk=False) as writer:
        for _ in range(CHURN_ROUNDS):
            for _ in range(CHURN_BLOCKS // 16):
                fresh = [os.urandom(32) for _ in range(16)]
                writer.put("alpha", MODEL, fresh, [block(d, BLOCK) for d in fresh])
            _drain(server.address, tenancy.tokens["root"])
            sizes.append(table.used_bytes())
    table.close()
    growth = sizes[-1] - sizes[2]
    passed = bool(caught) and freed and replaced and served_on and not wrong and not failed
    passed = passed and growth < CHURN_BLOCKS * BLOCK
    detail = (
        f"worker caught mid-read (snapshot {caught or 'never'}), killed; its reader slots "
        f"{'freed' if freed else 'NOT freed'} after {freed_s:.1f} s; "
        f"{'replaced' if replaced else 'NOT replaced'}; {len(reads)} reads of "
        f"{GET_BLOCKS} blocks, {len(wrong)} with other bytes, {len(failed)} failed; "
        f"LMDB's pages after each "
        f"churn round: {', '.join(f'{s / MiB:.1f}' for s in sizes)} MiB "
        f"(growth after the third {growth / MiB:.1f} MiB)"
    )
    return Outcome(passed, detail)
