"""A short run of benchmarks/faults.py in CI (the recorded run is every scenario with
50 kill -9 cycles): the cheaper scenarios, with the command's contract keys.

A scenario may fail only for a known bug with its own xfail test (test_found_bugs.py);
the full list of scenarios and what each found is in docs/reliability.md."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from benchmarks.reliability.harness import REPO

pytestmark = pytest.mark.slow  # every test here takes seconds

SCENARIOS = "kill9,lmdb_map_full,corrupt_files,server_paused,clock_jumps"
# scenario -> the bug that fails it, and its xfail test in test_found_bugs.py. Empty:
# the ones found so far (journal records not counted, blocks lost when the map is full)
# are fixed.
KNOWN_FAILURES: dict[str, str] = {}


def test_short_fault_injection_loses_and_tears_nothing() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/faults.py", "--cycles", "3", "--only", SCENARIOS, "--json"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=False,
    )
    report = json.loads(done.stdout)
    assert list(report) == ["scenarios", "kill9_cycles", "acknowledged_lost", "torn_served"]
    outcomes = {s["name"]: s for s in report["scenarios"]}
    assert list(outcomes) == SCENARIOS.split(",")
    assert all(set(s) == {"name", "passed", "detail"} for s in report["scenarios"])
    assert report["kill9_cycles"] == 3
    assert report["acknowledged_lost"] == 0
    assert report["torn_served"] == 0
    assert outcomes["kill9"]["passed"] is True, outcomes["kill9"]["detail"]
    assert outcomes["server_paused"]["passed"] is True, outcomes["server_paused"]["detail"]
    assert outcomes["lmdb_map_full"]["passed"] is True, outcomes["lmdb_map_full"]["detail"]
    assert outcomes["clock_jumps"]["passed"] in (True, None), outcomes["clock_jumps"]["detail"]
    failed = {n for n, s in outcomes.items() if s["passed"] is False}
    assert failed <= set(KNOWN_FAILURES), [outcomes[n]["detail"] for n in failed]
