"""The time model: arrivals from the trace, one FIFO prefill queue per replica.

A replica prefills one request at a time at `prefill_tokens_per_s` for the tokens it
does not reuse; blocks found only in the shared store are first restored at
`restore_gb_per_s` after a fixed `restore_latency_s`; local hits cost nothing (already
in GPU memory). TTFT = queueing wait + restore + prefill. Decode is ignored: with
continuous batching it overlaps the next prefill, and prefill dominates TTFT. The
model is deliberately linear in tokens (no attention quadratic term), which
understates what long reused prefixes save.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

_GB = 1e9


@dataclass(frozen=True)
class TimeModel:
    """Prefill and restore speeds of one replica, parsed once from flags or a preset."""

    prefill_tokens_per_s: float
    kv_bytes_per_token: int
    restore_gb_per_s: float
    restore_latency_s: float

    def prefill_s(self, tokens: int) -> float:
        """GPU seconds to prefill `tokens` prompt tokens."""
        return tokens / self.prefill_tokens_per_s

    def restore_s(self, tokens: int) -> float:
        """Seconds to pull `tokens` tokens of KV from the store; zero when none are pulled."""
        if tokens == 0:
            return 0.0
        return self.restore_latency_s + tokens * self.kv_bytes_per_token / (
            self.restore_gb_per_s * _GB
        )

    @property
    def break_even_restore_gb_per_s(self) -> float:
        """Restore bandwidth at which restoring a long prefix takes as long as recomputing it."""
        return self.kv_bytes_per_token * self.prefill_tokens_per_s / _GB


class ReplicaQueue:
    """One replica's FIFO of work: finish times only grow, so a deque tracks what is in flight."""

    def __init__(self) -> None:
        self.busy_until_s = 0.0
        self._finish_times_s: deque[float] = deque()

    def outstanding(self, now_s: float) -> int:
        """Requests queued or running at `now_s` (the load SGLang's router balances)."""
        finish_times = self._finish_times_s
        while finish_times and finish_times[0] <= now_s:
            finish_times.popleft()
        return len(finish_times)

    def serve(self, arrival_s: float, service_s: float) -> float:
        """Queue a request arriving at `arrival_s`; return its completion time."""
        finish_s = max(arrival_s, self.busy_until_s) + service_s
        self.busy_until_s = finish_s
        self._finish_times_s.append(finish_s)
        return finish_s


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """Nearest-rank percentile of an ascending sequence: the value at rank ceil(fraction * n)."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(fraction * len(sorted_values)))
    return sorted_values[rank - 1]
