"""Time the full `kvshare simulate` sweep: 5 replica counts x 4 policies x 2 store settings.

A benchmark command, not a timed test: it prints the wall time of the whole CLI run
(interpreter start, trace parsing, 40 replays, JSON output) for each repeat, and the
8-replica hit rates so a run can be checked at a glance. The target is under 60 s on
the project's 2-vCPU build machines.

    python benchmarks/simulate_sweep.py [--trace FILE] [--repeat 3] [simulate flags...]

Any other flag goes to `kvshare simulate`, e.g. `--replica-capacity-tokens 400000`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_TRACE = Path(__file__).resolve().parent / "traces/synthetic_trace.jsonl"
SWEEP_FLAGS = ["--replicas", "1,2,4,8,16", "--shared-store", "both", "--json", "--no-progress"]


def run_once(trace: Path, extra_flags: list[str]) -> tuple[float, dict[str, object]]:
    command = [
        sys.executable, "-m", "kvshare.cli", "simulate", "--trace", str(trace),
        *SWEEP_FLAGS, *extra_flags,
    ]  # fmt: skip
    started_s = time.perf_counter()
    completed = subprocess.run(command, capture_output=True, text=True, check=False)
    wall_s = time.perf_counter() - started_s
    if completed.returncode != 0:
        sys.exit(f"simulate failed ({completed.returncode}): {completed.stderr.strip()}")
    return wall_s, json.loads(completed.stdout)


def main() -> int:
    parser = argparse.ArgumentParser(description="Time the full kvshare simulate sweep.")
    parser.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    parser.add_argument("--repeat", type=int, default=3)
    args, extra_flags = parser.parse_known_args()
    walls_s = []
    report: dict[str, object] = {}
    for attempt in range(1, args.repeat + 1):
        wall_s, report = run_once(args.trace, extra_flags)
        walls_s.append(wall_s)
        print(f"run {attempt}: {wall_s:.2f} s wall")
    results = report["results"]
    assert isinstance(results, list)
    print(f"configurations per run: {len(results)}; trace: {args.trace}")
    print(f"wall time: min {min(walls_s):.2f} s, median {statistics.median(walls_s):.2f} s")
    print(f"ideal token hit rate: {report['ideal_token_hit_rate']:.4f}")
    for entry in results:
        if entry["replicas"] == 8:
            store = "store" if entry["shared_store"] else "local"
            print(
                f"  8 replicas {entry['policy']:<16}{store:<6} hit {entry['token_hit_rate']:.4f}"
                f"  load max/mean {entry['load_max_over_mean']:.3f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
