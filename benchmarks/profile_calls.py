"""Where a small call's time goes: server CPU per call, and a py-spy profile of it.

    python benchmarks/profile_calls.py --op lookup|get|put --clients 1,4 [--seconds 6]
        [--before DIR] [--rounds 3] [--workers 1,2] [--metrics] [--py-spy OUT_PREFIX] [--json]

Starts `kvshare serve` (dev mode, a temp data dir) from this checkout, and with
`--before DIR` also from another checkout (a `git worktree` of an older commit), in
alternating rounds so both see the same machine; warms each server up, then runs N
client processes (each running that checkout's client) that repeat one call for
`--seconds`: `lookup` (64 present digests: the call vLLM's scheduler makes per
request), `get` (one 64 KiB block) or `put` (one new 64 KiB block), on the client's
default transports across TCP (the bulk channel; no same-host arena). It reports
calls/s, the calls' p50 and p99 as the clients timed them, and the server's CPU time
per call (/proc/<pid>/stat: user and system time of
the whole process and of its bulk workers, in clock ticks of 10 ms, so runs of a few
seconds are needed). `--workers 1,2` measures each count of bulk-serving processes
(`kvshare serve --bulk-workers N`) in turn. `--metrics` serves with the Prometheus
endpoint on, as `kvshare bench` and a monitored deployment do (off, the meters are
the API's no-ops).
`--py-spy PREFIX` records each measured run with `py-spy record --threads`
(PREFIX-<tree>-<op>-<clients>.txt, collapsed stacks; `py-spy` from PyPI must be on
PATH or in this venv).

Ad-hoc measurement for profiling; `kvshare bench` is the side-by-side benchmark with
the peers (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvshare.simulate.timing import percentile

REPO = Path(__file__).resolve().parent.parent
MODEL = "profile/model"
BLOCK = 64 << 10
LOOKUP_DIGESTS = 64


def client_loop(
    address: str, token: str, op: str, seconds: float, block: int = BLOCK
) -> tuple[int, float, list[float]]:
    """One client's calls in `seconds`, the CPU seconds its loop took and each call's
    seconds (run in a process of its own: `--client`)."""
    from replica_agent.client import BlockClient

    with BlockClient(address, token, same_host=False) as client:
        digests = [os.urandom(32) for _ in range(LOOKUP_DIGESTS)]
        payload = os.urandom(block)
        client.put("dev", MODEL, digests, [payload] * len(digests))
        calls, end, took = 0, time.monotonic() + seconds, []
        cpu_start = time.process_time()
        while time.monotonic() < end:
            digest = os.urandom(32) if op == "put" else b""  # drawn before the clock starts
            started = time.perf_counter()
            if op == "lookup":
                client.lookup("dev", MODEL, digests)
            elif op == "get":
                client.get("dev", MODEL, digests[calls % len(digests) :][:1])
            else:
                client.put("dev", MODEL, [digest], [payload])
            took.append(time.perf_counter() - started)
            calls += 1
        cpu = time.process_time() - cpu_start
        if client.transport_stats.bulk_fallbacks:
            raise SystemExit("a call fell back to gRPC: the measurement is not of the bulk path")
        return calls, cpu, took


def drive(
    tree: Path, address: str, token: str, op: str, clients: int, seconds: float, block: int
) -> tuple[int, float, list[float]]:
    """Calls made by `clients` processes in `seconds`, each running `tree`'s client, the
    CPU seconds the clients' loops took together, and every call's seconds."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    command = [sys.executable, str(Path(__file__).resolve()), "--client", address, token, op]
    procs = [
        subprocess.Popen(
            [*command, str(seconds), str(block)], stdout=subprocess.PIPE, text=True, env=env
        )
        for _ in range(clients)
    ]
    outputs = [proc.communicate(timeout=seconds + 120)[0] for proc in procs]
    if any(proc.returncode for proc in procs):
        raise SystemExit(f"a client failed in {tree}")
    counted = [json.loads(out) for out in outputs]
    took = [seconds for one in counted for seconds in one["took"]]
    return sum(one["calls"] for one in counted), sum(one["cpu"] for one in counted), took


def cpu_ns(pid: int) -> int:
    """The process's CPU time, user and system, its ended threads included (a bulk
    connection's thread ends with its client, before the measurement does), and that
    of its live children (the bulk workers)."""
    ticks = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
        except OSError:
            continue  # a process that ended meanwhile
        if stat.parent.name == str(pid) or fields[1] == str(pid):  # itself, or a child
            ticks += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15)
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


