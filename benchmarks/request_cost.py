"""One client's GETs against each system in turn: where a request's time goes.

    python benchmarks/request_cost.py [--size 64KiB] [--seconds 5] [--rounds 2]
        [--systems kvshare-tcp,kvshare-tls-sealed,lmcache,tcp]

Starts each system as `kvshare bench` does (loopback, the bench's own peers and
clients), PUTs 8 values of `--size`, reads each once, then GETs them in turn, one at a
time, for `--seconds`, and reports per call: the server's user and system CPU
(/proc/<pid>/stat, all its threads; 10 ms clock ticks, so runs of seconds are
needed), the client's CPU (this process), and calls/s. Rounds alternate the systems,
so each sees the same machine.

With one client the server is the critical path: the user/system split says whether
a gap to a peer is the interpreter's per-request work (user) or the kernel's moving of
bytes (system). `perf record -g -p <server pid>` beside it says which (the pid is
printed). docs/benchmarks.md, "Reads at wire speed: what is left".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's code

from kvshare.bench.buffers import random_value
from kvshare.bench.config import parse_size
from kvshare.bench.peers.lmcache_peer import find_lmcache_python
from kvshare.bench.systems import build_system

KEYS = 8


def _ticks(pid: int) -> tuple[int, int]:
    """User and system clock ticks of process `pid` (all threads)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as stat:
        fields = stat.read().rpartition(")")[2].split()
    return int(fields[11]), int(fields[12])


def measure(name: str, size: int, seconds: float, lmcache_python: Path | None) -> dict[str, object]:
    system = build_system(name, lmcache_python)
    reason = system.unavailable_reason()
    if reason is not None:
        return {"system": name, "skipped": reason}
    workdir = Path(tempfile.mkdtemp(prefix="request-cost-"))
    try:
        client = system.start(workdir).connect()
        (pid,) = system.server_pids()[:1]
        client.prepare(size, 1)
        system.reserve(size, KEYS)
        keys = [os.urandom(32) for _ in range(KEYS)]
        value = memoryview(random_value(size, 1))[:size]
        for key in keys:
            client.put([key], [value])
        for key in keys:
            client.get([key])
        calls = 0
        tick_s = 1 / os.sysconf("SC_CLK_TCK")
        user0, sys0 = _ticks(pid)
        cpu0, start = time.process_time(), time.monotonic()
        while time.monotonic() - start < seconds:
            if len(client.get([keys[calls % KEYS]])) != 1:
                raise RuntimeError(f"{name}: a stored value was not found")
            calls += 1
        elapsed = time.monotonic() - start
        client_cpu = time.process_time() - cpu0
        user1, sys1 = _ticks(pid)
        client.close()
        return {
            "system": name,
            "server_pid": pid,
            "value_bytes": size,
            "calls_per_s": round(calls / elapsed, 1),
            "server_user_us_per_call": round((user1 - user0) * tick_s / calls * 1e6, 1),
            "server_sys_us_per_call": round((sys1 - sys0) * tick_s / calls * 1e6, 1),
            "client_cpu_us_per_call": round(client_cpu / calls * 1e6, 1),
        }
    finally:
        system.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", default="64KiB", help="value size, e.g. 64KiB or 2MiB")
    parser.add_argument("--seconds", type=float, default=5.0, help="GET loop per system")
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds")
    parser.add_argument("--systems", default="kvshare-tcp,kvshare-tls-sealed,lmcache,tcp")
    parser.add_argument("--lmcache-python", type=Path, default=None)
    parser.add_argument("--json", action="store_true", help="one JSON object on stdout")
    args = parser.parse_args()
    size = parse_size(args.size)
    lmcache_python = find_lmcache_python(args.lmcache_python and str(args.lmcache_python))
    rows = []
    for round_ in range(1, args.rounds + 1):
        for name in args.systems.split(","):
            row = measure(name, size, args.seconds, lmcache_python)
            row["round"] = round_
            rows.append(row)
            if not args.json:
                print(json.dumps(row), flush=True)
    if args.json:
        print(json.dumps({"results": rows}, indent=1))


if __name__ == "__main__":
    main()
