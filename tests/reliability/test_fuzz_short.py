"""A short run of the fuzzing campaign (benchmarks/fuzz.py) in CI: a few thousand
inputs over every target, against a live `kvshare serve` and an embedded server.

It must not crash the server or grow its memory, and every finding must be one of the
known bugs below, each of which would have its own xfail test in test_found_bugs.py (a
new kind of finding fails this test with its name; a fixed bug simply stops appearing)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from benchmarks.reliability.harness import REPO

pytestmark = pytest.mark.slow  # every test here takes seconds

CASES = 3500
# finding pattern -> the bug it is (and its xfail test in test_found_bugs.py). Empty:
# the malformed-protobuf and hostile-bulk-reply findings are fixed, and their tests in
# test_found_bugs.py are plain tests now.
KNOWN_FINDINGS: dict[str, str] = {}


def test_a_short_fuzzing_campaign_finds_only_known_bugs() -> None:
    done = subprocess.run(
        [sys.executable, "benchmarks/fuzz.py", "--cases", str(CASES), "--json", "--seed", "1"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=600,
        check=True,
    )
    report = json.loads(done.stdout)
    assert list(report)[:5] == [
        "cases",
        "server_crashes",
        "internal_errors",
        "unexpected_statuses",
        "rss_growth_bytes",
    ]
    assert report["cases"] >= CASES - len(report["targets"])  # every target ran its share
    assert all(t["cases"] > 0 for t in report["targets"].values())
    assert report["server_crashes"] == 0
    assert report["rss_growth_bytes"] < 64 << 20
    unknown = [f for f in report["findings"] if not any(re.search(p, f) for p in KNOWN_FINDINGS)]
    assert unknown == [], f"new kinds of findings: {unknown}"
