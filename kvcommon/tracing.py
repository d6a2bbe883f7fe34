"""Trace context across the wire: W3C `traceparent` on gRPC, 25 bytes on the bulk channel.

Shared by the agent's client (inject) and the server's wire edge (extract), so one
restore is one trace. Only `traceparent` crosses: no `tracestate` and no baggage, so a
client cannot place free text into the server's trace context (and from there into an
exporter). A malformed or all-zero context is ignored: the server span starts a new
trace. Only the OpenTelemetry API is used here; which SDK records spans is up to each
side (cacheserver/telemetry.py, replica_agent/telemetry.py).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

TRACEPARENT = "traceparent"
# trace id (16) | span id (8) | trace flags (1): the fields of a traceparent, in binary.
BINARY_CONTEXT = struct.Struct(">16s8sB")
_PROPAGATOR = TraceContextTextMapPropagator()


def outgoing_metadata() -> tuple[tuple[str, str], ...]:
    """`(("traceparent", ...),)` for the current span, or () when there is none."""
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier)
    value = carrier.get(TRACEPARENT)
    return ((TRACEPARENT, value),) if value else ()


def context_from_metadata(metadata: Iterable[tuple[str, str | bytes]]) -> Context | None:
    """The caller's span as a parent context, from a call's invocation metadata."""
    value = next((v for k, v in metadata if k == TRACEPARENT), None)
    if not isinstance(value, str):
        return None
    context = _PROPAGATOR.extract({TRACEPARENT: value})
    return context if trace.get_current_span(context).get_span_context().is_valid else None


def binary_context() -> bytes | None:
    """The current span's context in BINARY_CONTEXT form, or None without a valid span."""
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return BINARY_CONTEXT.pack(
        span_context.trace_id.to_bytes(16, "big"),
        span_context.span_id.to_bytes(8, "big"),
        int(span_context.trace_flags) & 0xFF,
    )


def context_from_binary(raw: bytes | bytearray) -> Context | None:
    trace_id_raw, span_id_raw, flags = BINARY_CONTEXT.unpack(bytes(raw))
    span_context = trace.SpanContext(
        trace_id=int.from_bytes(trace_id_raw, "big"),
        span_id=int.from_bytes(span_id_raw, "big"),
        is_remote=True,
        trace_flags=trace.TraceFlags(flags & trace.TraceFlags.SAMPLED),
    )
    if not span_context.is_valid:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


def current_trace_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, for log records."""
    span_context = trace.get_current_span().get_span_context()
    if not span_context.is_valid:
        return None
    return f"{span_context.trace_id:032x}", f"{span_context.span_id:016x}"
