"""Bulk workers and LMDB's reader table (docs/reliability.md, "A bulk worker killed
mid-read"): a reader that stops reading holds no read transaction on a worker, a
worker killed mid-read leaves no reader slot behind, a full table fails a read as
UNAVAILABLE, and a block the index evicted is never served by a worker.

LMDB's reader table is read as LMDB prints it (`Environment.readers()`), from a
separate process: opening the environment twice in the server's own process would
drop its locks. Some tests shrink the table (the real size is shown safe by
arithmetic in tests/unit/cacheserver/tiers/lmdb/test_lmdb_readers.py) so that a few
dozen connections would fill it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import pytest

import cacheserver.tiers.lmdb.environment
from cacheserver.config import BulkConfig, StorageConfig
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import Unavailable
from tests.support.bulk import open_bulk
from tests.support.bulk_workers import assembly, pair, served_by_workers, wait_in_lmdb
from tests.support.servers import Running

MODEL = "workers/model"
KiB, MiB = 1 << 10, 1 << 20
BLOCK = 64 * KiB
# One GET a worker answers (at most readworker.MAX_GET_BYTES); a stalled
# reader asks for it STALLED_GETS times at once, more than a receive buffer of a few
# KiB and the socket's send buffer (a few MiB on loopback) take before it reads.
GET_BLOCKS = 15
STALLED_GETS = 6
SMALL_TABLE = 8  # reader slots, where a test fills the table
CHURN_BLOCKS = 128  # a round of churn: 8 MiB through a 4 MiB disk budget

_INSPECT = """
import json, sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=8, subdir=True)
rows = [line.split() for line in env.readers().splitlines()[1:] if line.strip()]
info = {"readers": [[int(row[0]), row[2]] for row in rows if row[0].isdigit()],
        "used_bytes": (env.info()["last_pgno"] + 1) * env.stat()["psize"]}
print(json.dumps(info))
"""
# Fills every free slot of the table and holds them until its stdin closes.
_HOLD = """
import sys, lmdb
env = lmdb.open(sys.argv[1], readonly=True, lock=True, max_dbs=8, subdir=True)
held = []
try:
    while True:
        held.append(env.begin())
except lmdb.ReadersFullError:
    pass
