"""GPU check of the replica agent's device path: run it whenever a GPU machine is lent.

    python scripts/gpu_check.py [--out results.json] [--skip NAME ...]

Needs torch with CUDA; the server's dependencies (grpc, lmdb, cryptography) only for the
checks that start a store (they are reported as skipped where absent). Prints one JSON
document: per check `ok` and its figures. Exit status 0 when every check that ran
passed, 1 when one failed. Without a CUDA device it prints `{"status": "no_cuda", ...}`,
says so on stderr and exits 0: nothing was checked. Estimated 3-6 minutes on one
H100/H200 (not yet measured: no GPU was lent to the task that wrote it).

Checks (docs/gpu.md says what each proves):
  exactness          stalled consumer stream, reused network buffer, bf16 and fp32 blocks
  negative_control   the same with a wait removed: must come out wrong on this GPU
  concurrency        2 and 4 threads restoring different blocks through one restorer
  side_stream_save   blocks produced on a busy side stream are snapshotted as produced
  copy_ceilings      pinned/pageable H2D and D2H GB/s, timed with CUDA events
  restore_throughput RAM -> HBM through the restorer (decode, staging, copy stream)
  hf_adapter         the transformers adapter through a real store, bf16 and fp32
  save_stall         an engine-like loop's step times while the agent saves sealed blocks
  restore_bandwidth  benchmarks/restore_bandwidth.py --device cuda (content-checked)
  pytest             tests/e2e/test_gpu_restore.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's code, installed or not

Result = dict[str, Any]
BLOCKS_32MIB = {"layers": 32, "kv_heads": 8, "head_dim": 128, "block_tokens": 256}


def large_spec(dtype: str, block_tokens: int = 16) -> Any:
    from replica_agent.spec import ModelSpec

    return ModelSpec("gpu/check", "r", 32, 8, 128, dtype, block_tokens=block_tokens)


def check_exactness(rig: Any) -> Result:
    from kvshare.gpucheck.scenarios import stalled_restore
    from replica_agent.device import BlockRestorer

    runs = {}
    for dtype in ("bfloat16", "float32"):
        restorer = BlockRestorer(large_spec(dtype), "cuda", ops=rig)
        for stall_s in (0.0, 0.05):
            outcomes = [
                stalled_restore(rig, restorer, count=16, stall_s=stall_s, seed=s).as_dict()
                for s in range(3)
            ]
            runs[f"{dtype}_stall{stall_s}"] = outcomes
    ok = all(o["wrong"] == 0 and o["blocks"] == 16 for run in runs.values() for o in run)
    return {"ok": ok, "runs": runs}


def check_negative_control(rig: Any) -> Result:
    from kvshare.gpucheck.scenarios import WaitsDropped, stalled_restore
    from replica_agent.device import BlockRestorer

    spec = large_spec("bfloat16")
    no_slot_wait = BlockRestorer(spec, "cuda", ops=WaitsDropped(rig, "synchronize"))
    no_stream_wait = BlockRestorer(spec, "cuda", ops=WaitsDropped(rig, "wait"))
    staging = stalled_restore(rig, no_slot_wait, count=16, stall_s=0.05).as_dict()
    stream = stalled_restore(rig, no_stream_wait, count=16, stall_s=0.0).as_dict()
    # The staging wait is what the concurrency fix also relies on: it must be visible.
    return {
        "ok": staging["wrong"] > 0,
        "without_staging_wait": staging,
        "without_stream_waits": stream,
    }


def check_concurrency(rig: Any) -> Result:
    from kvshare.gpucheck.scenarios import concurrent_restores
    from replica_agent.device import BlockRestorer

    restorer = BlockRestorer(large_spec("bfloat16"), "cuda", ops=rig)
    runs = {
        f"{threads}_threads": [
            [o.as_dict() for o in concurrent_restores(rig, restorer, threads=threads, stall_s=0.02)]
            for _ in range(3)
        ]
        for threads in (2, 4)
    }
    flat = [o for run in runs.values() for outcomes in run for o in outcomes]
    return {"ok": all(o["wrong"] == 0 and o["blocks"] == 8 for o in flat), "runs": runs}


def check_side_stream_save(rig: Any) -> Result:
    from kvshare.gpucheck.scenarios import WaitsDropped, side_stream_snapshot

    ordered = side_stream_snapshot(rig, rig, rig.device, count=8, stall_s=0.05).as_dict()
    unordered = side_stream_snapshot(
        rig, WaitsDropped(rig, "wait"), rig.device, count=8, stall_s=0.05
    ).as_dict()
    return {
        "ok": ordered["wrong"] == 0 and unordered["wrong"] > 0,
        "ordered": ordered,
        "negative_control_without_producer_wait": unordered,
    }


def _event_gbps(nbytes: int, copy: Callable[[], None], rounds: int = 5) -> float:
    import torch

    copy()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return round(nbytes / statistics.median(times) / 1e9, 2)


def check_copy_ceilings(rig: Any) -> Result:
    import torch

    nbytes = 256 << 20
    device = torch.empty(nbytes, dtype=torch.uint8, device=rig.device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    figures = {
        "h2d_pinned_gb_per_s": _event_gbps(nbytes, lambda: device.copy_(pinned, non_blocking=True)),
        "h2d_pageable_gb_per_s": _event_gbps(nbytes, lambda: device.copy_(pageable)),
        "d2h_pinned_gb_per_s": _event_gbps(nbytes, lambda: pinned.copy_(device, non_blocking=True)),
        "d2h_pageable_gb_per_s": _event_gbps(nbytes, lambda: pageable.copy_(device)),
    }
    return {"ok": True, "bytes": nbytes, **figures}


def check_restore_throughput(rig: Any) -> Result:
    import torch

    from kvshare.gpucheck.scenarios import blocks_of
    from replica_agent.codec import encode_block
    from replica_agent.device import BlockRestorer

    spec = large_spec("bfloat16", BLOCKS_32MIB["block_tokens"])
    count = 32
    blocks = blocks_of(spec, count, seed=1)
    payloads = [encode_block(spec, b) for b in blocks]
    restorer = BlockRestorer(spec, "cuda", ops=rig)
    timings = []
    for round_index in range(4):  # the first is a warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        out, restored = restorer.restore(iter(payloads), count)
        torch.cuda.current_stream(rig.device).synchronize()
        if round_index:
            timings.append(time.perf_counter() - started)
        exact = restored.blocks == count and all(
            torch.equal(g, w) for g, w in zip(out.cpu(), blocks, strict=True)
        )
        if not exact:
            return {"ok": False, "error": "restored blocks differ from their payloads"}
    total = count * spec.block_payload_bytes
    return {
        "ok": True,
        "blocks": count,
        "block_bytes": spec.block_payload_bytes,
        "gb_per_s": round(total / statistics.median(timings) / 1e9, 2),
    }


def check_hf_adapter(rig: Any) -> Result:
    from kvshare.gpucheck.hf_roundtrip import restored_matches_recompute

    runs = [restored_matches_recompute(dtype, str(rig.device)) for dtype in ("float32", "bfloat16")]
    ok = all(r["blocks"] == r["asked"] and r["tokens_equal"] for r in runs)
    return {"ok": ok, "runs": runs}


def check_save_stall(rig: Any) -> Result:
    from kvshare.gpucheck.save_stall import engine_loop_with_saves

    return engine_loop_with_saves(rig.device)


def check_restore_bandwidth(rig: Any) -> Result:
    command = [
        sys.executable,
        str(REPO / "benchmarks" / "restore_bandwidth.py"),
        "--device",
        str(rig.device),
        "--blocks",
        "16",
        "--rounds",
        "3",
        "--json",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        return {"ok": False, "error": done.stderr.strip()[-2000:]}
    return {"ok": True, **json.loads(done.stdout.strip().splitlines()[-1])}


def check_pytest(rig: Any) -> Result:
    command = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-rs",
        "--confcutdir",
        "tests/e2e",
        "tests/e2e/test_gpu_restore.py",
    ]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    return {"ok": done.returncode == 0, "summary": done.stdout.strip().splitlines()[-8:]}


NEEDS_SERVER = {"hf_adapter", "save_stall", "restore_bandwidth"}
CHECKS: dict[str, Callable[[Any], Result]] = {
    "exactness": check_exactness,
    "negative_control": check_negative_control,
    "concurrency": check_concurrency,
    "side_stream_save": check_side_stream_save,
    "copy_ceilings": check_copy_ceilings,
    "restore_throughput": check_restore_throughput,
    "hf_adapter": check_hf_adapter,
    "save_stall": check_save_stall,
    "restore_bandwidth": check_restore_bandwidth,
    "pytest": check_pytest,
}


def server_importable() -> str | None:
    try:
        import cacheserver.embedded  # noqa: F401
        import policy.sealing  # noqa: F401
    except ImportError as error:
        return f"the server's dependencies are absent ({error})"
    return None


def run(skip: set[str]) -> tuple[Result, int]:
    import torch

    from kvshare.gpucheck.scenarios import CudaRig

    rig = CudaRig("cuda")
    results: Result = {
        "status": "passed",
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": torch.cuda.get_device_name(rig.device),
        "checks": {},
    }
    missing_server = server_importable()
    for name, check in CHECKS.items():
        if name in skip or (name in NEEDS_SERVER and missing_server):
            results["checks"][name] = {"skipped": "asked" if name in skip else missing_server}
            continue
        started = time.perf_counter()
        try:
            outcome = check(rig)
        except Exception as error:  # one failing check must not hide the others
            outcome = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        outcome["seconds"] = round(time.perf_counter() - started, 1)
        results["checks"][name] = outcome
        print(f"{name}: {'ok' if outcome.get('ok') else 'FAILED'}", file=sys.stderr)
    failed = [n for n, r in results["checks"].items() if "skipped" not in r and not r.get("ok")]
    results["status"] = "failed" if failed else "passed"
    return results, 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--out", type=Path, help="also write the JSON here")
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(CHECKS), metavar="NAME")
    args = parser.parse_args()
    try:
        import torch
    except ImportError:
        torch = None  # type: ignore[assignment]
    if torch is None or not torch.cuda.is_available():
        why = "torch is not installed" if torch is None else "torch sees no CUDA device"
        results: Result = {"status": "no_cuda", "message": f"{why}: nothing was checked"}
        print(f"gpu_check: {why}; run this on a machine with a CUDA GPU", file=sys.stderr)
        code = 0
    else:
        results, code = run(set(args.skip))
    text = json.dumps(results, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
