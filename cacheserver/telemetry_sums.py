"""The server's counters and latency histogram, summed in the process.

The SDK's own instruments hash a call's attributes and update their aggregation on
every event, which cost a fifth of a small put's server time with metrics on. A `Tally`
is one dict update under a lock, read by the SDK at collection time (an observable
counter); `SummedTimings` keeps the calls' latency histogram for the Prometheus endpoint,
which collects it directly. The exported series are those the SDK's instruments gave:
OTLP and tests' readers keep the SDK's histogram (`SdkTimings`).
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Iterable, Sequence
from typing import Any

from opentelemetry import metrics
from opentelemetry.metrics import CallbackOptions, Observation

RPC_DURATION_HELP = "RPC latency by method and status"
# A series' labels: (name, value) pairs sorted by name, as a tally keys its sums.
Labels = tuple[tuple[str, str], ...]


class Tally:
    """A counter summed in the process and read by the SDK at collection time (an
    observable counter). Every request adds to several counters; the SDK's own counter
    hashes the attribute set and updates its aggregation on each call, which took about
    a fifth of the server's time on small puts with metrics on. Here an event is one
    dict update under a lock; the exported series are the same (monotonic sums)."""

    def __init__(self, meter: metrics.Meter, name: str, unit: str, description: str) -> None:
        self._lock = threading.Lock()
        self._totals: dict[Labels, int] = {}
        meter.create_observable_counter(name, [self._observe], unit, description)

    def add(self, amount: int, labels: Labels) -> None:
        """Add `amount` to the series of `labels` (made by `ServerTelemetry._labels`)."""
        with self._lock:
            self._totals[labels] = self._totals.get(labels, 0) + amount

    def _observe(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            totals = list(self._totals.items())
        return [Observation(value, dict(key)) for key, value in totals]


class NoTally(Tally):
    """Metrics off: nothing is counted."""

    def __init__(self) -> None:
        pass

    def add(self, amount: int, labels: Labels) -> None:
        pass


NO_TALLY = NoTally()


class SummedTimings:
    """The calls' latency histogram (`kvshare.rpc.duration`) by method and status,
    summed in the process: the SDK's histogram cleaned and hashed the attributes of
    every call and took about 6 us a call, as much as a tenth of a small GET's server
    time. Exported by the Prometheus endpoint's own collector (`collect`), with the
    bucket bounds, names and labels the SDK's exporter gave it. OTLP export and tests'
    readers keep the SDK's histogram (`SdkTimings`): only the SDK speaks OTLP."""

    def __init__(self, bounds: Sequence[float]) -> None:
        self._bounds = tuple(bounds)
        self._lock = threading.Lock()
        # Per (method, status): a count per bucket (the last one past every bound),
        # then the sum of the seconds.
        self._series: dict[tuple[str, str], list[float]] = {}

    def record(self, seconds: float, method: str, status: str) -> None:
        bucket = bisect.bisect_left(self._bounds, seconds)  # bounds are inclusive (le)
        with self._lock:
            row = self._series.get((method, status))
            if row is None:
                row = self._series[(method, status)] = [0] * (len(self._bounds) + 2)
            row[bucket] += 1
            row[-1] += seconds

    def collect(self) -> Iterable[Any]:
        """The histogram as Prometheus reads it (prometheus_client's collector interface)."""
        from prometheus_client.core import HistogramMetricFamily

        family = HistogramMetricFamily(
            "kvshare_rpc_duration_seconds",
            RPC_DURATION_HELP,
            labels=("method", "status"),
            unit="seconds",  # OpenMetrics scrapes get the UNIT line the SDK's exporter writes
        )
        with self._lock:
            series = [(key, list(row)) for key, row in self._series.items()]
        for (method, status), row in series:
            cumulative, buckets = 0.0, []
            for bound, count in zip((*self._bounds, float("inf")), row, strict=False):
                cumulative += count
                buckets.append((_bound_text(bound), cumulative))
            family.add_metric((method, status), buckets, sum_value=row[-1])
        yield family


class SdkTimings:
    """The calls' latency histogram as the SDK's own instrument (OTLP, tests' readers)."""

    def __init__(self, meter: metrics.Meter, bounds: Sequence[float]) -> None:
        self._histogram = meter.create_histogram(
            "kvshare.rpc.duration",
            "s",
            RPC_DURATION_HELP,
            explicit_bucket_boundaries_advisory=bounds,
        )

    def record(self, seconds: float, method: str, status: str) -> None:
        self._histogram.record(seconds, {"method": method, "status": status})


def _bound_text(bound: float) -> str:
    """A bucket's `le` as the SDK's exporter writes it ("0.0001", "1.0", "+Inf")."""
    return "+Inf" if bound == float("inf") else f"{bound}"
