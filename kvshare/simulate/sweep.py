"""Run many configurations over one parsed trace, with a progress bar on long runs.

The trace is parsed and shaped once; each configuration then replays the same tuple
of requests with its own fresh caches and policy. A single process is enough: the
full 5 x 4 x 2 sweep of the shipped trace takes a few seconds (see
benchmarks/simulate_sweep.py), and a pool of processes would cost more to start
than it saves on a two-core machine.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import TextIO

from kvshare.simulate.engine import SimConfig, SimResult, simulate
from kvshare.simulate.trace import Request

# Below this many configurations a run finishes before a bar would be worth drawing.
_MIN_CONFIGS_FOR_PROGRESS = 4
_BAR_WIDTH = 30


class ProgressBar:
    """A one-line bar redrawn in place on a terminal stream."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self._total = total
        self._stream = stream
        self._started_s = time.monotonic()

    def update(self, done: int, label: str) -> None:
        filled = _BAR_WIDTH * done // self._total
        elapsed_s = time.monotonic() - self._started_s
        bar = "#" * filled + "." * (_BAR_WIDTH - filled)
        self._stream.write(f"\r[{bar}] {done}/{self._total} {elapsed_s:5.1f}s {label:<32}")
        self._stream.flush()

    def close(self) -> None:
        self._stream.write("\n")
        self._stream.flush()


def describe(config: SimConfig) -> str:
    """Short label of a configuration, e.g. `round_robin x8 +store`."""
    store = "+store" if config.shared_store else "local"
    return f"{config.policy} x{config.replicas} {store}"


def run_sweep(
    requests: Sequence[Request],
    configs: Sequence[SimConfig],
    show_progress: bool | None = None,
    stream: TextIO | None = None,
) -> list[SimResult]:
    """Replay every configuration in order; `show_progress` None means: if a terminal."""
    out = sys.stderr if stream is None else stream
    if show_progress is None:
        show_progress = out.isatty() and len(configs) >= _MIN_CONFIGS_FOR_PROGRESS
    bar = ProgressBar(len(configs), out) if show_progress and configs else None
    results = []
    for done, config in enumerate(configs, start=1):
        results.append(simulate(requests, config))
        if bar is not None:
            bar.update(done, describe(config))
    if bar is not None:
        bar.close()
    return results
