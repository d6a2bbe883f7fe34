"""Interleaved rounds: every system runs all its cells once per round, in rotating order.

Only one system's server runs at a time, so peers never compete for the two cores or
for memory, and each server is started fresh every round (LMCache's server and
kvshare's dev store cannot drop values, so a fresh start bounds their memory). Within
a system, a PUT cell writes the values its GET cell then reads back; a lookup cell
asks, one call at a time, whether `lookup_blocks` blocks a client just wrote are held.
Around each cell's timed part the harness reads the server's CPU time
(kvshare.bench.cpu), so a row says what one call cost the server as well as the client.
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from kvshare.bench.config import BATCH_BLOCK_BYTES, BenchConfig, format_size
from kvshare.bench.cpu import cpu_seconds, per_call_us
from kvshare.bench.peers.base import BenchError, System
from kvshare.bench.placement import LOOPBACK, Placement
from kvshare.bench.stats import LOOKUP_OP, Sample, summarize_cell
from kvshare.bench.worker import CellPlan, WorkerPool

GET_MAX_CALLS = 1_000_000  # GET cells are bounded by time; this only guards a runaway


@dataclass
class RunOutcome:
    samples: list[Sample] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # system -> why it did not run
    failed: dict[str, str] = field(default_factory=dict)  # system -> first error
    elapsed_s: float = 0.0


class Progress:
    """One line per step on stderr, so stdout stays for the table or the JSON."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self._stream = stream if stream is not None else sys.stderr
        self._started = time.monotonic()

    def say(self, text: str) -> None:
        elapsed = time.monotonic() - self._started
        print(f"[{elapsed:6.1f}s] {text}", file=self._stream, flush=True)


def run_benchmark(
    config: BenchConfig, systems: Sequence[System], progress: Progress, at: Placement = LOOPBACK
) -> RunOutcome:
    """Every system's cells, round by round; clients run where `at` puts them."""
    outcome = RunOutcome()
    started = time.monotonic()
    runnable = []
    for system in systems:
        reason = system.unavailable_reason()
        if reason is None:
            runnable.append(system)
        else:
            outcome.skipped[system.name] = reason
            progress.say(f"skipping {system.name}: {reason}")
    with _workdir(config.workdir) as workdir:
        for round_index in range(config.rounds):
            shift = round_index % max(1, len(runnable))
            for system in runnable[shift:] + runnable[:shift]:
                if system.name in outcome.failed:
                    continue
                label = f"round {round_index + 1}/{config.rounds} {system.name}"
                round_dir = workdir / f"round{round_index + 1}"
                round_dir.mkdir(parents=True, exist_ok=True)
                try:
                    _run_system_round(
                        system, config, round_index, round_dir, progress, label, outcome.samples, at
                    )
                except BenchError as error:
                    outcome.failed[system.name] = str(error)
                    progress.say(f"{label}: FAILED: {error}")
    outcome.elapsed_s = time.monotonic() - started
    return outcome


@contextlib.contextmanager
def _workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="kvshare-bench-") as temporary:
        yield Path(temporary)


def _run_system_round(
    system: System,
    config: BenchConfig,
    round_index: int,
    round_dir: Path,
    progress: Progress,
    label: str,
    samples: list[Sample],
    at: Placement,
) -> None:
    progress.say(f"{label}: starting server")
    spec = system.start(round_dir)
    try:
        for clients in config.client_counts:
            with WorkerPool(spec, clients, at.client_namespace) as pool:
                for value_bytes in config.sizes:
                    put_calls = max(
                        config.min_calls_per_cell, config.put_bytes_per_client // value_bytes
                    )
                    system.reserve(value_bytes, clients * put_calls)
                    for plan in (
                        _plan(config, "put", value_bytes, 1, put_calls),
                        _plan(config, "get", value_bytes, 1, GET_MAX_CALLS),
                    ):
                        samples.append(
                            _run_cell(pool, plan, system, clients, round_index, progress, label)
                        )
                    if system.clear():
                        pool.forget()
                if config.batch_blocks > 1 and system.supports_batch_get:
                    plan = _plan(
                        config, "get", BATCH_BLOCK_BYTES, config.batch_blocks, GET_MAX_CALLS
                    )
                    samples.append(
                        _run_cell(pool, plan, system, clients, round_index, progress, label)
                    )
                    if system.clear():
                        pool.forget()
                if config.lookup_blocks > 0 and system.supports_lookup:
                    plan = _plan(
                        config, LOOKUP_OP, BATCH_BLOCK_BYTES, config.lookup_blocks, GET_MAX_CALLS
                    )
                    samples.append(
                        _run_cell(pool, plan, system, clients, round_index, progress, label)
                    )
                    if system.clear():
                        pool.forget()
    finally:
        system.stop()


def _plan(config: BenchConfig, op: str, value_bytes: int, blocks: int, max_calls: int) -> CellPlan:
    return CellPlan(
        op=op,
        value_bytes=value_bytes,
        blocks_per_call=blocks,
        max_calls=max_calls,
        max_seconds=config.seconds_per_cell,
        min_calls=config.min_calls_per_cell,
    )


def _run_cell(
    pool: WorkerPool,
    plan: CellPlan,
    system: System,
    clients: int,
    round_index: int,
    progress: Progress,
    label: str,
) -> Sample:
    """One cell: untimed set-up, then the timed part with the server's CPU read around it."""
    pool.prepare_cell(plan)
    pids = system.server_pids()
    cpu_before_s = cpu_seconds(pids)
    outcomes = pool.time_cell(plan)
    cpu_after_s = cpu_seconds(pids)
    calls = sum(outcome.calls for outcome in outcomes)
    figures = summarize_cell(
        outcomes,
        plan.value_bytes,
        plan.blocks_per_call,
        per_call_us(cpu_before_s, cpu_after_s, calls),
        op=plan.op,
    )
    sample = Sample(
        system.name, plan.op, plan.value_bytes, clients, plan.blocks_per_call, round_index, figures
    )
    batch = f" x{plan.blocks_per_call} blocks" if plan.blocks_per_call > 1 else ""
    rate = (
        f"{figures.calls_per_s:,.0f} calls/s"
        if plan.op == LOOKUP_OP
        else f"{figures.mb_per_s:,.0f} MB/s"
    )
    cpu = figures.server_cpu_us_per_call
    server = "" if cpu is None else f", server {cpu:,.0f} us CPU/call"
    progress.say(
        f"{label}: {plan.op} {format_size(plan.value_bytes)}{batch}, {clients} client(s): "
        f"{rate}, p50 {figures.p50_ms:.2f} ms, {figures.calls} calls{server}"
    )
    return sample
