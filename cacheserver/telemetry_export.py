"""Where the server's metrics and traces go, when the operator asks
(`cacheserver.telemetry` makes them): a Prometheus text endpoint (`metrics_listen`) and
OTLP/HTTP export (`otlp_endpoint`, the optional `otlp` extra, imported only then)."""

from __future__ import annotations

import logging
import socket
import threading
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from opentelemetry.sdk.metrics.export import MetricReader
from opentelemetry.sdk.trace import SpanProcessor

from kvcommon.errors import ConfigError

log = logging.getLogger(__name__)
# Bounds each OTLP export with its retries, so a dead collector delays shutdown by
# seconds, not the exporter's default minute.
OTLP_TIMEOUT_S = 3.0
# The metrics port answers without authentication: a connection that idles or drips
# its request is let go after this long, and at most this many are served at once (a
# scraper needs one), so idle connections cannot pile up threads in the server.
METRICS_CONNECTION_TIMEOUT_S = 5.0
MAX_METRICS_CONNECTIONS = 16


class _QuietHandler(WSGIRequestHandler):
    timeout = METRICS_CONNECTION_TIMEOUT_S  # socketserver sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:
        pass  # scrapes are not news; errors still reach the server's log


class _MetricsServer(ThreadingMixIn, WSGIServer):
    """A thread per scrape, at most MAX_METRICS_CONNECTIONS of them: past that a new
    connection is closed at once instead of taking a thread."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_METRICS_CONNECTIONS)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()


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
    from prometheus_client import make_wsgi_app

    host, _, port_text = listen.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"

    class Server(_MetricsServer):
        address_family = socket.AF_INET6 if ":" in host else socket.AF_INET

    try:
        http = make_server(
            host, int(port_text), make_wsgi_app(registry), Server, handler_class=_QuietHandler
        )
    except (OSError, ValueError) as error:
        raise ConfigError(
            f"cannot serve metrics on {listen}: {error}; pick another --metrics-listen"
        ) from None
    threading.Thread(target=http.serve_forever, name="kvshare-metrics", daemon=True).start()
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
