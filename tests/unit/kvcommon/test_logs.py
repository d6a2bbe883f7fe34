"""Structured logs (kvcommon.logs) and the audit log share request ids and one encoder."""

from __future__ import annotations

import contextvars
import json
import logging
from pathlib import Path

from opentelemetry.sdk.trace import TracerProvider

from kvcommon.logs import JsonFormatter, current_request_id, new_request_id
from kvcommon.tracing import current_trace_ids
from policy.audit import AuditLog, bind_call, read_records


def record(message: str) -> logging.LogRecord:
    return logging.LogRecord("kvshare.test", logging.WARNING, __file__, 1, message, (), None)


def test_json_log_line_has_request_and_trace_ids() -> None:
    def in_call() -> dict[str, object]:
        request_id = new_request_id()
        with TracerProvider().get_tracer("t").start_as_current_span("rpc") as span:
            line = json.loads(JsonFormatter(current_trace_ids).format(record("store get failed")))
            assert line["trace_id"] == f"{span.get_span_context().trace_id:032x}"
        assert line["request_id"] == request_id
        return line  # type: ignore[no-any-return]

    line = contextvars.copy_context().run(in_call)
    assert line["message"] == "store get failed" and line["level"] == "warning"
    assert current_request_id() is None  # bound to the call's context only


def test_audit_records_carry_the_request_id_of_their_call(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "audit.log")

    def in_call() -> str:
        request_id = new_request_id()
        bind_call("/kvshare.v1.BlockStore/Get", "ipv4:127.0.0.1:1")
        audit.record("denied", principal="a", tenant="beta")
        return request_id

    request_id = contextvars.copy_context().run(in_call)
    audit.close()
    (entry,) = read_records(tmp_path / "audit.log")
    assert entry["request_id"] == request_id and entry["event"] == "denied"
