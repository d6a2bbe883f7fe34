"""scripts/gpu_check.py without a GPU: it says so and exits cleanly, and its restore,
concurrency and snapshot checks (the glue around the scenarios) pass on the simulated
copy engine, so the first run on a lent GPU does not fail on a bug of its own."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvshare.gpucheck.save_stall import engine_loop_with_saves
from kvshare.gpucheck.scenarios import SMALL
from tests.support.repo import REPO
from tests.support.simcuda import SimCuda

SCRIPT = REPO / "scripts" / "gpu_check.py"


@pytest.fixture(scope="module")
def gpu_check() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def sim() -> Iterator[SimCuda]:
    engine = SimCuda()
    yield engine
    engine.close()


@pytest.mark.slow
def test_without_cuda_it_says_so_and_exits_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "no CUDA device" in done.stderr and "Traceback" not in done.stderr
    result = json.loads(done.stdout)
    assert result["status"] == "no_cuda" and "nothing was checked" in result["message"]
    assert json.loads(out.read_text()) == result


@pytest.mark.slow
@pytest.mark.parametrize(
    "name", ["exactness", "negative_control", "concurrency", "side_stream_save"]
)
def test_the_checks_pass_on_the_simulated_copy_engine(
    gpu_check: ModuleType, sim: SimCuda, name: str
) -> None:
    result = gpu_check.CHECKS[name](sim)
    assert result["ok"], result


def test_the_save_stall_measure_runs(tmp_path: Path) -> None:
    result = engine_loop_with_saves("cpu", spec=SMALL, matrix=64, steps=40, save_every=5)
    assert result["ok"] and result["blocks_saved"] > 0, result
    assert set(result["with_saves"]) == {"p50_ms", "p99_ms", "max_ms"}
