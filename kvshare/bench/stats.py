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


@dataclass(frozen=True)
class Sample:
    """One cell of one round: a system, an operation, a value size, a client count."""

    family: str  # "tcp", "kvshare-tls"...: the system without the batch suffix
    op: str  # "get" | "put"
    value_bytes: int
    clients: int
    blocks_per_call: int
    round_index: int
    figures: CellFigures

    @property
    def system(self) -> str:
        return self.family + (BATCH_SUFFIX if self.blocks_per_call > 1 else "")


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


def percentile(sorted_values: Sequence[int], fraction: float) -> float:
    """Nearest-rank percentile of already sorted values (0 for none)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return float(sorted_values[rank - 1])


def summarize_cell(
    outcomes: Sequence[CellOutcome], value_bytes: int, blocks_per_call: int
) -> CellFigures:
    """Aggregate throughput over the span from the first start to the last end."""
    span_s = max(o.ended_s for o in outcomes) - min(o.started_s for o in outcomes)
    calls = sum(o.calls for o in outcomes)
    blocks = calls * blocks_per_call
    latencies = sorted(lat for o in outcomes for lat in o.latencies_ns)
    span_s = max(span_s, 1e-9)
    return CellFigures(
        mb_per_s=blocks * value_bytes / span_s / MB,
        p50_ms=percentile(latencies, 0.50) / 1e6,
        p99_ms=percentile(latencies, 0.99) / 1e6,
        calls=calls,
        blocks_per_s_per_client=blocks / span_s / len(outcomes),
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
                if ref is not None and ref.figures.mb_per_s > 0:
                    per_round.append(sample.figures.mb_per_s / ref.figures.mb_per_s)
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
            )
        )
    return sorted(rows, key=_row_order)


def _round(sample: Sample) -> int:
    return sample.round_index


def _row_order(row: Row) -> tuple[int, str, int, int, int, str]:
    family = row.system.removesuffix(BATCH_SUFFIX)
    base = family.split("-")[0]
    rank = REFERENCE_SYSTEMS.index(base) if base in REFERENCE_SYSTEMS else len(REFERENCE_SYSTEMS)
    return (row.blocks_per_call, row.op, row.clients, row.value_bytes, rank, row.system)
