"""Structured logs: one JSON object per line, each tied to its request.

The server gives every RPC (and every bulk-channel request) a request id, kept in a
context variable for the call's task or thread; every log record and audit record made
during the call carries it, and an INTERNAL error quotes it to the client, so an
operator can go from a client's error to the server's log lines and the call's trace.
The id is drawn when first read (`RequestId`): a call that nothing records costs none.

What a record may hold is the caller's business (names and counts, never tokens,
digests, payloads or storage names: see policy/audit.py); this module only renders.
`render` is the one JSON encoder of both the log and the audit log, so the two read
alike and an encoding choice (ASCII only: no terminal escapes from odd input) is
made once.

No OpenTelemetry here: `policy.audit` renders through this module, and policy stays
free of exporters. A JSON log that should carry trace ids is given `trace_ids`
(the server passes `kvcommon.tracing.current_trace_ids`).
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
import secrets
import sys
import threading
from collections.abc import Callable, Mapping
from typing import Any

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s [%(request_id)s]: %(message)s"
# `extra={"fields": {...}}` on a log call adds these keys to the JSON object.
FIELDS_ATTR = "fields"

# Taken only to draw an id: two threads sharing a call's context (a copied one) that
# read a fresh id at once must both get the one that is kept.
_DRAW_LOCK = threading.Lock()


class RequestId:
    """One call's request id, drawn when first read (`value`), then the same for every
    reader. Most calls write no log line, audit record or span that would show it, so
    most never pay for the draw (a getrandom system call)."""

    __slots__ = ("_value",)

    def __init__(self) -> None:
        self._value: str | None = None

    @property
    def value(self) -> str:
        value = self._value
        if value is None:
            with _DRAW_LOCK:
                if self._value is None:
                    self._value = secrets.token_hex(8)  # 16 hex digits, as uuid4().hex[:16]
                value = self._value
        return value

    def __repr__(self) -> str:
        return f"RequestId({self._value or 'not drawn'})"


_request_id: contextvars.ContextVar[RequestId | None] = contextvars.ContextVar(
    "kvshare_request_id", default=None
)


def bind_request_id() -> RequestId:
    """A fresh id, bound to the current call (task or thread) from now on, drawn only
    when something reads it (`current_request_id`, or the returned object's `value`)."""
    request_id = RequestId()
    _request_id.set(request_id)
    return request_id


def new_request_id() -> str:
    """A fresh id, bound to the current call (task or thread) from now on."""
    return bind_request_id().value


def current_request_id() -> str | None:
    request_id = _request_id.get()
    return None if request_id is None else request_id.value


def utc_now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds")


def render(entry: Mapping[str, Any], *, strict: bool = True) -> str:
    """One JSON line (no newline): sorted keys, ASCII only. `strict`: a value JSON
    cannot encode is an error (the audit log) rather than its str() (log records)."""
    return json.dumps(entry, sort_keys=True, ensure_ascii=True, default=None if strict else str)


class _RequestIdFilter(logging.Filter):
    """Gives every record `request_id` (or "-"), for the text format."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = current_request_id() or "-"
        return True


TraceIds = Callable[[], tuple[str, str] | None]  # (trace id, span id) of the current span


class JsonFormatter(logging.Formatter):
    def __init__(self, trace_ids: TraceIds | None = None) -> None:
        super().__init__()
        self._trace_ids = trace_ids

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        request_id = current_request_id()
        if request_id is not None:
            entry["request_id"] = request_id
        ids = self._trace_ids() if self._trace_ids is not None else None
        if ids is not None:
            entry["trace_id"], entry["span_id"] = ids
        fields = getattr(record, FIELDS_ATTR, None)
        if isinstance(fields, Mapping):
            for key, value in fields.items():
                entry.setdefault(str(key), value)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return render(entry, strict=False)


def configure_logging(
    level: str = "info", log_format: str = "text", trace_ids: TraceIds | None = None
) -> None:
    """Route the root logger to stderr in `log_format` ("text" or "json"); JSON records
    carry the current span's ids when `trace_ids` is given."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log format {log_format!r}; use one of {', '.join(LOG_FORMATS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestIdFilter())
    handler.setFormatter(
        JsonFormatter(trace_ids) if log_format == "json" else logging.Formatter(TEXT_FORMAT)
    )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
