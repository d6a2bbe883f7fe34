"""`kvshare bench` over a Redis Cluster: the three cluster systems run in one short run
and report the two cluster targets of kvshare/bench/checks.py (cold GET >= 0.5x and warm
GET >= 1.0x redis-cluster; no figure is asserted beyond being positive)."""

from __future__ import annotations

import pytest

from tests.support.bench import assert_contract, by_system, json_run

pytestmark = pytest.mark.slow  # every test here takes seconds


def test_the_cluster_systems_run_side_by_side_and_report_their_targets() -> None:
    systems = ("redis-cluster", "kvshare-cluster", "kvshare-cluster-warm")
    document = json_run("--systems", ",".join(systems), "--sizes", "2MiB")
    rows = by_system(document)
    for system in systems:
        for op in ("get", "put"):
            assert_contract(rows[(system, op)])
        assert (f"{system}-batch", "get") in rows
    checks = {c["check"]: c for c in document["checks"]}
    cold = next(c for n, c in checks.items() if n.startswith("kvshare-cluster GET 2 MiB (cold"))
    warm = next(c for n, c in checks.items() if n.startswith("kvshare-cluster-warm GET"))
    for check in (cold, warm):
        assert check["value"] is not None and check["value"] > 0
