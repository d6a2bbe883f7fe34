"""OTLP export, when configured: metrics and spans reach a collector over OTLP/HTTP."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip("opentelemetry.exporter.otlp.proto.http", reason="needs the otlp extra")

from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)

from cacheserver.config import ServerConfig, TelemetryConfig
from cacheserver.embedded import EmbeddedServer
from replica_agent.client import BlockClient

MODEL = "obs/model@r1;fp32;L2;H2;D8;B4;tp0/1"


@pytest.fixture
def collector() -> Iterator[tuple[str, dict[str, list[bytes]]]]:
    """A stand-in OTLP/HTTP collector that keeps each request body by path."""
    received: dict[str, list[bytes]] = {}

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.setdefault(self.path, []).append(body)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{http.server_port}", received
    finally:
        http.shutdown()
        http.server_close()


def test_metrics_and_spans_are_exported_to_the_configured_collector(
    tmp_path: Path, collector: tuple[str, dict[str, list[bytes]]]
) -> None:
    endpoint, received = collector
    data_dir = tmp_path / "data"
    config = dataclasses.replace(
        ServerConfig(listen="127.0.0.1:0", data_dir=data_dir),
        telemetry=TelemetryConfig(otlp_endpoint=endpoint),
    )
    with EmbeddedServer(config) as server:
        token = (data_dir / "dev.token").read_text().strip()
        with BlockClient(server.address, token, bulk=False) as client:
            assert client.lookup("dev", MODEL, [os.urandom(32)]) == 0
    # Stopping the server flushed both exporters.
    metric_names = {
        metric.name
        for body in received["/v1/metrics"]
        for resource in ExportMetricsServiceRequest.FromString(body).resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert {"kvshare.rpc.requests", "kvshare.lookup.blocks"} <= metric_names
    span_names = {
        span.name
        for body in received["/v1/traces"]
        for resource in ExportTraceServiceRequest.FromString(body).resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    }
    assert "kvshare.v1.BlockStore/Lookup" in span_names
