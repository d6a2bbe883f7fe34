"""`kvshare bench` as a child process: a tiny run's JSON document, its rows by system
and operation, and the row contract (docs/design.md §8)."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

CONTRACT_KEYS = {"system", "op", "value_bytes", "clients", "mb_per_s", "p50_ms", "p99_ms"}


TINY = ["--quick", "--sizes", "16KiB", "--seconds", "0.05", "--batch-blocks", "4"]


def run_bench(*argv: str, timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "bench", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def json_run(*argv: str) -> dict[str, Any]:
    result = run_bench(*TINY, "--json", *argv)
    assert result.returncode == 0, result.stderr[-3000:]
    document: dict[str, Any] = json.loads(result.stdout)  # stdout holds only the JSON
    return document


def by_system(document: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["system"], row["op"]): row for row in document["results"]}


def assert_contract(row: dict[str, Any]) -> None:
    assert set(row) >= CONTRACT_KEYS
    assert row["op"] in ("get", "put", "lookup")
    assert 0 < row["p50_ms"] <= row["p99_ms"] and row["calls_per_s"] > 0
    if row["op"] == "lookup":  # no payload moves: its throughput is in calls/s
        assert row["throughput_unit"] == "calls_per_s" and row["mb_per_s"] == 0
        assert row["blocks_per_call"] == 64 and row["value_bytes"] == 64 * 1024
    else:
        assert row["throughput_unit"] == "mb_per_s" and row["mb_per_s"] > 0
