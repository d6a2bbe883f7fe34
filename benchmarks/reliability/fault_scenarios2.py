"""Fault scenarios, continued: corrupted files, dead and stalled agents, a paused server,
clock jumps (see fault_scenarios.py for the common parts)."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from benchmarks.reliability.fault_scenarios import (
    MODEL,
    Env,
    MiB,
    Outcome,
    block,
    check_blocks,
    put_one,
    status_of,
)
from benchmarks.reliability.harness import REPO
from replica_agent.client import BlockClient


def _flip_near(path: Path, needle: bytes, offset: int) -> bool:
    """Flip one bit `offset` bytes after the first `needle` in `path` (sparse-aware)."""
    with open(path, "r+b") as f:
        fd, end, position = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while position < end:
            try:
                start = os.lseek(fd, position, os.SEEK_DATA)
            except OSError:
                return False
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            where = os.pread(fd, stop - start, start).find(needle)
            if where >= 0:
                at = start + where + offset
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
                return True
            position = stop
    return False


def _integrity_failures(address: str, token: str) -> int:
    with BlockClient(address, token) as client:
        return int(client.stats().integrity_failures)


def corrupt_files(env: Env) -> Outcome:
    """Bytes flipped while the server is stopped: in blocks inside data.mdb (after a
    clean stop) and in records of the journal ring (after kill -9 with nothing drained).
    The server starts; a corrupt block is never served (a miss), and each one is
    counted (Stats.integrity_failures); every other block is served exactly."""
    size = 64 << 10
    tenancy = env.config({"journal_bytes": 16 * MiB, "drain_idle_ms": 600_000})
    server = env.start(tenancy)
    disk = [os.urandom(32) for _ in range(8)]
    journaled = [os.urandom(32) for _ in range(8)]
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        client.put("alpha", MODEL, disk, [block(d, size) for d in disk])
    server.terminate()  # drains: these 8 are in LMDB
    server = env.start(tenancy)
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        client.put("alpha", MODEL, journaled, [block(d, size) for d in journaled])
    server.kill9()  # these 8 are only in the journal
    flipped = [
        d
        for d in disk[:3]
        if _flip_near(env.directory / "data" / "lmdb" / "data.mdb", block(d, size)[:64], 1000)
    ]
    rings = list(env.journal_dir.glob("*.journal"))
    flipped_j = [
        d for d in journaled[:3] if rings and _flip_near(rings[0], block(d, size)[:64], 1000)
    ]
    server = env.start(tenancy)
    torn = missing_good = 0
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        for digest in disk + journaled:
            got = client.get("alpha", MODEL, [digest])
            if got and got[0] != block(digest, size):
                torn += 1
            if not got and digest not in flipped + flipped_j:
                missing_good += 1
    counted = _integrity_failures(server.address, tenancy.tokens["root"])
    server.terminate()
    expected = len(flipped) + len(flipped_j)
    passed = torn == 0 and missing_good == 0 and counted == expected and expected == 6
    return Outcome(
        passed,
        f"flipped {len(flipped)} blocks in data.mdb and {len(flipped_j)} journal records: "
        f"{torn} served with wrong bytes, {missing_good} intact blocks missing, "
        f"{counted} counted as integrity failures (expected {expected})",
        acknowledged_lost=missing_good,
        torn_served=torn,
    )


AGENT = textwrap.dedent(
    """
    import os, signal, socket, sys, time
    sys.path.insert(0, {repo!r})
    import grpc
    from kvcommon import bulkwire as w
    from kvcommon.v1 import kvshare_pb2 as pb, kvshare_pb2_grpc as pb_grpc
    address, token, mode = sys.argv[1:4]
    stub = pb_grpc.BlockStoreStub(grpc.insecure_channel(address))
    opened = stub.OpenBulk(pb.OpenBulkRequest(tenant="alpha"),
                           metadata=(("authorization", "Bearer " + token),))
    host, _, port = opened.address.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(w.HELLO.pack(w.MAGIC, opened.ticket))
    assert sock.recv(1) == bytes([w.OK])
    model = {model!r}.encode()
    if mode == "put":  # declare an 8 MiB block, send half of it, die
        sock.sendall(w.REQUEST.pack(w.OP_PUT, len(model), 1) + model + bytes(32)
                     + w.SIZE.pack(8 << 20) + bytes(4 << 20))
        print("sent", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    digests = bytes.fromhex(sys.argv[4])
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.sendall(w.REQUEST.pack(w.OP_GET, len(model), len(digests) // 32) + model + digests)
    print("sent", flush=True)
    time.sleep(600)  # never reads the reply
    """
)


def _agent(address: str, token: str, mode: str, digests: bytes = b"") -> subprocess.Popen[str]:
    code = AGENT.format(repo=str(REPO), model=MODEL)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, address, token, mode, digests.hex()],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    proc.stdout.readline()  # "sent"
    return proc


def agents(env: Env) -> Outcome:
    """An agent killed in the middle of a bulk PUT, and one that stops reading in the
    middle of a bulk GET of 8 MiB: the half-sent block is never served, and meanwhile
    another tenant's 40 puts of 1 MiB and its gets go on, each within 5 s."""
    tenancy = env.config({"journal_bytes": 16 * MiB})
    server = env.start(tenancy)
    big = [os.urandom(32) for _ in range(8)]
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        client.put("alpha", MODEL, big, [block(d, MiB) for d in big])
    killed = _agent(server.address, tenancy.tokens["a"], "put")
    killed.wait(30)
    stalled = _agent(server.address, tenancy.tokens["a"], "get", b"".join(big))
    slowest, failures = 0.0, []
    with BlockClient(server.address, tenancy.tokens["b"]) as other:
        for _ in range(40):
            digest = os.urandom(32)
            started = time.monotonic()
            code, message = status_of(functools.partial(put_one, other, "beta", digest, MiB))
            if code == "OK" and other.get("beta", MODEL, [digest]) != [block(digest, MiB)]:
                code = "WRONG_BYTES"
            slowest = max(slowest, time.monotonic() - started)
            if code != "OK":
                failures.append(f"{code} {message[:80]}")
    stalled.kill()
    stalled.wait(30)
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        half_served = client.lookup("alpha", MODEL, [bytes(32)])
        missing, wrong = check_blocks(client, "alpha", big, MiB)
    alive = server.alive()
    server.terminate()
    passed = not failures and slowest < 5 and half_served == 0 and alive and not (missing + wrong)
    return Outcome(
        passed,
        f"half-sent PUT served: {bool(half_served)}; another tenant during a stalled GET: "
        f"{40 - len(failures)}/40 puts ok, slowest {slowest:.1f} s"
        + (f", first failure {failures[0]!r}" if failures else ""),
        acknowledged_lost=missing,
        torn_served=wrong,
    )


def server_paused(env: Env) -> Outcome:
    """SIGSTOP the server under a replica agent: each match/load returns a miss within
    its timeout, the breaker opens (then calls skip the store at once), and after
    SIGCONT the agent hits again without a restart."""
    import torch

    from replica_agent.agent import ReplicaAgent
    from replica_agent.breaker import CircuitBreaker
    from replica_agent.spec import ModelSpec

    tenancy = env.config({"journal_bytes": 16 * MiB})
    server = env.start(tenancy)
    spec = ModelSpec("faults/tiny", "r1", 2, 2, 8, "float32", block_tokens=4)
    breaker = CircuitBreaker(failure_threshold=2, cooldown_s=1.0)
    agent = ReplicaAgent.connect(
        server.address, tenancy.tokens["a"], spec, timeout_s=0.5, breaker=breaker
    )
    tokens = list(range(32))
    digests = agent.digests(tokens)
    agent.save("alpha", digests, [torch.randn(spec.block_shape) for _ in digests])
    agent.flush()
    before = agent.match("alpha", digests).blocks
    server.signal(signal.SIGSTOP)
    slowest, hits_paused = 0.0, 0
    for _ in range(10):
        started = time.monotonic()
        match = agent.match("alpha", digests)
        hits_paused += len(agent.load(match))
        slowest = max(slowest, time.monotonic() - started)
    opened = breaker.times_opened
    skipped = agent.stats.skipped_breaker_open
    server.signal(signal.SIGCONT)
    recovered_after = None
    started = time.monotonic()
    while time.monotonic() - started < 15:
        if agent.match("alpha", digests).blocks == len(digests):
            recovered_after = time.monotonic() - started
            break
        time.sleep(0.2)
    agent.close()
    server.terminate()
    passed = (
        before == len(digests)
        and hits_paused == 0
        and slowest < 2.0
        and opened >= 1
        and skipped > 0
        and recovered_after is not None
    )
    return Outcome(
        passed,
        f"{before}/{len(digests)} blocks hit before; paused: slowest call {slowest:.2f} s, "
        f"{hits_paused} hits, breaker opened {opened}x, {skipped} calls skipped; "
        f"hits again {recovered_after and round(recovered_after, 1)} s after SIGCONT",
    )


FAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")


def clock_jumps(env: Env) -> Outcome:
    """The server's wall clock (CLOCK_REALTIME, through libfaketime) jumps a day back
    and a day forward while it serves: puts, gets, bulk connections (fresh tickets)
    and the health probe go on; the code's deadlines use the monotonic clock."""
    if not FAKETIME.exists():
        return Outcome(None, "needs libfaketime (apt-get install libfaketime)")
    stamp = env.directory / "faketime"
    stamp.write_text("+0\n")
    tenancy = env.config({"journal_bytes": 16 * MiB})
    fake = {
        "LD_PRELOAD": str(FAKETIME),
        "FAKETIME_TIMESTAMP_FILE": str(stamp),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }
    server = env.start(tenancy, env=fake)
    failures = []
    acked: list[bytes] = []
    for offset in ("+0", "-1d", "+1d", "+0"):
        stamp.write_text(offset + "\n")
        time.sleep(1.2)  # a health probe or two at the new time
        for bulk in (True, False):
            with BlockClient(server.address, tenancy.tokens["a"], bulk=bulk) as client:
                digests = [os.urandom(32) for _ in range(4)]
                payloads = [block(d, 4096) for d in digests]
                code, message = status_of(
                    functools.partial(client.put, "alpha", MODEL, digests, payloads)
                )
                if code != "OK":
                    failures.append(f"{offset} put {code} {message[:60]}")
                    continue
                acked += digests
                missing, wrong = check_blocks(client, "alpha", acked, 4096)
                if missing or wrong:
                    failures.append(f"{offset}: {missing} missing, {wrong} wrong")
    alive = server.alive()
    serving = _health(server.address)
    server.terminate()
    return Outcome(
        not failures and alive and serving,
        f"wall clock +0, -1 day, +1 day, +0: {len(acked)} blocks put and read back over "
        f"bulk and gRPC; health SERVING {serving}" + (f"; failures {failures}" if failures else ""),
    )


def _health(address: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(), timeout=5
        )
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)
