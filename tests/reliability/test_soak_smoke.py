"""A few seconds of benchmarks/soak.py in CI (the recorded run is 16 clients for 10
minutes): the command's contract keys, no errors, nothing lost or corrupt."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.reliability.harness import REPO

pytestmark = pytest.mark.slow  # every test here takes seconds

KEYS = [
    "requests",
    "errors",
    "acknowledged_blocks",
    "lost_blocks",
    "corrupt_blocks",
    "rss_start_bytes",
    "rss_end_bytes",
    "p50_ms",
    "p99_ms",
]


def test_a_short_soak_loses_and_corrupts_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/soak.py", "--clients", "4", "--seconds", "3", "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        check=True,
    )
    report = json.loads(done.stdout)
    assert list(report)[: len(KEYS)] == KEYS
    assert report["requests"] > 100 and report["acknowledged_blocks"] > 10
    assert report["errors"] == 0, (report["error_kinds"], report["client_failures"])
    assert report["lost_blocks"] == 0
    assert report["corrupt_blocks"] == 0
    assert report["resurrected_blocks"] == 0
    assert report["rss_max_bytes"] <= report["rss_budget_bytes"]
