"""One call as the server observes it (ServerTelemetry.rpc): its request id is drawn
only when something reads it, and then the same for every reader; a span is started
only where spans are recorded; the metrics are counted either way."""

from __future__ import annotations

import contextvars
import json
import logging
import secrets
from collections.abc import Iterator
from typing import Any

import pytest
from opentelemetry import trace
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from cacheserver.telemetry import ServerTelemetry
from kvcommon.errors import InvalidArgument, wire_error
from kvcommon.logs import JsonFormatter, current_request_id
from kvcommon.tracing import BINARY_CONTEXT, context_from_binary

BULK = "kvshare_bulk"


@pytest.fixture
def draws(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every request id drawn (kvcommon.logs draws with secrets.token_hex)."""
    drawn: list[str] = []
    real = secrets.token_hex

    def counted(nbytes: int | None = None) -> str:
        drawn.append(real(nbytes))
        return drawn[-1]

    monkeypatch.setattr(secrets, "token_hex", counted)
    return drawn


@pytest.fixture
def no_spans_started(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> trace.Span:
        raise AssertionError("a span was started that nothing records")

    monkeypatch.setattr(trace.NoOpTracer, "start_span", refuse)


def in_own_context(work: Any) -> Any:
    """Run `work` as a call runs: in a context of its own (a task, a thread)."""
    return contextvars.copy_context().run(work)


def log_line() -> dict[str, Any]:
    record = logging.LogRecord("kvshare.test", logging.ERROR, __file__, 1, "failed", (), None)
    return json.loads(JsonFormatter().format(record))  # type: ignore[no-any-return]


@pytest.mark.usefixtures("no_spans_started")
def test_a_call_that_nothing_records_draws_no_id_and_starts_no_span(draws: list[str]) -> None:
    telemetry = ServerTelemetry()

    def call() -> None:
        with telemetry.rpc("kvshare.bulk/Get", None, system=BULK):
            assert trace.get_current_span() is trace.INVALID_SPAN
        with pytest.raises(InvalidArgument), telemetry.rpc("kvshare.bulk/Put", None):
            raise InvalidArgument("refused")

    in_own_context(call)
    assert draws == []


@pytest.mark.usefixtures("no_spans_started")
def test_the_id_is_one_for_every_reader_of_a_call_and_new_for_the_next(
    draws: list[str],
) -> None:
    telemetry = ServerTelemetry()

    def call() -> str:
        with telemetry.rpc("kvshare.bulk/Get", None, system=BULK) as observed:
            first = observed.request_id
            assert len(first) == 16 and int(first, 16) >= 0
            assert observed.request_id == first == current_request_id()
            assert log_line()["request_id"] == first
            internal = wire_error(RuntimeError("a bug"), "kvshare.bulk/Get")
            assert str(internal) == f"internal error (request id {first})"
        assert current_request_id() == first  # bound until the next call, as before
        return first

    with pytest.MonkeyPatch.context() as quiet:  # wire_error logs the bug
        quiet.setattr(logging.getLogger("kvcommon.errors"), "disabled", True)
        ids = [in_own_context(call) for _ in range(3)]
    assert len(set(ids)) == 3
    assert draws == ids  # one draw per call, however many readers


def test_a_later_reader_of_the_call_context_gets_the_same_id(draws: list[str]) -> None:
    """A log line first, the call's own `request_id` after: whichever reads first."""
    telemetry = ServerTelemetry()

    def call() -> None:
        with telemetry.rpc("kvshare.v1.BlockStore/Get", None) as observed:
            logged = log_line()["request_id"]
            assert observed.request_id == logged

    in_own_context(call)
    assert len(draws) == 1


@pytest.fixture
def exporter() -> Iterator[tuple[ServerTelemetry, InMemorySpanExporter]]:
    spans = InMemorySpanExporter()
    telemetry = ServerTelemetry(span_processors=[SimpleSpanProcessor(spans)])
    yield telemetry, spans
    telemetry.shutdown()


def test_spans_are_recorded_with_the_id_where_an_exporter_is_configured(
    exporter: tuple[ServerTelemetry, InMemorySpanExporter],
) -> None:
    telemetry, spans = exporter
    parent_ids = (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    raw = BINARY_CONTEXT.pack(
        parent_ids[0].to_bytes(16, "big"), parent_ids[1].to_bytes(8, "big"), 1
    )
    parent = context_from_binary(raw)

    def calls() -> list[str]:
        with telemetry.rpc("kvshare.bulk/Get", parent, system=BULK) as got:
            current = trace.get_current_span()
            assert current.is_recording()  # the span is the call's current span
            assert log_line()["request_id"] == got.request_id
        with pytest.raises(InvalidArgument), telemetry.rpc("kvshare.bulk/Put", None) as put:
            raise InvalidArgument("refused")
        return [got.request_id, put.request_id]

    ids = in_own_context(calls)
    get, put = spans.get_finished_spans()
    assert get.name == "kvshare.bulk/Get" and put.name == "kvshare.bulk/Put"
    assert get.kind == trace.SpanKind.SERVER
    assert get.attributes is not None and put.attributes is not None
    assert dict(get.attributes) == {
        "rpc.system": BULK,
        "rpc.method": "kvshare.bulk/Get",
        "kvshare.request_id": ids[0],
        "rpc.grpc.status_code": 0,
    }
    assert put.attributes["kvshare.request_id"] == ids[1] != ids[0]
    assert put.attributes["rpc.grpc.status_code"] == 3  # INVALID_ARGUMENT
    assert put.status.status_code == trace.StatusCode.ERROR
    assert get.context is not None and get.parent is not None
    assert (get.context.trace_id, get.parent.span_id) == parent_ids  # the caller's trace
    assert trace.get_current_span() is trace.INVALID_SPAN  # detached after the call


@pytest.mark.parametrize("spans", [False, True], ids=["no-spans", "spans"])
def test_calls_are_counted_by_method_and_status_either_way(spans: bool) -> None:
    reader = InMemoryMetricReader()
    processors = [SimpleSpanProcessor(InMemorySpanExporter())] if spans else []
    telemetry = ServerTelemetry(metric_readers=[reader], span_processors=processors)

    def calls() -> None:
        for _ in range(2):
            with telemetry.rpc("kvshare.bulk/Get", None, system=BULK):
                pass
        with pytest.raises(InvalidArgument), telemetry.rpc("kvshare.bulk/Get", None) as call:
            call.status = "NOT_FOUND"  # the wire edge knew better
            raise InvalidArgument("refused")

    in_own_context(calls)
    data = reader.get_metrics_data()
    assert data is not None
    points: dict[str, dict[tuple[tuple[str, Any], ...], Any]] = {}
    for resource in data.resource_metrics:
        for scope in resource.scope_metrics:
            for metric in scope.metrics:
                points[metric.name] = {
                    tuple(sorted((p.attributes or {}).items())): p for p in metric.data.data_points
                }
    ok = (("method", "kvshare.bulk/Get"), ("status", "OK"))
    missing = (("method", "kvshare.bulk/Get"), ("status", "NOT_FOUND"))
    requests = points["kvshare.rpc.requests"]
    assert {k: p.value for k, p in requests.items()} == {ok: 2, missing: 1}
    durations = points["kvshare.rpc.duration"]
    assert {k: p.count for k, p in durations.items()} == {ok: 2, missing: 1}
    telemetry.shutdown()


def test_latencies_summed_in_the_server_export_what_the_sdk_exported(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With Prometheus alone the server sums latencies itself (the SDK's histogram cost
    ~6 us a call): the exported histogram must be the one the SDK's exporter wrote, to
    the line: buckets inclusive of their bound, cumulative, the sum, the count."""
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

    from cacheserver.config import TelemetryConfig

    def duration_lines(telemetry: ServerTelemetry) -> list[str]:
        """The histogram's lines in both of Prometheus's text formats."""
        lines = []
        for exposition in (generate_latest, generate_openmetrics):
            text = exposition(telemetry._registry).decode()
            lines += sorted(line for line in text.splitlines() if "kvshare_rpc_duration" in line)
        return lines

    prometheus = TelemetryConfig(metrics_listen="127.0.0.1:0")
    local = ServerTelemetry(prometheus)  # Prometheus alone: summed in the server
    sdk = ServerTelemetry(prometheus, metric_readers=[InMemoryMetricReader()])  # the SDK's
    seconds = [0.0001, 0.00005, 0.0003, 0.001, 0.7, 10.0, 12.5, 0.0001]

    def calls(telemetry: ServerTelemetry) -> None:
        for index in range(len(seconds)):
            with telemetry.rpc(f"{BULK}/Get", None) as call:
                call.status = "OK" if index % 3 else "NOT_FOUND"

    for telemetry in (local, sdk):
        clock = iter(value for took in seconds for value in (0.0, took))
        monkeypatch.setattr("cacheserver.telemetry.time.perf_counter", clock.__next__)
        contextvars.copy_context().run(calls, telemetry)  # its request ids stay there
    lines = duration_lines(local)
    assert lines == duration_lines(sdk)
    assert (
        'kvshare_rpc_duration_seconds_bucket{le="0.0001",method="kvshare_bulk/Get",status="OK"} 2.0'
        in lines
    )
    assert (
        'kvshare_rpc_duration_seconds_count{method="kvshare_bulk/Get",status="NOT_FOUND"} 3.0'
        in lines
    )
