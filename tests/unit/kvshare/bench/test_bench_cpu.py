"""The server CPU time the bench reads from /proc (kvshare.bench.cpu)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvshare.bench.cpu import cpu_seconds, per_call_us

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")


def _spin(seconds: float) -> None:
    deadline = time.process_time() + seconds
    while time.process_time() < deadline:
        pass


def test_a_busy_process_reads_more_cpu_than_before() -> None:
    before = cpu_seconds([os.getpid()])
    _spin(0.05)
    after = cpu_seconds([os.getpid()])
    assert before is not None and after is not None
    assert after - before >= 0.04  # on-CPU time, not wall time; no upper bound asserted


def test_descendants_are_counted_with_their_parent() -> None:
    """A server started through a wrapper (or one that forks) is read whole: the
    parent's reading includes a live child's CPU."""
    script = (
        "import time\nd = time.process_time() + 0.2\n"
        "while time.process_time() < d: pass\nprint(flush=True)\ntime.sleep(30)\n"
    )
    before = cpu_seconds([os.getpid()])
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None
        child.stdout.readline()  # it spun 0.2 s of CPU and sleeps now
        child_alone = cpu_seconds([child.pid])
        after = cpu_seconds([os.getpid()])
        assert before is not None and after is not None and child_alone is not None
        assert child_alone >= 0.15
        assert after - before >= child_alone * 0.9
    finally:
        child.kill()
        child.wait()


def test_no_process_reads_none_and_per_call_needs_both_readings() -> None:
    assert cpu_seconds([]) is None
    assert per_call_us(None, 1.0, 10) is None
    assert per_call_us(1.0, 1.5, 0) is None
    assert per_call_us(1.0, 1.5, 10) == pytest.approx(50_000.0)
    assert per_call_us(1.5, 1.0, 10) == 0.0  # never negative
