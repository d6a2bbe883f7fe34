"""Medians over rounds and ratios within a round (kvshare.bench.stats)."""

from __future__ import annotations

import pytest

from kvshare.bench.stats import (
    LOOKUP_OP,
    CellFigures,
    CellOutcome,
    Sample,
    aggregate,
    percentile,
    summarize_cell,
)


def _sample(family: str, mb_per_s: float, round_index: int, *, blocks: int = 1) -> Sample:
    figures = CellFigures(mb_per_s, 1.0, 2.0, 10, 5.0)
    return Sample(family, "get", 2 << 20, 1, blocks, round_index, figures)


def test_percentile_is_nearest_rank() -> None:
    values = list(range(1, 101))
    assert percentile(values, 0.50) == 50
    assert percentile(values, 0.99) == 99
    assert percentile([7], 0.99) == 7
    assert percentile([], 0.5) == 0.0


def test_summarize_cell_spans_first_start_to_last_end() -> None:
    outcomes = [
        CellOutcome(10.0, 11.0, 4, (1_000_000,) * 4),
        CellOutcome(10.5, 12.0, 4, (3_000_000,) * 4),
    ]
    figures = summarize_cell(outcomes, value_bytes=1_000_000, blocks_per_call=2)
    # 8 calls x 2 blocks x 1 MB over 2 s
    assert figures.mb_per_s == pytest.approx(8.0)
    assert figures.blocks_per_s_per_client == pytest.approx(8 * 2 / 2.0 / 2)
    assert figures.p50_ms == pytest.approx(1.0)
    assert figures.p99_ms == pytest.approx(3.0)
    assert figures.calls == 8


def test_ratio_is_median_of_per_round_ratios_not_ratio_of_medians() -> None:
    # Rounds drift together: kvshare is exactly half of tcp in every round.
    samples = [
        _sample("tcp", 1000, 0),
        _sample("kvshare", 500, 0),
        _sample("tcp", 3000, 1),
        _sample("kvshare", 1500, 1),
        _sample("tcp", 2000, 2),
        _sample("kvshare", 1000, 2),
    ]
    rows = {row.system: row for row in aggregate(samples)}
    assert rows["kvshare"].ratio_to["tcp"] == pytest.approx(0.5)
    assert rows["kvshare"].mb_per_s == pytest.approx(1000)
    assert rows["kvshare"].mb_per_s_rounds == (500, 1500, 1000)
    assert rows["tcp"].ratio_to["kvshare"] == pytest.approx(2.0)
    assert "redis" not in rows["kvshare"].ratio_to


def test_a_ratio_needs_the_reference_in_the_same_round() -> None:
    samples = [_sample("tcp", 1000, 0), _sample("kvshare", 500, 1)]
    rows = {row.system: row for row in aggregate(samples)}
    assert "tcp" not in rows["kvshare"].ratio_to


def test_batch_rows_compare_with_batch_rows_only() -> None:
    samples = [
        _sample("tcp", 1000, 0),
        _sample("tcp", 4000, 0, blocks=64),
        _sample("kvshare", 2000, 0, blocks=64),
    ]
    rows = {row.system: row for row in aggregate(samples)}
    assert set(rows) == {"tcp", "tcp-batch", "kvshare-batch"}
    assert rows["kvshare-batch"].ratio_to["tcp"] == pytest.approx(0.5)


def test_rows_are_ordered_by_op_clients_size_then_system() -> None:
    samples = [_sample("kvshare", 1, 0), _sample("redis", 1, 0), _sample("tcp", 1, 0)]
    assert [row.system for row in aggregate(samples)] == ["tcp", "redis", "kvshare"]


def _lookup(family: str, calls_per_s: float, round_index: int, cpu: float | None) -> Sample:
    figures = CellFigures(0.0, 1.0, 2.0, 10, 0.0, calls_per_s, cpu)
    return Sample(family, LOOKUP_OP, 64 << 10, 1, 64, round_index, figures)


def test_lookup_rows_keep_the_name_and_compare_calls_per_second() -> None:
    samples = [
        _lookup("tcp", 10_000, 0, 40.0),
        _lookup("kvshare", 1_000, 0, 900.0),
        _lookup("tcp", 20_000, 1, None),
        _lookup("kvshare", 4_000, 1, 1100.0),
    ]
    rows = {row.system: row for row in aggregate(samples)}
    assert set(rows) == {"tcp", "kvshare"}  # 64 digests per call, yet no "-batch"
    assert rows["kvshare"].ratio_to["tcp"] == pytest.approx(0.15)  # median of 0.1, 0.2
    assert rows["kvshare"].throughput_rounds == (1_000, 4_000)
    assert rows["kvshare"].mb_per_s == 0.0
    assert rows["kvshare"].server_cpu_us_per_call == pytest.approx(1000.0)
    assert rows["tcp"].server_cpu_us_per_call == pytest.approx(40.0)  # rounds without: left out


def test_a_lookup_cell_moves_no_megabytes() -> None:
    outcomes = [CellOutcome(0.0, 2.0, 10, (1_000_000,) * 10)]
    figures = summarize_cell(outcomes, 64 << 10, 64, 12.5, op=LOOKUP_OP)
    assert figures.mb_per_s == 0.0 and figures.calls_per_s == pytest.approx(5.0)
    assert figures.server_cpu_us_per_call == 12.5
