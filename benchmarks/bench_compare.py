"""Compare two `kvshare bench --json` runs cell by cell, with the rounds as the noise.

    python benchmarks/bench_compare.py before.json after.json [--peer tcp]
    python benchmarks/bench_compare.py --before b1.json b2.json --after a1.json a2.json
    python benchmarks/bench_compare.py --before b1.json --after a1.json --table

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


def _cells(paths: list[Path]) -> dict[tuple[str, str, int, int], tuple[float, float | None]]:
    """Each single-block cell's median MB/s over every round of `paths`, and the median
    of the runs' server CPU per call."""
    rounds: dict[tuple[str, str, int, int], list[float]] = {}
    cpu: dict[tuple[str, str, int, int], list[float]] = {}
    for path in paths:
        for r in json.loads(path.read_text())["results"]:
            if r.get("blocks_per_call", 1) != 1:
                continue
            key = (r["system"], r["op"], r["value_bytes"], r["clients"])
            rounds.setdefault(key, []).extend(r["mb_per_s_rounds"])
            if r.get("server_cpu_us_per_call"):
                cpu.setdefault(key, []).append(r["server_cpu_us_per_call"])
    return {
        key: (statistics.median(mbs), statistics.median(cpu[key]) if key in cpu else None)
        for key, mbs in rounds.items()
    }


def whole_table(before_paths: list[Path], after_paths: list[Path]) -> str:
    """Markdown: per cell and system, MB/s (server CPU us per call) before -> after."""
    before, after = _cells(before_paths), _cells(after_paths)
    systems = sorted({key[0] for key in after}, key=lambda s: (s.startswith("kvshare"), s))
    cells = sorted({key[1:] for key in after}, key=lambda c: (c[0] != "put", c[1], c[2]))

    def shown(figures: tuple[float, float | None] | None) -> str:
        if figures is None:
            return "-"
        mbs, cpu = figures
        return f"{mbs:,.0f}" + ("" if cpu is None else f" ({cpu:,.0f})")

    lines = ["| cell | " + " | ".join(systems) + " |", "|---" * (len(systems) + 1) + "|"]
    for op, size, clients in cells:
        row = [
            f"{shown(before.get(key))} -> {shown(after.get(key))}"
            for key in ((s, op, size, clients) for s in systems)
        ]
        name = f"{size // 1024} KiB" if size < 1 << 20 else f"{size >> 20} MiB"
        lines.append(f"| {op.upper()} {name}, {clients}c | " + " | ".join(row) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="*", help="before.json after.json")
    parser.add_argument("--before", type=Path, nargs="+", default=[])
    parser.add_argument("--after", type=Path, nargs="+", default=[])
    parser.add_argument("--peer", default="tcp", help="the system ratios are taken to")
    parser.add_argument("--all", action="store_true", help="print every cell's medians")
    parser.add_argument(
        "--table",
        action="store_true",
        help="print the whole table instead: each single-block cell's median MB/s and "
        "server CPU per call, before -> after, every system side by side (markdown)",
    )
    args = parser.parse_args()
    if args.runs:
        if len(args.runs) != 2 or args.before or args.after:
            parser.error("give two files (before, after), or --before ... --after ...")
        args.before, args.after = [args.runs[0]], [args.runs[1]]
    if not args.before or not args.after:
        parser.error("give two files (before, after), or --before ... --after ...")
    if args.table:
        print(whole_table(args.before, args.after))
        return 0
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
