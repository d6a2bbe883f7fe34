"""The server's metrics and traces: with telemetry_sums.py (the counters and histogram
it sums in the process), telemetry_calls.py (one call and the status it ends with),
telemetry_gauges.py (the figures read from their owners at collection) and
telemetry_export.py (where they go), the one home of the OpenTelemetry SDK on this side.

Nothing leaves the process unless the operator asks (`[telemetry]` or flags): a
Prometheus text endpoint (`metrics_listen`), OTLP/HTTP export of metrics and traces
(`otlp_endpoint`, optional `otlp` extra, imported only when configured). With neither,
the meter and tracer are the API's no-ops and cost nothing.

What is recorded (L5 of MAESTRO: leakage through observability): methods, status
codes, tiers, eviction reasons, outcomes, counts, sizes and durations. Never a token,
digest, payload, model string or storage name. Tenant ids appear as labels and span
attributes only with `per_tenant_labels = true`. Label values come from fixed sets
(methods of registered services, status names, tiers) or from configured tenants, so
a client cannot grow the number of series.

Metric names are dotted here (OTLP) and become `kvshare_*` in Prometheus, with the
unit and `_total` suffixes: `kvshare.rpc.duration` (s) -> `kvshare_rpc_duration_seconds`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.trace import SpanKind

from cacheserver import telemetry_export as export
from cacheserver.config import TelemetryConfig
from cacheserver.events import EvictReason, PutOutcome, Tier
from cacheserver.telemetry_calls import RpcCall, end_span, status_of
from cacheserver.telemetry_gauges import ServerGauges
from cacheserver.telemetry_sums import NO_TALLY, Labels, SdkTimings, SummedTimings, Tally
from kvcommon.logs import bind_request_id
from policy.types import TenantId

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)
SCOPE = "kvshare.server"
# Seconds: from a memory-tier lookup (~100 us) to a large restore from disk.
LATENCY_BUCKETS_S = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
    2.5, 5.0, 10.0,
)  # fmt: skip


class ServerTelemetry:
    """Instruments, exporters and the per-call span of one server.

    Implements `cacheserver.events.StoreEvents`. `metric_readers` and `span_processors`
    are for tests (in-memory readers/exporters); exporters the config asks for are added
    to them."""

    def __init__(
        self,
        config: TelemetryConfig | None = None,
        *,
        metric_readers: Sequence[MetricReader] = (),
        span_processors: Sequence[SpanProcessor] = (),
    ) -> None:
        self.config = config or TelemetryConfig()
        self.metrics_address = ""
        self._http: WSGIServer | None = None
        self._registry: Any = None
        self._label_sets: dict[tuple[str | None, ...], Labels] = {}
        readers = list(metric_readers)
        processors = list(span_processors)
        if self.config.metrics_listen:
            reader, self._registry = export.prometheus_reader()
            readers.append(reader)
        if self.config.otlp_endpoint:
            reader, processor = export.otlp(self.config.otlp_endpoint)
            readers.append(reader)
            processors.append(processor)
        resource = Resource.create({"service.name": "kvshare-server"})
        self._meter_provider: metrics.MeterProvider = (
            MeterProvider(metric_readers=readers, resource=resource)
            if readers
            else metrics.NoOpMeterProvider()
        )
        self._tracer_provider: trace.TracerProvider
        if processors:
            sdk_tracer_provider = TracerProvider(resource=resource)
            for processor in processors:
                sdk_tracer_provider.add_span_processor(processor)
            self._tracer_provider = sdk_tracer_provider
        else:
            self._tracer_provider = trace.NoOpTracerProvider()
        self._tracer = self._tracer_provider.get_tracer(SCOPE)
        self._records_spans = bool(processors)  # else the tracer is the API's no-op
        # Prometheus alone (the usual deployment): latencies are summed here (SummedTimings).
        local_timings = self._registry is not None and len(readers) == 1
        meter = self._meter_provider.get_meter(SCOPE)
        self._make_instruments(meter, enabled=bool(readers), local_timings=local_timings)
        # Figures read from their owners at collection (cacheserver.telemetry_gauges).
        self.gauges = ServerGauges(meter, per_tenant_labels=self.config.per_tenant_labels)

    def _make_instruments(
        self, meter: metrics.Meter, *, enabled: bool, local_timings: bool
    ) -> None:
        def count(name: str, unit: str, description: str) -> Tally:
            return Tally(meter, name, unit, description) if enabled else NO_TALLY

        self._rpc_requests = count("kvshare.rpc.requests", "{request}", "RPCs by method, status")
        self._rpc_duration: SummedTimings | SdkTimings
        if local_timings:
            self._rpc_duration = SummedTimings(LATENCY_BUCKETS_S)
            self._registry.register(self._rpc_duration)
        else:
            self._rpc_duration = SdkTimings(meter, LATENCY_BUCKETS_S)
        self._lookups = count("kvshare.lookups", "{lookup}", "Lookup calls")
        self._lookup_blocks = count("kvshare.lookup.blocks", "{block}", "digests looked up")
        self._get_blocks = count("kvshare.get.blocks", "{block}", "blocks asked by gets")
        self._served_blocks = count("kvshare.served.blocks", "{block}", "blocks served")
        self._served_bytes = count("kvshare.served.bytes", "By", "payload bytes served")
        self._stored_blocks = count("kvshare.stored.blocks", "{block}", "blocks stored")
        self._stored_bytes = count("kvshare.stored.bytes", "By", "payload bytes stored")
        self._put_blocks = count("kvshare.put.blocks", "{block}", "blocks put, by outcome")
        self._evictions = count("kvshare.evictions", "{block}", "blocks evicted")
        self._evicted_bytes = count("kvshare.evicted.bytes", "By", "bytes evicted")
        self._quota_rejections = count(
            "kvshare.quota.rejections", "{block}", "blocks refused: no room within quota"
        )
        self._integrity_failures = count(
            "kvshare.integrity.failures", "{block}", "stored blocks that failed their checksum"
        )

    # -- exporters ------------------------------------------------------------------

    def start(self) -> str:
        """Start the Prometheus endpoint if configured; its bound HOST:PORT, or ""."""
        if not self.config.metrics_listen:
            return ""
        self._http, self.metrics_address = export.serve_prometheus(
            self.config.metrics_listen, self._registry, self.config.per_tenant_labels
        )
        return self.metrics_address

    def shutdown(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None
        for provider in (self._meter_provider, self._tracer_provider):
            stop = getattr(provider, "shutdown", None)
            if stop is not None:
                stop()

    # -- calls ----------------------------------------------------------------------

    def rpc(
        self,
        method: str,
        parent: otel_context.Context | None,
        *,
        system: str = "grpc",
        restore_context: bool = True,
    ) -> ObservedRpc:
        """Observe one call (`with telemetry.rpc(...) as call:`): request id, server span
        (child of `parent`), count, latency.

        The request id is bound on entry and drawn when something reads it; the span
        exists only where spans are recorded (`_start_span`).

        `restore_context=False` for async generators, which may be finished from another
        task: the call's own task context is discarded with it anyway."""
        return ObservedRpc(self, method, parent, system, restore_context)

    def _finish_rpc(self, method: str, status: str, seconds: float) -> None:
        self._rpc_requests.add(1, self._labels(None, "method", method, "status", status))
        self._rpc_duration.record(seconds, method, status)

    def rpcs_served_elsewhere(self, method: str, calls: int) -> None:
        """Count `calls` of `method` that a bulk read worker answered
        (cacheserver.transport.bulk.readworker), all OK: call counts stay whole; their
        latencies are not observed here."""
        if calls:
            self._rpc_requests.add(calls, self._labels(None, "method", method, "status", "OK"))

    def _start_span(
        self, call: RpcCall, parent: otel_context.Context | None, system: str
    ) -> trace.Span | None:
        """The call's server span, made current by `rpc`; None where no span processor
        is configured: the API's no-op tracer would return an invalid span anyway, and
        its attributes would draw the request id for nothing."""
        if not self._records_spans:
            return None
        return self._tracer.start_span(
            call.method,
            context=parent,
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": system,
                "rpc.method": call.method,
                "kvshare.request_id": call.request_id,
            },
        )

    # -- StoreEvents ----------------------------------------------------------------

    def _labels(self, tenant: TenantId | None, *pairs: str) -> Labels:
        """The labels of a series: `pairs` (name, value, name, value, ...) and, with
        `per_tenant_labels`, the tenant. Made once per combination (their values come
        from fixed sets and configured tenants): every request counts several series."""
        key = (tenant, *pairs)
        labels = self._label_sets.get(key)
        if labels is None:
            named = dict(zip(pairs[::2], pairs[1::2], strict=True))
            if tenant is not None and self.config.per_tenant_labels:
                named["tenant"] = tenant
            labels = self._label_sets[key] = tuple(sorted(named.items()))
        return labels

    def looked_up(self, tenant: TenantId, asked: int, present: int, calls: int = 1) -> None:
        self._lookups.add(calls, self._labels(tenant))
        self._lookup_blocks.add(present, self._labels(tenant, "result", "hit"))
        self._lookup_blocks.add(asked - present, self._labels(tenant, "result", "miss"))

    def got(self, tenant: TenantId, asked: int, served: int) -> None:
        self._get_blocks.add(served, self._labels(tenant, "result", "hit"))
        self._get_blocks.add(asked - served, self._labels(tenant, "result", "miss"))

    def served(self, tenant: TenantId, tier: Tier, blocks: int, nbytes: int) -> None:
        labels = self._labels(tenant, "tier", tier)
        self._served_blocks.add(blocks, labels)
        self._served_bytes.add(nbytes, labels)

    def stored(self, tenant: TenantId, tier: Tier, nbytes: int) -> None:
        labels = self._labels(tenant, "tier", tier)
        self._stored_blocks.add(1, labels)
        self._stored_bytes.add(nbytes, labels)

    def put_outcome(self, tenant: TenantId, outcome: PutOutcome, nbytes: int) -> None:
        self._put_blocks.add(1, self._labels(tenant, "outcome", outcome))

    def evicted(self, tier: Tier, reason: EvictReason, nbytes: int) -> None:
        labels = self._labels(None, "reason", reason, "tier", tier)
        self._evictions.add(1, labels)
        self._evicted_bytes.add(nbytes, labels)

    def quota_rejected(self, tenant: TenantId) -> None:
        self._quota_rejections.add(1, self._labels(tenant))

    def integrity_failure(self, tenant: TenantId, blocks: int) -> None:
        self._integrity_failures.add(blocks, self._labels(tenant, "tier", "lmdb"))


