"""`kvshare simulate` end to end: every JSON counter on a hand-computed trace, and errors.

The trace is the one in test_simulate_engine.py (block_tokens 4, 46 input tokens),
written as Mooncake JSON lines with millisecond timestamps.
"""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvshare.cli import main
from kvshare.simulate.engine import SimConfig
from kvshare.simulate.sweep import run_sweep
from kvshare.simulate.timing import TimeModel
from kvshare.simulate.trace import Request

ROWS = [
    {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 1000, "input_length": 10, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 2000, "input_length": 8, "output_length": 1, "hash_ids": [1, 2]},
    {"timestamp": 3000, "input_length": 12, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 4000, "input_length": 6, "output_length": 1, "hash_ids": [5, 6]},
]
SLOW_FLAGS = [
    "--block-tokens", "4",
    "--prefill-tokens-per-s", "2",
    "--kv-bytes-per-token", "500000000",
    "--restore-gb-per-s", "1",
    "--restore-latency-ms", "250",
]  # fmt: skip


@pytest.fixture
def trace(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    return path


def _simulate(capsys: pytest.CaptureFixture[str], *flags: str) -> tuple[int, str, str]:
    code = main(["simulate", *flags])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def _common(shared_store: bool) -> dict[str, object]:
    return {
        "policy": "round_robin",
        "replicas": 2,
        "shared_store": shared_store,
        "scenario": "static",
        "requests": 5,
        "input_tokens": 46,
        "local_hit_tokens": 16,
        "local_hit_rate": 16 / 46,
        "load_max_over_mean": 24 / 23,
        "replicas_started": 2,
        "replica_capacity_tokens": 0,
        "store_capacity_tokens": 0,
        "ttft_p50_s": 5.0,
    }


def test_json_pins_every_counter(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _simulate(
        capsys, "--trace", str(trace), "--replicas", "2", "--policies", "round_robin",
        *SLOW_FLAGS, "--json",
    )  # fmt: skip
    assert (code, err) == (0, "")
    report = json.loads(out)
    local_only = _common(False) | {
        "token_hit_rate": 16 / 46, "store_hit_rate": 0.0, "fraction_of_ideal": 16 / 26,
        "reused_tokens": 16, "store_hit_tokens": 0, "prefill_tokens": 30,
        "prefill_gpu_s": 15.0, "restore_s": 0.0, "ttft_p99_s": 5.0,
    }  # fmt: skip
    with_store = _common(True) | {
        "token_hit_rate": 26 / 46, "store_hit_rate": 10 / 46, "fraction_of_ideal": 1.0,
        "reused_tokens": 26, "store_hit_tokens": 10, "prefill_tokens": 20,
        "prefill_gpu_s": 10.0, "restore_s": 5.25, "ttft_p99_s": 5.25,
    }  # fmt: skip
    assert report["results"] == [pytest.approx(local_only), pytest.approx(with_store)]
    assert report["ideal_token_hit_rate"] == 26 / 46
    assert report["time_model"] == pytest.approx(
        {
            "preset": "llama-3-8b-h100",
            "prefill_tokens_per_s": 2.0,
            "kv_bytes_per_token": 500_000_000,
            "restore_gb_per_s": 1.0,
            "restore_latency_ms": 250.0,
            "break_even_restore_gb_per_s": 1.0,
        }
    )
    assert (report["trace"], report["block_tokens"], report["scenario"]) == (
        str(trace),
        4,
        "static",
    )


def test_capacities_round_down_to_whole_blocks(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, _ = _simulate(
        capsys, "--trace", str(trace), "--replicas", "1", "--policies", "round_robin",
        "--shared-store", "on", "--replica-capacity-tokens", "10",
        "--store-capacity-tokens", "8", *SLOW_FLAGS, "--json",
    )  # fmt: skip
    assert code == 0
    (entry,) = json.loads(out)["results"]
    assert (entry["replica_capacity_tokens"], entry["store_capacity_tokens"]) == (8, 8)
    # Both caches hold 2 blocks: as in test_bounded_local_cache_is_lru_over_blocks.
    assert (entry["local_hit_tokens"], entry["store_hit_tokens"]) == (8, 0)


def test_sweep_order_and_table(trace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _simulate(
        capsys, "--trace", str(trace), "--replicas", "1,2", "--policies", "random,cache_aware",
        *SLOW_FLAGS,
    )  # fmt: skip
    assert code == 0
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["policy", "replicas", "store"]
    assert [line.split()[:3] for line in lines[1:9]] == [
        [policy, replicas, store]
        for replicas in ("1", "2")
        for policy in ("random", "cache_aware")
        for store in ("no", "yes")
    ]
    assert lines[-1] == "ideal (one unbounded cache): 56.5% token hit rate"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ([], "--trace is required"),
        (["--trace", "{missing}"], "does not exist; pass --trace"),
        (["--trace", "{bad}"], "bad.jsonl:2: not valid JSON"),
        (["--policies", "round_robin,least_loaded"], "unknown policy 'least_loaded'; choose from"),
        (["--replicas", "1,x"], "'x' is not a positive integer"),
        (["--replicas", "0"], "'0' is not a positive integer"),
        (["--replicas", ""], "give a comma-separated list"),
        (["--replica-capacity-tokens", "3"], "holds no 4-token block"),
        (["--seed", "abc"], "--seed 'abc' is not an integer"),
        (["--restore-gb-per-s", "0"], "give a finite number above 0"),
        (["--preset", "gpt-5-tpu"], "--preset 'gpt-5-tpu' is unknown"),
        (["--scenario", "flood"], "unknown scenario 'flood'"),
        (["--shared-store", "maybe"], "use one of both, on, off"),
        (["--plot", "{nodir}"], "cannot write plot"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    trace: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    flags: list[str],
    message: str,
) -> None:
    (tmp_path / "bad.jsonl").write_text(json.dumps(ROWS[0]) + "\n{oops\n", encoding="utf-8")
    names = {
        "{missing}": str(tmp_path / "missing.jsonl"),
        "{bad}": str(tmp_path / "bad.jsonl"),
        "{nodir}": str(tmp_path / "no" / "such" / "dir.png"),
    }
    flags = [names.get(flag, flag) for flag in flags]
    if flags and flags[0] != "--trace":
        flags = ["--trace", str(trace), "--block-tokens", "4", *flags]
    code, out, err = _simulate(capsys, *flags)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert err.startswith("kvshare simulate: ")
    assert message in err


def test_plot_writes_a_png(trace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "plot.png"
    code, _, _ = _simulate(capsys, "--trace", str(trace), "--replicas", "1,2", *SLOW_FLAGS,
                           "--plot", str(target))  # fmt: skip
    assert code == 0
    assert target.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_building_the_parser_does_not_import_matplotlib() -> None:
    probe = (
        "import sys, kvshare.cli; kvshare.cli.build_parser(); print('matplotlib' in sys.modules)"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "False"


def test_progress_bar_counts_configurations() -> None:
    model = TimeModel(2.0, 1, 1.0, 0.0)
    configs = [SimConfig("round_robin", n, False, 4, None, None, model) for n in (1, 2, 3, 4)]
    stream = io.StringIO()
    results = run_sweep([Request(0.0, 4, 0, (1,))], configs, show_progress=True, stream=stream)
    assert len(results) == 4
    assert "4/4" in stream.getvalue()
    assert stream.getvalue().endswith("\n")
    quiet = io.StringIO()
    run_sweep([Request(0.0, 4, 0, (1,))], configs, show_progress=False, stream=quiet)
    assert quiet.getvalue() == ""


SMALL_PUBLIC_PREFIX = [
    "--workload", "public-prefix", "--tenants", "3", "--public-tokens", "42",
    "--system-tokens", "10", "--conversations", "2", "--turns", "3", "--turn-tokens", "8",
    "--replicas", "2", "--block-tokens", "4", "--kv-bytes-per-token", "1000",
]  # fmt: skip


def test_public_prefix_json_compares_without_and_with_the_public_scope(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _simulate(capsys, *SMALL_PUBLIC_PREFIX, "--json")
    assert (code, err) == (0, "")
    report = json.loads(out)
    without, with_public = report["without_public"], report["with_public"]
    for run in (without, with_public):
        assert {"stored_bytes", "prefill_tokens", "hit_rate"} <= run.keys()
        assert run["stored_bytes"] == run["stored_blocks"] * 4 * 1000
        assert run["hit_rate"] == run["token_hit_rate"]
    # 10 whole 4-token blocks of P, stored by each of 3 tenants or once in @public.
    assert (without["public_prefix_blocks"], with_public["public_prefix_blocks"]) == (30, 10)
    assert without["private_blocks"] == with_public["private_blocks"]
    assert report["stored_bytes_saved"] == 2 * 10 * 4 * 1000
    assert report["stored_bytes_ratio"] == with_public["stored_bytes"] / without["stored_bytes"]
    assert report["prefill_tokens_ratio"] == pytest.approx(
        with_public["prefill_tokens"] / without["prefill_tokens"]
    )
    assert (with_public["published_blocks"], with_public["publish_prefill_tokens"]) == (10, 40)
    assert (report["policy"], report["replicas"], report["tenants"]) == ("round_robin", 2, 3)
    assert report["time_model"]["kv_bytes_per_token"] == 1000


def test_public_prefix_table_shows_the_json_figures(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _simulate(capsys, *SMALL_PUBLIC_PREFIX)
    assert code == 0
    report = json.loads(_simulate(capsys, *SMALL_PUBLIC_PREFIX, "--json")[1])
    rows = {line.split("  ")[0]: line.split() for line in out.splitlines()}
    for name, key in (("without public", "without_public"), ("with public", "with_public")):
        run = report[key]
        keys = ("stored_blocks", "public_prefix_blocks", "private_blocks")
        assert rows[name][2:5] == [str(run[k]) for k in keys]
        assert rows[name][6] == f"{run['prefill_tokens']:,}"
    assert "publisher prefilled P's 10 blocks once (40 tokens" in out


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--workload", "public"], "--workload 'public' is unknown; choose one of trace"),
        (["--trace", "t.jsonl"], "--trace does not apply to --workload public-prefix"),
        (["--replicas", "2,4"], "--replicas '2,4' is not an integer"),
        (["--policies", "random,round_robin"], "runs one policy; give one"),
        (["--shared-store", "both"], "--shared-store (both runs use the store) does not apply"),
        (["--store-capacity-tokens", "400"], "--store-capacity-tokens (the store is unbounded)"),
        (["--scenario", "churn"], "--scenario does not apply"),
        (["--tenants", "0"], "--tenants 0 is below 1"),
    ],
)
def test_public_prefix_bad_input_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    code, out, err = _simulate(capsys, *SMALL_PUBLIC_PREFIX, *flags)
    assert (code, out) == (2, "")
    assert err.count("\n") == 1
    assert message in err


def test_public_prefix_flags_are_refused_when_replaying_a_trace(
    trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _simulate(capsys, "--trace", str(trace), "--tenants", "4")
    assert code == 2
    assert "--tenants applies to --workload public-prefix only" in err
