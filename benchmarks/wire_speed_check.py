"""Check one `kvshare bench --json` run against the read-speed targets (docs/benchmarks.md).

    kvshare bench --two-host --sizes 64KiB,2MiB,8MiB --clients 1,4,16 --rounds 3 \
        --systems tcp,redis,lmcache,kvshare-tcp,kvshare-tls-sealed --json > run.json
    python benchmarks/wire_speed_check.py run.json

Each target is a ratio of two systems' throughput in the same cells of one run: the
plain bulk channel (`kvshare-tcp`) against raw TCP and LMCache's server for 2 MiB GETs,
and the production configuration (`kvshare-tls-sealed`: TLS for gRPC, the sealed-payload
bulk channel, every block sealed on PUT and opened on GET) against the plain one. A
ratio is the cell's median over the run's rounds (what the bench reports), with the
range of the per-round ratios beside it (rounds are interleaved, so a round's ratio
cancels what the machine did to both systems in it). Exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

KIB, MIB = 1 << 10, 1 << 20


@dataclass(frozen=True)
class Target:
    system: str
    base: str
    op: str
    value_bytes: int
    clients: int
    at_least: float


TARGETS = (
    *(Target("kvshare-tcp", "tcp", "get", 2 * MIB, c, 0.9) for c in (1, 4)),
    *(Target("kvshare-tcp", "lmcache", "get", 2 * MIB, c, 1.0) for c in (1, 4)),
    *(Target("kvshare-tls-sealed", "kvshare-tcp", "get", 2 * MIB, c, 0.9) for c in (1, 4)),
    Target("kvshare-tls-sealed", "kvshare-tcp", "get", 64 * KIB, 4, 0.75),
    *(Target("kvshare-tls-sealed", "kvshare-tcp", "put", 2 * MIB, c, 0.85) for c in (1, 4)),
)

Cell = tuple[str, str, int, int]


def load(path: Path) -> dict[Cell, list[float]]:
    """Each single-block cell's throughput per round."""
    rows = json.loads(path.read_text())["results"]
    return {
        (r["system"], r["op"], r["value_bytes"], r["clients"]): r["mb_per_s_rounds"]
        for r in rows
        if r.get("blocks_per_call", 1) == 1
    }


def size_name(value_bytes: int) -> str:
    return f"{value_bytes // MIB} MiB" if value_bytes >= MIB else f"{value_bytes // KIB} KiB"


def check(cells: dict[Cell, list[float]]) -> list[tuple[Target, float | None, str]]:
    """Per target: the median ratio (None: a cell is missing) and the per-round range."""
    out: list[tuple[Target, float | None, str]] = []
    for t in TARGETS:
        mine = cells.get((t.system, t.op, t.value_bytes, t.clients))
        base = cells.get((t.base, t.op, t.value_bytes, t.clients))
        if not mine or not base:
            out.append((t, None, "not in this run"))
            continue
        ratio = statistics.median(mine) / statistics.median(base)
        rounds = [m / b for m, b in zip(mine, base, strict=False) if b]
        spread = f"{min(rounds):.2f}-{max(rounds):.2f}" if rounds else "-"
        out.append((t, ratio, spread))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a `kvshare bench --json` output")
    args = parser.parse_args(argv)
    results = check(load(args.run))
    missed = 0
    print("| cell | ratio | target | rounds | |")
    print("|---|---|---|---|---|")
    for t, ratio, spread in results:
        cell = f"{t.system} / {t.base}, {t.op.upper()} {size_name(t.value_bytes)}, {t.clients}c"
        if ratio is None:
            verdict, shown = "missing", "-"
            missed += 1
        else:
            verdict, shown = ("met" if ratio >= t.at_least else "MISSED"), f"{ratio:.2f}x"
            missed += ratio < t.at_least
        print(f"| {cell} | {shown} | >= {t.at_least:.2f}x | {spread} | {verdict} |")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
