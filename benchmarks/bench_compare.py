"""Compare two `kvshare bench --json` runs cell by cell, with the rounds as the noise.

    python benchmarks/bench_compare.py before.json after.json [--peer tcp]
    python benchmarks/bench_compare.py --before b1.json b2.json --after a1.json a2.json

With several runs a side (runs of the two codes alternated in one sitting), each cell's
rounds are pooled across the runs: a machine that has a slow minute then slows one run
of each side, not one side alone. Besides the verdict it prints each pooled cell's
median ratio before and after (`--all` for every cell, not only those that moved).

For every kvshare cell present in both runs it takes the ratio to the peer (raw TCP by
default) in each round, and calls the cell "below noise" when every round's ratio
after is below every round's ratio before (the ranges do not overlap), "above" for
the reverse, and leaves it blank when the ranges overlap. It prints one line per cell
that moved and a count; it exits 1 when a cell is below noise.

Why rounds: on a shared 2-core machine one cell moves by a third between rounds, and
the peer moves with it; the ratio within a round cancels what the machine did to both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

Cell = tuple[str, str, int, int, int]  # system, op, value bytes, clients, blocks per call


def load(path: Path) -> dict[Cell, list[float]]:
    rows = json.loads(path.read_text())["results"]
    return {
        # throughput_rounds: calls/s for lookup rows (their MB/s is 0); older runs lack it.
        (r["system"], r["op"], r["value_bytes"], r["clients"], r.get("blocks_per_call", 1)): r.get(
            "throughput_rounds", r["mb_per_s_rounds"]
        )
        for r in rows
    }


def round_ratios(run: dict[Cell, list[float]], cell: Cell, peer: str) -> list[float] | None:
    system = cell[0]
    peer_system = peer + "-batch" if system.endswith("-batch") else peer
    base = run.get((peer_system, *cell[1:]))
    rounds = run.get(cell)
    if not base or not rounds or len(base) != len(rounds) or not all(base):
        return None
    return sorted(mine / theirs for mine, theirs in zip(rounds, base, strict=True))


def pooled(paths: list[Path]) -> dict[Cell, list[float]]:
    """Every run's rounds of each cell, run by run (a cell's peer rounds line up)."""
    runs: dict[Cell, list[float]] = {}
    for path in paths:
        for cell, rounds in load(path).items():
            runs.setdefault(cell, []).extend(rounds)
    return runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="*", help="before.json after.json")
    parser.add_argument("--before", type=Path, nargs="+", default=[])
    parser.add_argument("--after", type=Path, nargs="+", default=[])
    parser.add_argument("--peer", default="tcp", help="the system ratios are taken to")
    parser.add_argument("--all", action="store_true", help="print every cell's medians")
    args = parser.parse_args()
    if args.runs:
        if len(args.runs) != 2 or args.before or args.after:
            parser.error("give two files (before, after), or --before ... --after ...")
        args.before, args.after = [args.runs[0]], [args.runs[1]]
    if not args.before or not args.after:
        parser.error("give two files (before, after), or --before ... --after ...")
    before, after = pooled(args.before), pooled(args.after)
    below = above = compared = 0
    for cell in after:
        if not cell[0].startswith("kvshare"):
            continue
        old, new = round_ratios(before, cell, args.peer), round_ratios(after, cell, args.peer)
        if old is None or new is None:
            continue
        compared += 1
        verdict = "below noise" if max(new) < min(old) else "above" if min(new) > max(old) else ""
        below += verdict == "below noise"
        above += verdict == "above"
        if verdict or args.all:
            system, op, size, clients, _ = cell
            print(
                f"{system:26} {op} {size // 1024:>5} KiB {clients} client(s): x{args.peer} "
                f"before {old[0]:.2f}-{old[-1]:.2f} (median {statistics.median(old):.2f}), "
                f"after {new[0]:.2f}-{new[-1]:.2f} (median {statistics.median(new):.2f})  "
                f"{verdict}"
            )
    print(f"{compared} cells compared: {below} below noise, {above} above")
    return 1 if below else 0


if __name__ == "__main__":
    sys.exit(main())
