"""Trace context across the wire (kvcommon.tracing): only traceparent, in two encodings."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from kvcommon import bulkwire
from kvcommon.tracing import (
    BINARY_CONTEXT,
    binary_context,
    context_from_binary,
    context_from_metadata,
    outgoing_metadata,
)

TRACER = TracerProvider().get_tracer("test")


def parent_of(context: object) -> trace.SpanContext:
    return trace.get_current_span(context).get_span_context()  # type: ignore[arg-type]


def test_no_span_means_no_metadata_and_no_binary_context() -> None:
    assert outgoing_metadata() == ()
    assert binary_context() is None


def test_traceparent_and_binary_context_carry_the_current_span() -> None:
    with TRACER.start_as_current_span("load") as span:
        sent = span.get_span_context()
        metadata = outgoing_metadata()
        raw = binary_context()
    assert [k for k, _ in metadata] == ["traceparent"]
    assert raw is not None and len(raw) == BINARY_CONTEXT.size == bulkwire.TRACE_CONTEXT_BYTES
    for context in (context_from_metadata(metadata), context_from_binary(raw)):
        received = parent_of(context)
        assert (received.trace_id, received.span_id) == (sent.trace_id, sent.span_id)
        assert received.is_remote and received.trace_flags.sampled


def test_tracestate_baggage_and_malformed_contexts_are_ignored() -> None:
    good = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    context = context_from_metadata(
        [("traceparent", good), ("tracestate", "vendor=secret"), ("baggage", "user=secret")]
    )
    assert not parent_of(context).trace_state  # tracestate never crosses
    assert context_from_metadata([("traceparent", "00-zz-yy-01")]) is None
    assert context_from_metadata([("authorization", "Bearer x")]) is None
    assert context_from_binary(bytes(BINARY_CONTEXT.size)) is None  # all-zero ids