print(len(held), flush=True)
sys.stdin.read()
"""


def lmdb_dir(running: Running) -> Path:
    return running.data_dir / "lmdb"


def inspect(running: Running) -> dict[str, object]:
    """LMDB's reader table (pid, snapshot: "-" for a slot kept without one) and how far
    into the data file its pages reach, as another process sees them."""
    out = subprocess.run(
        [sys.executable, "-c", _INSPECT, str(lmdb_dir(running))],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout
    info: dict[str, object] = json.loads(out)
    return info


def readers(running: Running) -> list[tuple[int, str]]:
    rows = inspect(running)["readers"]
    assert isinstance(rows, list)
    return [(int(pid), str(txnid)) for pid, txnid in rows]


def used_bytes(running: Running) -> int:
    value = inspect(running)["used_bytes"]
    assert isinstance(value, int)
    return value


def small_reader_table(monkeypatch: pytest.MonkeyPatch) -> None:
    """Servers started from now on open LMDB with SMALL_TABLE reader slots."""
    monkeypatch.setattr(cacheserver.tiers.lmdb.environment, "MAX_READERS", SMALL_TABLE)


def stalled_get(running: Running, digests: list[bytes]) -> socket.socket:
    """A bulk connection of `a` that asks for `digests` STALLED_GETS times and reads
    nothing of the replies (a receive buffer of a few KiB: the sends soon wait)."""
    response = open_bulk(running, "a", "alpha")
    host, _, port = response.address.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * KiB)
    sock.settimeout(60)
    sock.connect((host, int(port)))
    sock.sendall(w.HELLO.pack(w.MAGIC, response.ticket))
    assert bulkio.recv_bytes(sock, 1)[0] == w.OK
    model = MODEL.encode()
    request = w.REQUEST.pack(w.OP_GET, len(model), len(digests)) + model + b"".join(digests)
    sock.sendall(request * STALLED_GETS)
    return sock


def read_reply(sock: socket.socket, count: int) -> list[bytes]:
    assert bulkio.recv_bytes(sock, 1)[0] == w.OK
    blocks = []
    for _ in range(count):
        (size,) = w.SIZE.unpack(bulkio.recv_bytes(sock, w.SIZE.size))
        blocks.append(bytes(bulkio.recv_bytes(sock, size)))
    assert bytes(bulkio.recv_bytes(sock, len(w.END))) == w.END
    return blocks


def put_blocks(
    running: Running, tenant: str, count: int, size: int = BLOCK
) -> tuple[list[bytes], list[bytes]]:
    digests = [os.urandom(32) for _ in range(count)]
    payloads = [os.urandom(size) for _ in digests]
    who = "a" if tenant == "alpha" else "b"
    with running.client(who, bulk=False) as client:
        for start in range(0, count, 16):
            end = start + 16
            stored = client.put(tenant, MODEL, digests[start:end], payloads[start:end])
            assert stored == [True] * len(stored)
    return digests, payloads


def drain(running: Running) -> None:
    """Move every journaled put into LMDB now: a delete waits for the writer."""
    with running.client("root", bulk=False) as root:
        root.delete("alpha", MODEL, [os.urandom(32)])


def workers_server(
    start_server: Callable[..., Running], storage: StorageConfig | None = None
) -> Running:
    """Two processes; replies that may take long (1 KiB/s): a stalled reader is not cut
    off while the test runs; no memory tier, so reads come from LMDB."""
    return start_server(
        bulk=BulkConfig(workers=2, min_transfer_bytes_per_s=KiB),
        storage=dataclasses.replace(storage or StorageConfig(), memory_budget_bytes=0),
    )


@pytest.mark.slow
def test_readers_stalled_on_a_worker_leave_other_tenants_reads_alone(
    start_server: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    small_reader_table(monkeypatch)
    running = workers_server(start_server)
    alpha, alpha_payloads = put_blocks(running, "alpha", GET_BLOCKS)
    beta, beta_payloads = put_blocks(running, "beta", 40, 16 * KiB)
    wait_in_lmdb(running)
    before = assembly(running).processes.reports
    stalled_count = 3 * SMALL_TABLE  # every other connection is the worker's
    with ExitStack() as stack:
        stalled = [stack.enter_context(stalled_get(running, alpha)) for _ in range(stalled_count)]
        time.sleep(0.5)  # every request has reached its process and its send waits
        # Another tenant's reads from LMDB (gRPC, no memory tier) all succeed.
        with running.client("b", bulk=False) as b:
            for digest, payload in zip(beta, beta_payloads, strict=True):
                assert b.get("beta", MODEL, [digest]) == [payload]
        # Stalled replies hold no snapshot: fewer open than the worker's stalled ones.
        snapshots = [txnid for _, txnid in readers(running) if txnid != "-"]
        assert len(snapshots) < SMALL_TABLE // 2, snapshots
        # Positive control: the stalled replies are whole once read, and the worker
        # served its share of them.
        for sock in stalled:
            for _ in range(STALLED_GETS):
                assert read_reply(sock, GET_BLOCKS) == alpha_payloads
    assert served_by_workers(running, before)


@pytest.mark.slow
def test_a_full_reader_table_fails_a_read_as_unavailable(
    start_server: Callable[..., Running], monkeypatch: pytest.MonkeyPatch
) -> None:
    small_reader_table(monkeypatch)
    running = workers_server(start_server)
    digests, payloads = put_blocks(running, "alpha", 2)
    wait_in_lmdb(running)
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLD, str(lmdb_dir(running))],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None
        assert int(holder.stdout.readline()) > 0  # every free slot is held now
        with running.client("a", bulk=False) as a, pytest.raises(Unavailable, match="slots"):
            a.get("alpha", MODEL, digests[:1])
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(30)
    with running.client("a", bulk=False) as a:  # control: the same read, slots free
        assert a.get("alpha", MODEL, digests) == payloads


@pytest.mark.slow
def test_a_worker_killed_mid_read_leaves_no_reader_slot_and_lmdb_stops_growing(
    start_server: Callable[..., Running],
) -> None:
    storage = StorageConfig(disk_budget_bytes=4 * MiB, lmdb_map_bytes=64 * MiB)
    running = workers_server(start_server, storage)
    workers = assembly(running).processes
    [old] = workers.pids()
    digests, payloads = put_blocks(running, "alpha", GET_BLOCKS)
    wait_in_lmdb(running)
    stop, going = threading.Event(), threading.Event()

    def read_on_the_worker() -> None:
        # Opened on this thread: a client's connection is its thread's, and the second
        # of a pair is the worker's.
        main, worker = pair(running, "a")
        with main, worker, contextlib.suppress(Exception):  # the worker dies under it
            while not stop.is_set():
                assert worker.get("alpha", MODEL, digests) == payloads
                going.set()

    reading = threading.Thread(target=read_on_the_worker)
    reading.start()
    try:
        assert going.wait(30)
        # Stopped while it reads: caught with a snapshot open (its pid in the table with
        # a transaction id), and killed there.
        for _ in range(200):
            os.kill(old, signal.SIGSTOP)
            if (old, "-") != (held := snapshot_of(running, old)):
                break
            os.kill(old, signal.SIGCONT)
        assert held[1].isdigit(), "the worker was never caught mid-read"
        os.kill(old, signal.SIGKILL)
    finally:
        stop.set()
        reading.join()
    deadline = time.monotonic() + 20
    while old in [pid for pid, _ in readers(running)] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert old not in [pid for pid, _ in readers(running)], readers(running)
    # Churn: blocks put and evicted, 8 MiB a round through a 4 MiB budget. With the dead
    # worker's snapshot pinned, the pages freed after it could not be reused: LMDB grew
    # about 4 MiB a round (13 over the last three), against at most one round's worth.
    sizes = []
    for _ in range(6):
        put_blocks(running, "alpha", CHURN_BLOCKS)
        drain(running)
        sizes.append(used_bytes(running))
    assert sizes[5] - sizes[2] < CHURN_BLOCKS * BLOCK, sizes


def snapshot_of(running: Running, pid: int) -> tuple[int, str]:
    """(pid, the snapshot its first slot holds: "-" when none)."""
    for row in readers(running):
        if row[0] == pid and row[1] != "-":
            return row
    return (pid, "-")


def test_a_block_the_index_evicted_is_not_served_by_a_worker(
    start_server: Callable[..., Running],
) -> None:
    # Journaled puts wait a minute for a pause before they reach LMDB (unless a delete
    # needs them there): the evicting put stays undrained while the test reads.
    running = start_server(
        bulk=BulkConfig(workers=2),
        storage=StorageConfig(memory_budget_bytes=0, drain_idle_ms=60_000),
        quotas={"alpha": 4 * BLOCK},
    )
    old, old_payloads = put_blocks(running, "alpha", 4)
    drain(running)
    main, worker = pair(running, "a")
    with main, worker:
        before = assembly(running).processes.reports
        assert worker.get("alpha", MODEL, old) == old_payloads  # control: the worker's
        assert served_by_workers(running, before)
        new, new_payloads = put_blocks(running, "alpha", 4)  # evicts `old` (the quota)
        assert running.store.undrained_blocks == 4  # its delete from LMDB is still to come
        with running.client("a", bulk=False) as server_only:
            assert server_only.lookup("alpha", MODEL, old[:1]) == 0
        for _ in range(3):
            assert worker.lookup("alpha", MODEL, old[:1]) == 0
            assert worker.get("alpha", MODEL, old[:1]) == []
            assert worker.get("alpha", MODEL, new) == new_payloads  # handed back: journal
        # Once the evicting puts are in LMDB the worker serves again (the marks went).
        drain(running)
        time.sleep(0.5)  # any report of the reads above has arrived
        before = assembly(running).processes.reports
        assert worker.get("alpha", MODEL, new) == new_payloads
        assert served_by_workers(running, before)