class ObservedRpc:
    """`ServerTelemetry.rpc`'s block: a class, not a generator, as every request of
    every transport enters one (a generator-based context manager costs ~1 µs more)."""

    __slots__ = (
        "_call",
        "_method",
        "_parent",
        "_restore",
        "_span",
        "_started",
        "_system",
        "_telemetry",
        "_token",
    )

    def __init__(
        self,
        telemetry: ServerTelemetry,
        method: str,
        parent: otel_context.Context | None,
        system: str,
        restore_context: bool,
    ) -> None:
        self._telemetry = telemetry
        self._method = method
        self._parent = parent
        self._system = system
        self._restore = restore_context

    def __enter__(self) -> RpcCall:
        call = self._call = RpcCall(self._method, bind_request_id())
        self._started = time.perf_counter()
        span = self._span = self._telemetry._start_span(call, self._parent, self._system)
        self._token = None if span is None else otel_context.attach(trace.set_span_in_context(span))
        return call

    def __exit__(
        self, exc_type: type[BaseException] | None, error: BaseException | None, tb: object
    ) -> None:
        call = self._call
        if error is not None:
            call.status = call.status or status_of(error)
        status = call.status or "OK"
        if self._span is not None:
            end_span(self._span, status)
        self._telemetry._finish_rpc(self._method, status, time.perf_counter() - self._started)
        if self._token is not None and self._restore:
            otel_context.detach(self._token)
