"""CPU time a benchmarked server spends, read from /proc (Linux) around a timed cell.

`cpu_seconds(pids)` sums the on-CPU time of every thread of each process and of its
descendants (a server started through `ip netns exec`, or one that forks helpers, is
still counted whole). The clock is each thread's `schedstat` (nanoseconds on CPU,
user and system together), since `/proc/<pid>/stat` counts 10 ms ticks: too coarse for
a cell of 0.1 s. Invariants:

- a reading only grows while the threads it read live; the difference of two
  readings is the CPU the processes spent between them, except for threads that
  exited in between (their share is lost: the figure is then a lower bound). The
  servers measured keep their threads for a client pool's lifetime;
- the network namespace does not matter: `--two-host` servers share this pid
  namespace and /proc, so the same pids are read.

Without /proc (not Linux) every reading is None and the figure is left out.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path

PROC = Path("/proc")
NS_PER_S = 1e9


def cpu_seconds(pids: Sequence[int], proc: Path = PROC) -> float | None:
    """On-CPU seconds of `pids` and their descendants so far; None if none can be read."""
    if not pids or not (proc / str(pids[0])).exists():
        return None
    total_ns = 0
    for pid in _with_descendants(pids, proc):
        total_ns += _process_ns(pid, proc)
    return total_ns / NS_PER_S


def per_call_us(before_s: float | None, after_s: float | None, calls: int) -> float | None:
    """CPU microseconds per call between two readings; None where either is missing."""
    if before_s is None or after_s is None or calls <= 0:
        return None
    return max(0.0, after_s - before_s) * 1e6 / calls


def _process_ns(pid: int, proc: Path) -> int:
    """Sum of the first `schedstat` field (ns on CPU) over the threads of `pid`;
    falls back to /proc/<pid>/stat's utime+stime where schedstat is missing."""
    if not (proc / str(pid) / "schedstat").exists():
        return _stat_ns(pid, proc)  # a kernel without CONFIG_SCHED_INFO
    total = 0
    try:
        tasks = list((proc / str(pid) / "task").iterdir())
    except OSError:
        return 0  # the process exited between the scan and this read
    for task in tasks:
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread exited between the listing and this read
    return total


def _stat_ns(pid: int, proc: Path) -> int:
    """utime+stime of the whole process (fields 14 and 15, after the command name)."""
    try:
        fields = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return 0
    ticks = int(fields[11]) + int(fields[12])
    return int(ticks * NS_PER_S / os.sysconf("SC_CLK_TCK"))


def _with_descendants(pids: Iterable[int], proc: Path) -> list[int]:
    """`pids` and every process whose parent chain reaches one of them."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            text = Path(entry.path, "stat").read_text()
            parent = int(text.rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(entry.name))
    found: list[int] = []
    pending = list(pids)
    while pending:
        pid = pending.pop()
        if pid not in found:
            found.append(pid)
            pending += children.get(pid, [])
    return found
