"""The agent's metrics and spans: the one home of OpenTelemetry on the replica side.

The agent is a library inside an inference engine, so by default it records through
the process's global OpenTelemetry providers: no-ops unless the engine (or operator)
installed an SDK, in which case the agent's spans join the engine's traces and its
metrics leave by the engine's exporters. Tests pass their own providers.

Spans: `kvshare.agent.match`, `kvshare.agent.load`, `kvshare.agent.save`, each current
while its store call runs, so the client puts it in the call's `traceparent` and the
server's span of that call is its child. A save runs later on the saver thread, under
the context that was current when `save` was called.

Recorded: counts, sizes, durations, breaker state. Never token ids, digests, payloads
or the model string; the tenant only with `per_tenant_labels=True`.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Literal, TypeAlias

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.metrics import CallbackOptions, Observation

from replica_agent.breaker import BreakerState, CircuitBreaker

SCOPE = "kvshare.agent"
DropReason: TypeAlias = Literal["queue_full", "buffer_full", "capturing", "breaker_open", "error"]
# Why a restore placed fewer blocks than it was offered (replica_agent.device); here,
# below the restorer, so that its meter and the restorer share it without an import
# circle (device -> gate -> telemetry).
StopReason: TypeAlias = Literal["format_error", "out_of_memory", "capturing"]
Span: TypeAlias = trace.Span
Context: TypeAlias = otel_context.Context
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BANDWIDTH_BUCKETS = tuple(float(1 << shift) for shift in range(20, 36, 2))  # 1 MiB/s .. 32 GiB/s


class _Instruments:
    """One set per meter provider: agents in one process share (and sum into) them."""

    def __init__(self, meter: metrics.Meter) -> None:
        self.tokens = meter.create_counter(
            "kvshare.agent.tokens", "{token}", "prompt tokens: matched, restored, recomputed"
        )
        self.restore_bytes = meter.create_counter(
            "kvshare.agent.restore.bytes", "By", "KV bytes restored into device memory"
        )
        self.restore_duration = meter.create_histogram(
            "kvshare.agent.restore.duration",
            "s",
            "time of one load (fetch, open, decode, copy)",
            explicit_bucket_boundaries_advisory=LATENCY_BUCKETS_S,
        )
        self.restore_bandwidth = meter.create_histogram(
            "kvshare.agent.restore.bandwidth",
            "By/s",
            "bytes per second of one load",
            explicit_bucket_boundaries_advisory=BANDWIDTH_BUCKETS,
        )
        self.saved_blocks = meter.create_counter(
            "kvshare.agent.saved.blocks", "{block}", "blocks written to the store"
        )
        self.saves_dropped = meter.create_counter(
            "kvshare.agent.saves.dropped", "{save}", "save jobs dropped, by reason"
        )
        self.store_errors = meter.create_counter(
            "kvshare.agent.store.errors", "{call}", "failed or timed-out store calls"
        )
        self.open_failures = meter.create_counter(
            "kvshare.agent.open.failures", "{block}", "sealed blocks that failed to open"
        )
        self.restore_stops = meter.create_counter(
            "kvshare.agent.restore.stops",
            "{load}",
            "loads cut short on the replica, by reason (bad layout, device memory, capture)",
        )
        self.breaker_skips = meter.create_counter(
            "kvshare.agent.breaker.skips", "{call}", "store calls skipped: breaker open"
        )
        self.breakers: weakref.WeakSet[CircuitBreaker] = weakref.WeakSet()
        meter.create_observable_gauge(
            "kvshare.agent.breaker.state",
            [self._observe_breakers],
            "{agent}",
            "agents whose circuit breaker is in each state",
        )

    def _observe_breakers(self, _: CallbackOptions) -> Iterable[Observation]:
        states = [breaker.state for breaker in list(self.breakers)]
        return [Observation(states.count(s), {"state": s.value}) for s in BreakerState]


_BY_PROVIDER: weakref.WeakKeyDictionary[metrics.MeterProvider, _Instruments] = (
    weakref.WeakKeyDictionary()
)


class AgentTelemetry:
    def __init__(
        self,
        *,
        meter_provider: metrics.MeterProvider | None = None,
        tracer_provider: trace.TracerProvider | None = None,
        per_tenant_labels: bool = False,
    ) -> None:
        provider = meter_provider or metrics.get_meter_provider()
        instruments = _BY_PROVIDER.get(provider)
        if instruments is None:
            instruments = _BY_PROVIDER[provider] = _Instruments(provider.get_meter(SCOPE))
        self._m = instruments
        self._tracer = (tracer_provider or trace.get_tracer_provider()).get_tracer(SCOPE)
        self._per_tenant = per_tenant_labels

    def watch_breaker(self, breaker: CircuitBreaker) -> None:
        self._m.breakers.add(breaker)

    def _labels(self, tenant: str, **labels: str) -> dict[str, str]:
        if self._per_tenant:
            labels["tenant"] = tenant
        return labels

    @staticmethod
    def current_context() -> Context:
        """The caller's context, to parent work done later on another thread."""
        return otel_context.get_current()

    @contextmanager
    def span(self, name: str, tenant: str, parent: Context | None = None) -> Iterator[Span]:
        with self._tracer.start_as_current_span(
            name, context=parent, attributes=self._labels(tenant)
        ) as span:
            yield span

    def matched(
        self, span: Span, tenant: str, asked_blocks: int, found_blocks: int, block_tokens: int
    ) -> None:
        span.set_attribute("kvshare.blocks.asked", asked_blocks)
        span.set_attribute("kvshare.blocks.found", found_blocks)
        self._m.tokens.add(found_blocks * block_tokens, self._labels(tenant, kind="matched"))
        missed = (asked_blocks - found_blocks) * block_tokens
        self._m.tokens.add(missed, self._labels(tenant, kind="recomputed"))

    def loaded(
        self,
        span: Span,
        tenant: str,
        wanted_blocks: int,
        restored_blocks: int,
        nbytes: int,
        seconds: float,
        block_tokens: int,
    ) -> None:
        span.set_attribute("kvshare.blocks.asked", wanted_blocks)
        span.set_attribute("kvshare.blocks.restored", restored_blocks)
        span.set_attribute("kvshare.bytes", nbytes)
        self._m.tokens.add(restored_blocks * block_tokens, self._labels(tenant, kind="restored"))
        shortfall = (wanted_blocks - restored_blocks) * block_tokens
        self._m.tokens.add(shortfall, self._labels(tenant, kind="recomputed"))
        self._m.restore_bytes.add(nbytes, self._labels(tenant))
        self._m.restore_duration.record(seconds, self._labels(tenant))
        if nbytes and seconds > 0:
            self._m.restore_bandwidth.record(nbytes / seconds, self._labels(tenant))

    def saved(self, span: Span, tenant: str, blocks: int) -> None:
        span.set_attribute("kvshare.blocks.saved", blocks)
        self._m.saved_blocks.add(blocks, self._labels(tenant))

    def save_dropped(self, reason: DropReason) -> None:
        self._m.saves_dropped.add(1, {"reason": reason})

    def store_error(self, operation: str) -> None:
        self._m.store_errors.add(1, {"operation": operation})

    def open_failure(self) -> None:
        self._m.open_failures.add(1)

    def restore_stopped(self, reason: StopReason) -> None:
        self._m.restore_stops.add(1, {"reason": reason})

    def breaker_skip(self) -> None:
        self._m.breaker_skips.add(1)
