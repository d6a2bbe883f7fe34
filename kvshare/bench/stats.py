"""From timed cells to report rows: medians over rounds, ratios within a round.

Pure functions over plain values, so the arithmetic is tested without any server.
Absolute figures drift 2-3x between runs on shared machines; a ratio is only ever
taken between two cells of the same round, then the median of those ratios is kept.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

MB = 1_000_000  # MB/s are decimal megabytes per second
REFERENCE_SYSTEMS = (
    "tcp",
    "redis",
    "redis-unix",
    "lmcache",
    "kvshare",
    "kvshare-tcp",
    "redis-cluster",
)
BATCH_SUFFIX = "-batch"
# A lookup cell moves no payload: its throughput is calls per second (`calls_per_s`),
# its `mb_per_s` is 0, and its ratios to peers compare calls per second.
LOOKUP_OP = "lookup"
THROUGHPUT_UNIT = {"get": "mb_per_s", "put": "mb_per_s", LOOKUP_OP: "calls_per_s"}


@dataclass(frozen=True)
class CellOutcome:
    """What one client process measured in one cell."""

    started_s: float  # perf_counter (CLOCK_MONOTONIC, shared by all processes)
    ended_s: float
    calls: int
    latencies_ns: tuple[int, ...]


@dataclass(frozen=True)
class CellFigures:
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    calls: int
    blocks_per_s_per_client: float
    calls_per_s: float = 0.0  # over all clients
    # The server's CPU time in the timed part over `calls` (kvshare.bench.cpu); None
    # where the harness does not know the server's processes.
    server_cpu_us_per_call: float | None = None

    def throughput(self, op: str) -> float:
        """What ratios compare: MB/s, or calls/s for a lookup (which moves no payload)."""
        return self.calls_per_s if op == LOOKUP_OP else self.mb_per_s


@dataclass(frozen=True)
class Sample:
    """One cell of one round: a system, an operation, a value size, a client count."""

    family: str  # "tcp", "kvshare-tls"...: the system without the batch suffix
    op: str  # "get" | "put" | "lookup"
    value_bytes: int
    clients: int
    blocks_per_call: int
    round_index: int
    figures: CellFigures

    @property
    def system(self) -> str:
        """A batched GET or PUT is its own system (`-batch`); a lookup always has many
        digests per call and keeps the family's name."""
        is_batch = self.blocks_per_call > 1 and self.op != LOOKUP_OP
        return self.family + (BATCH_SUFFIX if is_batch else "")


@dataclass(frozen=True)
class Row:
    system: str
    op: str
    value_bytes: int
    clients: int
    blocks_per_call: int
    mb_per_s: float
    p50_ms: float
    p99_ms: float
    blocks_per_s_per_client: float
    mb_per_s_rounds: tuple[float, ...]
    # median over rounds of (this / reference) in the same round; absent when not measured
    ratio_to: dict[str, float] = field(default_factory=dict)
    calls_per_s: float = 0.0
    server_cpu_us_per_call: float | None = None  # median over the rounds that measured it
    throughput_rounds: tuple[float, ...] = ()  # per round, in THROUGHPUT_UNIT[op]


def percentile(sorted_values: Sequence[int], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return float(sorted_values[rank - 1])


def summarize_cell(
    outcomes: Sequence[CellOutcome],
    value_bytes: int,
    blocks_per_call: int,
    server_cpu_us_per_call: float | None = None,
    *,
    op: str = "get",
) -> CellFigures:
    """Aggregate throughput over the span from the first start to the last end. A
    lookup moves no payload: its MB/s is 0 (its throughput is `calls_per_s`)."""
    span_s = max(o.ended_s for o in outcomes) - min(o.started_s for o in outcomes)
    calls = sum(o.calls for o in outcomes)
    blocks = calls * blocks_per_call
    latencies = sorted(lat for o in outcomes for lat in o.latencies_ns)
    span_s = max(span_s, 1e-9)
    return CellFigures(
        mb_per_s=0.0 if op == LOOKUP_OP else blocks * value_bytes / span_s / MB,
        p50_ms=percentile(latencies, 0.50) / 1e6,
        p99_ms=percentile(latencies, 0.99) / 1e6,
        calls=calls,
        blocks_per_s_per_client=blocks / span_s / len(outcomes),
        calls_per_s=calls / span_s,
        server_cpu_us_per_call=server_cpu_us_per_call,
    )


def _cell_key(sample: Sample) -> tuple[str, str, int, int, int]:
    return (sample.family, sample.op, sample.value_bytes, sample.clients, sample.blocks_per_call)


def aggregate(samples: Iterable[Sample]) -> list[Row]:
    """One row per cell: medians over rounds and median per-round ratios to each reference."""
    by_cell: dict[tuple[str, str, int, int, int], list[Sample]] = {}
    by_round: dict[tuple[tuple[str, str, int, int, int], int], Sample] = {}
    for sample in samples:
        by_cell.setdefault(_cell_key(sample), []).append(sample)
        by_round[(_cell_key(sample), sample.round_index)] = sample
    rows = []
    for key, cell in by_cell.items():
        _, op, value_bytes, clients, blocks_per_call = key
        ratios: dict[str, float] = {}
        for reference in REFERENCE_SYSTEMS:
            per_round = []
            for sample in cell:
                ref_key = (reference, op, value_bytes, clients, blocks_per_call)
                ref = by_round.get((ref_key, sample.round_index))
                reference_throughput = 0.0 if ref is None else ref.figures.throughput(op)
                if reference_throughput > 0:
                    per_round.append(sample.figures.throughput(op) / reference_throughput)
            if per_round:
                ratios[reference] = statistics.median(per_round)
        first = cell[0]
        rows.append(
            Row(
                system=first.system,
                op=op,
                value_bytes=value_bytes,
                clients=clients,
                blocks_per_call=blocks_per_call,
                mb_per_s=statistics.median(s.figures.mb_per_s for s in cell),
                p50_ms=statistics.median(s.figures.p50_ms for s in cell),
                p99_ms=statistics.median(s.figures.p99_ms for s in cell),
                blocks_per_s_per_client=statistics.median(
                    s.figures.blocks_per_s_per_client for s in cell
                ),
                mb_per_s_rounds=tuple(s.figures.mb_per_s for s in sorted(cell, key=_round)),
                ratio_to=ratios,
                calls_per_s=statistics.median(s.figures.calls_per_s for s in cell),
                throughput_rounds=tuple(s.figures.throughput(op) for s in sorted(cell, key=_round)),
                server_cpu_us_per_call=_median_or_none(
                    s.figures.server_cpu_us_per_call for s in cell
                ),
            )
        )
    return sorted(rows, key=_row_order)


def _median_or_none(values: Iterable[float | None]) -> float | None:
    known = [value for value in values if value is not None]
    return statistics.median(known) if known else None


def _round(sample: Sample) -> int:
    return sample.round_index


def _row_order(row: Row) -> tuple[int, str, int, int, int, str]:
    family = row.system.removesuffix(BATCH_SUFFIX)
    base = family.split("-")[0]
    rank = REFERENCE_SYSTEMS.index(base) if base in REFERENCE_SYSTEMS else len(REFERENCE_SYSTEMS)
    return (row.blocks_per_call, row.op, row.clients, row.value_bytes, rank, row.system)
