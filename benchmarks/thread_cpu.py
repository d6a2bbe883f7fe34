"""Which of the kvshare server's threads spent the CPU of each `kvshare bench` cell.

    python benchmarks/thread_cpu.py -- --two-host --sizes 64KiB,2MiB,8MiB --clients 1,4 \
        --rounds 1 --systems kvshare-tcp --batch-blocks 0 --lookup-blocks 0

Runs `kvshare bench` with the arguments after `--` and, while it runs, reads the CPU time
of every thread of the running `kvshare serve` every 20 ms (/proc/<pid>/task/*/stat) and
the threads' names every 0.7 s (`py-spy dump`; Python does not name OS threads). Each
bench progress line ends a cell whose timed part took about `--seconds` (0.5 s by
default): the script prints, per cell, the milliseconds each thread name spent in that
window. Written for issue 37, to see whether background work (the journal's prefaulter,
the writer's drain, the fsync) ran while reads were served. Resolution: the kernel's
10 ms clock tick; a thread that ended inside a window is not counted.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

SERVER = "kvshare.cli serve"
CELL = re.compile(r"\[\s*[\d.]+s\] round \S+ (\S+): (put|get) (\S+ \S+), (\d+) client")
NAMED = re.compile(r'Thread (\d+) \([^)]*\): "([^"]+)"')
TICK_MS = 1000 / os.sysconf("SC_CLK_TCK")
Sample = tuple[float, int, dict[str, int]]  # when, server pid, ticks by thread id


def server_pid() -> int | None:
    found = subprocess.run(["pgrep", "-f", SERVER], capture_output=True, text=True).stdout
    return int(found.split()[0]) if found.split() else None


def thread_ticks(pid: int) -> dict[str, int]:
    ticks: dict[str, int] = {}
    try:
        tids = [path.name for path in Path(f"/proc/{pid}/task").iterdir()]
    except OSError:
        return ticks
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rpartition(")")[2].split()
        ticks[tid] = int(fields[11]) + int(fields[12])  # utime, stime
    return ticks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.5, help="the bench's cell time")
    parser.add_argument("bench", nargs=argparse.REMAINDER, help="-- then kvshare bench's args")
    args = parser.parse_args(argv)
    bench_args = args.bench[1:] if args.bench[:1] == ["--"] else args.bench
    bench = subprocess.Popen(
        [sys.executable, "-m", "kvshare", "bench", *bench_args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    assert bench.stderr is not None
    progress = bench.stderr.fileno()
    os.set_blocking(progress, False)
    started = time.monotonic()
    samples: list[Sample] = []
    lines: list[tuple[float, str]] = []
    names: dict[str, str] = {}
    pid, named_at, pending = None, 0.0, ""
    while bench.poll() is None:
        now = time.monotonic() - started
        if pid is None or not Path(f"/proc/{pid}").exists():
            pid = server_pid()
        if pid is not None:
            samples.append((now, pid, thread_ticks(pid)))
            if now - named_at > 0.7:
                named_at = now
                dump = subprocess.run(
                    ["py-spy", "dump", "--nonblocking", "--pid", str(pid)],
                    capture_output=True,
                    text=True,
                ).stdout
                names.update(NAMED.findall(dump))
        with contextlib.suppress(BlockingIOError):  # nothing new on the progress pipe
            pending += os.read(progress, 1 << 16).decode("utf-8", "replace")
        *complete, pending = pending.split("\n")
        lines += [(now, line) for line in complete]
        time.sleep(0.02)
    report(samples, lines, names, args.seconds)
    return bench.returncode


def report(
    samples: list[Sample], lines: list[tuple[float, str]], names: dict[str, str], seconds: float
) -> None:
    def at(t: float) -> Sample | None:
        before = [s for s in samples if s[0] <= t]
        return before[-1] if before else None

    for seen, line in lines:
        match = CELL.search(line)
        if match is None:
            continue
        first, last = at(seen - seconds), at(seen)
        if first is None or last is None or first[1] != last[1]:
            continue
        spent: collections.Counter[str] = collections.Counter()
        for tid, ticks in last[2].items():
            spent[names.get(tid, "other")] += ticks - first[2].get(tid, ticks)
        system, op, size, clients = match.groups()
        shown = " ".join(f"{n}={t * TICK_MS:.0f}ms" for n, t in spent.most_common() if t > 0)
        print(f"{system:20} {op:3} {size:7} {clients:>2}c  {shown}")


if __name__ == "__main__":
    raise SystemExit(main())
