"""Where the server's metrics and traces go, when the operator asks
(`cacheserver.telemetry` makes them): a Prometheus text endpoint (`metrics_listen`) and
OTLP/HTTP export (`otlp_endpoint`, the optional `otlp` extra, imported only then)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace import SpanProcessor

from kvcommon.errors import ConfigError

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

log = logging.getLogger(__name__)
# Bounds each OTLP export with its retries, so a dead collector delays shutdown by
# seconds, not the exporter's default minute.
OTLP_TIMEOUT_S = 3.0


def prometheus_reader() -> tuple[MetricReader, Any]:
    """A reader and the registry it fills: a registry per server, not the
    process-global one, so several servers in one process (tests, `kvshare demo`)
    neither clash nor see each other's metrics."""
    from opentelemetry.exporter.prometheus import PrometheusMetricReader
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=True)
    return PrometheusMetricReader(scope_info_enabled=False, registry=registry), registry


def serve_prometheus(listen: str, registry: Any, per_tenant_labels: bool) -> tuple[WSGIServer, str]:
    """The endpoint on `listen` (HOST:PORT; a bare :PORT means loopback: it answers
    without authentication, so a scrape network must be named) and its bound address."""
    from prometheus_client import start_http_server

    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    try:
        http, _ = start_http_server(int(port_text), host, registry)
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"cannot serve metrics on {listen}: {error}; pick another --metrics-listen"
        ) from None
    port = http.server_port
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if host not in ("127.0.0.1", "::1", "localhost"):
        log.warning(
            "metrics on %s answer anyone who can reach them (no authentication); "
            "they hold counts only%s",
            address,
            ", and tenant ids (per_tenant_labels)" if per_tenant_labels else "",
        )
    return http, address


def otlp(endpoint: str) -> tuple[MetricReader, SpanProcessor]:
    """OTLP/HTTP exporters for metrics and traces (the `otlp` extra)."""
    try:
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError:
        raise ConfigError(
            "otlp_endpoint needs the OTLP exporter; pip install 'kvshare[otlp]' "
            "or remove otlp_endpoint from [telemetry]"
        ) from None
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    base = endpoint.rstrip("/")
    return (
        PeriodicExportingMetricReader(
            OTLPMetricExporter(endpoint=f"{base}/v1/metrics", timeout=OTLP_TIMEOUT_S)
        ),
        BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces", timeout=OTLP_TIMEOUT_S)),
    )
