"""TTFT on vLLM with and without the shared store, in every load mode, in one run.

    .venv-vllm/bin/python benchmarks/vllm_ttft.py [--replicas 4] [--requests 72] [--itl] [--json]

The demo's workload (`kvshare demo --engine vllm`: tenants' chats and agent loops
behind round robin, the demo's random-weight Llama on vLLM's CPU backend, sealed
store blocks of 128 tokens) served by N engines, in these runs:

- `local_only`: requests carry no tenant, so the connector stays out of every one;
  each engine has only vLLM's own prefix cache.
- `shared_<mode>` for each `load_mode` (`auto`, the default, then `sync` and
  `async`): N fresh engines with that mode and a fresh store, the same requests
  with their tenants, so each engine loads what the others saved.

Reported per run: TTFT p50/p95 (vLLM's arrival-to-first-token), hit rates and prefill
tokens (the demo's summary), and for the shared runs the ratio of local-only TTFT to
it (above 1: the store lowers TTFT) and the median time of each stage of a load after
the request was submitted (replica_agent/adapters/vllm_trace.py: looked up, allocated,
queued, load started and finished, reported, scheduled, first token), over the
requests that loaded. Every run must produce the same greedy tokens, or the benchmark
exits 1. `--itl` also runs benchmarks/vllm_async.py's measurement (a decoding request's
inter-token latency while another request's prefix loads, per mode) and adds it as
`co_running_itl`. `--forget-local` empties each engine's own prefix cache before every
request, so every hit comes from the store (with `--replicas 1`: one engine, its loads
alone). `--json` prints one object:
{"replicas", "requests", "forget_local", "runs": {name: summary}, "ttft_p50_ratio": {mode: x},
 "timelines": {mode: {stage: ms}}, "outputs_identical", "co_running_itl"?}.
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshare.demo.runner import RunReport, demo_tenants
from kvshare.demo.vllm_engine import DEMO_MODEL, EngineProcess, write_tiny_llama
from kvshare.demo.vllm_runner import run_round_robin, start_store
from kvshare.demo.workload import DemoRequest, WorkloadShape, build_workload

MODES = ("auto", "sync", "async")
STAGES = (
    "looked_up",
    "allocated",
    "queued",
    "load_started",
    "load_finished",
    "reported",
    "scheduled",
    "first_token",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4, help="engines per run")
    parser.add_argument("--requests", type=int, default=72, help="requests per run")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument("--modes", default=",".join(MODES), help="load modes to run")
    parser.add_argument(
        "--forget-local",
        action="store_true",
        help="empty each engine's own cache before every request (hits: the store's only)",
    )
    parser.add_argument("--itl", action="store_true", help="also run vllm_async --quick")
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    return parser.parse_args(argv)


def stage_medians(timelines: list[dict[str, float]]) -> dict[str, float]:
    """Each stage's median ms after submission, over the requests that reached it."""
    medians = {}
    for stage in STAGES:
        times = [timeline[stage] for timeline in timelines if stage in timeline]
        if times:
            medians[stage] = round(statistics.median(times), 1)
    return medians


def run_mode(
    directory: Path,
    model_dir: Path,
    tenants: list[str],
    requests: list[DemoRequest],
    args: argparse.Namespace,
    mode: str | None,
) -> tuple[RunReport, list[dict[str, float]]]:
    """`mode` None: the local-only run; else the shared run in that load mode, on
    fresh engines and a fresh store."""
    server, connector = start_store(directory, tenants, seal=True)
    if mode is not None:
        connector["load_mode"] = mode
    engines = [EngineProcess(model_dir, connector) for _ in range(args.replicas)]
    timelines: list[dict[str, float]] = []
    try:
        name = "local_only" if mode is None else f"shared_{mode}"
        report = run_round_robin(
            engines, name, requests, timelines=timelines, forget_local=args.forget_local
        )
    finally:
        for engine in engines:
            engine.close()
        server.stop()
    return report, timelines


def measure(args: argparse.Namespace, directory: Path) -> dict[str, Any]:
    shape = WorkloadShape(vocab_size=DEMO_MODEL["vocab_size"])
    requests = build_workload(args.requests, shape, args.seed)
    tenants = demo_tenants(shape)
    model_dir = write_tiny_llama(directory / "model", args.seed, DEMO_MODEL)
    modes = [mode for mode in args.modes.split(",") if mode]
    reports: dict[str, RunReport] = {}
    timelines: dict[str, dict[str, float]] = {}
    for mode in [None, *modes]:
        run_dir = directory / (mode or "local")
        run_dir.mkdir()
        report, marks = run_mode(run_dir, model_dir, tenants, requests, args, mode)
        reports[report.name] = report
        if mode is not None:
            timelines[mode] = stage_medians(marks)
        print(f"vllm_ttft: {report.name} done", file=sys.stderr)
    summaries = {name: report.summary() for name, report in reports.items()}
    local_p50 = summaries["local_only"]["ttft_p50_s"]
    outputs = {tuple(tuple(r.output_tokens) for r in report.results) for report in reports.values()}
    return {
        "replicas": args.replicas,
        "requests": args.requests,
        "forget_local": args.forget_local,
        "runs": summaries,
        "ttft_p50_ratio": {
            mode: round(local_p50 / summaries[f"shared_{mode}"]["ttft_p50_s"], 2) for mode in modes
        },
        "timelines": timelines,
        "outputs_identical": len(outputs) == 1,
    }


def co_running_itl() -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    vllm_async = importlib.import_module("vllm_async")  # the script beside this one
    args = vllm_async.parse_args(["--quick"])
    with tempfile.TemporaryDirectory(prefix="kvshare-vllm-itl-") as tmp:
        figures: dict[str, Any] = vllm_async.measure(args, Path(tmp))
    figures.pop("alone", None)
    return figures


def print_table(figures: dict[str, Any]) -> None:
    runs = figures["runs"]
    print(f"{'run':14} {'TTFT p50':>9} {'TTFT p95':>9} {'hit rate':>9} {'prefill':>8}  ratio")
    for name, run in runs.items():
        mode = name.removeprefix("shared_")
        ratio = figures["ttft_p50_ratio"].get(mode)
        print(
            f"{name:14} {run['ttft_p50_s'] * 1e3:7.0f}ms {run['ttft_p95_s'] * 1e3:7.0f}ms"
            f" {run['token_hit_rate']:9.1%} {run['prefill_tokens']:8,}"
            f"  {f'{ratio:.2f}x lower' if ratio else '-'}"
        )
    for mode, stages in figures["timelines"].items():
        cells = "  ".join(f"{stage} {ms:.0f}" for stage, ms in stages.items())
        print(f"timeline {mode:6} (median ms after submission): {cells}")
    print(f"outputs identical: {'yes' if figures['outputs_identical'] else 'NO'}")
    for name, row in figures.get("co_running_itl", {}).items():
        print(f"co-running ITL {name:8} " + "  ".join(f"{k} {v}" for k, v in row.items()))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="kvshare-vllm-ttft-") as tmp:
        figures = measure(args, Path(tmp))
    if args.itl:
        figures["co_running_itl"] = co_running_itl()
    if args.json:
        print(json.dumps(figures))
    else:
        print_table(figures)
    return 0 if figures["outputs_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