class Served:
    """`kvshare serve` in dev mode from the checkout `tree`."""

    def __init__(
        self, tree: Path, data_dir: Path, workers: int = 1, *, metrics: bool = False
    ) -> None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
        more = ["--bulk-workers", str(workers)] if workers > 1 else []
        more += ["--metrics-listen", "127.0.0.1:0"] if metrics else []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvshare.cli", "serve", "--data-dir", str(data_dir),
             "--listen", "127.0.0.1:0", *more],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tree, env=env,
        )  # fmt: skip
        assert self.proc.stdout is not None
        self.address = next(
            m[1] for line in self.proc.stdout if (m := re.search(r"serving on (\S+)", line))
        )
        self.token = (data_dir / "dev.token").read_text().strip()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def measure(
    tree: Path,
    op: str,
    clients: int,
    seconds: float,
    py_spy: str | None,
    workers: int = 1,
    block: int = BLOCK,
    *,
    metrics: bool = False,
) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix="kvshare-profile-"))
    served = Served(tree, data / "data", workers, metrics=metrics)
    try:
        drive(tree, served.address, served.token, op, clients, min(seconds, 4), block)  # warm-up
        time.sleep(2)  # start-up work (the journal's prefault) settles
        recorder = None
        if py_spy:
            out = f"{py_spy}-{tree.name}-{op}-{clients}.txt"
            recorder = subprocess.Popen(
                [shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy"),
                 "record", "-p", str(served.proc.pid), "--threads", "-r", "200",
                 "-d", str(int(seconds) + 1), "-f", "raw", "-o", out, "--nonblocking"],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            time.sleep(0.5)
        before = cpu_ns(served.proc.pid)
        calls, client_cpu_s, took = drive(
            tree, served.address, served.token, op, clients, seconds, block
        )
        took.sort()
        used = cpu_ns(served.proc.pid) - before
        if recorder is not None:
            recorder.wait(60)
    finally:
        served.stop()
        shutil.rmtree(data, ignore_errors=True)
    # The clients' own puts before their loop are in `used` too: a few ms per client.
    return {
        "tree": tree.name + (f"-{workers}w" if workers > 1 else ""),
        "workers": workers,
        "op": op,
        "block_bytes": block,
        "clients": clients,
        "calls_per_s": round(calls / seconds),
        "server_cpu_us_per_call": round(used / 1000 / max(calls, 1), 1),
        "client_cpu_us_per_call": round(client_cpu_s * 1e6 / max(calls, 1), 1),
        "p50_ms": round(percentile(took, 0.50) * 1e3, 3),
        "p99_ms": round(percentile(took, 0.99) * 1e3, 3),
    }


def main() -> int:
    if sys.argv[1:2] == ["--client"]:
        address, token, op, seconds, block = sys.argv[2:7]
        calls, cpu, took = client_loop(address, token, op, float(seconds), int(block))
        print(json.dumps({"calls": calls, "cpu": cpu, "took": took}))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--op", choices=("lookup", "get", "put"), default="lookup")
    parser.add_argument("--clients", default="1,4")
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--before", type=Path, help="another checkout, measured alternately")
    parser.add_argument("--workers", default="1", help="bulk-serving processes, e.g. 1,2")
    parser.add_argument("--block-bytes", type=int, default=BLOCK, help="each block's size")
    parser.add_argument("--metrics", action="store_true", help="Prometheus endpoint on")
    parser.add_argument("--py-spy", metavar="PREFIX")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    trees = ([args.before.resolve()] if args.before else []) + [REPO]
    rows = []
    counts = [int(n) for n in args.workers.split(",")]
    for _ in range(args.rounds):
        for clients in (int(c) for c in args.clients.split(",")):
            for tree, workers in ((t, n) for t in trees for n in counts):
                row = measure(
                    tree,
                    args.op,
                    clients,
                    args.seconds,
                    args.py_spy,
                    workers,
                    args.block_bytes,
                    metrics=args.metrics,
                )
                rows.append(row)
                if not args.json:
                    print(
                        f"{row['tree']:>14} {row['op']:>6} clients={clients:<3} "
                        f"{row['calls_per_s']:>7} calls/s  "
                        f"server CPU {row['server_cpu_us_per_call']:>8} us/call  "
                        f"client CPU {row['client_cpu_us_per_call']:>8} us/call  "
                        f"p50 {row['p50_ms']:.2f} p99 {row['p99_ms']:.2f} ms",
                        flush=True,
                    )
    if args.json:
        print(json.dumps(rows))
    elif args.rounds > 1:
        for name in sorted({r["tree"] for r in rows}):
            for clients in sorted({r["clients"] for r in rows}):
                mine = [r for r in rows if r["tree"] == name and r["clients"] == clients]
                cpu = statistics.median(r["server_cpu_us_per_call"] for r in mine)
                client = statistics.median(r["client_cpu_us_per_call"] for r in mine)
                rate = statistics.median(r["calls_per_s"] for r in mine)
                print(
                    f"median {name:>14} clients={clients}: {rate:.0f} calls/s, "
                    f"server {cpu} us/call, client {client} us/call"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
