"""`kvshare bench --two-host`: each server in one namespace, its clients in another.

A smoke run of the command and its JSON (docs/design.md §8: every row carries "topology"); no
figure is asserted beyond being positive.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvshare.bench import netns
from tests.support.repo import REPO
from tests.support.twohost import namespaces

pytestmark = pytest.mark.slow  # every test here takes seconds


def test_every_row_ran_across_the_veth_and_the_rig_is_gone() -> None:
    reason = netns.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    systems = "tcp,kvshare-tcp,kvshare-tls-sealed,redis-unix"
    if shutil.which("redis-server"):
        systems += ",redis"
    before = namespaces()
    result = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "bench", "--two-host", "--quick", "--json",
         "--sizes", "16KiB", "--seconds", "0.05", "--batch-blocks", "4", "--systems", systems],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    document = json.loads(result.stdout)
    assert document["failed"] == {} and document["settings"]["topology"] == "two-host"
    assert "does not cross hosts" in document["skipped"]["redis-unix"]
    ran = {row["system"] for row in document["results"]}
    assert {"tcp", "kvshare-tcp", "kvshare-tls-sealed", "kvshare-tls-sealed-batch"} <= ran
    assert {"tcp", "kvshare-tcp"} <= {
        r["system"] for r in document["results"] if r["op"] == "lookup"
    }
    for row in document["results"]:
        assert row["topology"] == "two-host" and row["p50_ms"] > 0
        assert row["mb_per_s"] > 0 or row["op"] == "lookup"
        # The servers run in the other namespace; /proc (one pid namespace) still has them.
        assert row["server_cpu_us_per_call"] > 0
    assert "servers at 198.18.0.1" in result.stderr
    assert namespaces() <= before  # everything the run made is removed
