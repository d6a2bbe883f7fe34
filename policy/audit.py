"""The audit log: one JSON object per line for every security-relevant event.

Events (`event` field):
    authn_failure      a call without a valid credential (what kind was presented)
    denied             an authenticated principal named a tenant or action not granted
    rate_limited       a principal went over its request rate (once per episode)
    admin              whole-tenant deletes, start-up reclamation, `kvshare admin ...`
    integrity_failure  stored blocks that failed their checksum and were dropped

Every record has `ts` (UTC, RFC 3339) and `event`; RPC events add `method` and `peer`
(bound once per call by the server's wire edge with `bind_call`), `request_id` (the
same id as the call's log lines and span), and where known `principal`, `tenant`,
`action`. Invariant: a record never holds a token, a digest, a storage name or a
payload — only names and counts; callers pass keyword fields and `record` refuses
bytes, so a digest cannot slip in by accident.

The file is the audit trail (its own sink: 0600, append-only, flushed per record,
whatever the log level). Each record is also handed to the `kvshare.audit` logger,
rendered by the same encoder (kvcommon.logs.render), so an operator who ships the
structured log sees the security events in the same stream.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from kvcommon.errors import ConfigError
from kvcommon.logs import FIELDS_ATTR, current_request_id, render, utc_now

AUDIT_FILE = "audit.log"
_log = logging.getLogger("kvshare.audit")
Field = str | int | float | bool | None | list[str]


@dataclass(frozen=True)
class CallInfo:
    method: str
    peer: str


_call: contextvars.ContextVar[CallInfo | None] = contextvars.ContextVar("audit_call", default=None)


def bind_call(method: str, peer: str) -> None:
    """Attach `method` and `peer` to every record made later in this context.

    The server calls it at the start of each RPC; every gRPC aio call runs in its own
    task with its own copy of the context, so the binding never leaks to another call
    (the same reason `current_principal` needs no reset).
    """
    _call.set(CallInfo(method, peer))


class AuditLog:
    """Appends JSON lines to a file (mode 0600), flushed per record; thread-safe."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        if path is not None:
            try:
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            except OSError as error:
                raise ConfigError(
                    f"cannot open audit log {path}: {error.strerror}; set audit_log to a "
                    "writable file"
                ) from None
            self._file = os.fdopen(fd, "a", encoding="utf-8")

    @classmethod
    def disabled(cls) -> AuditLog:
        return cls(None)

    def record(self, event: str, **fields: Field) -> None:
        entry: dict[str, Field] = {"ts": utc_now(), "event": event}
        call = _call.get()
        if call is not None:
            entry["method"] = call.method
            entry["peer"] = call.peer
        request_id = current_request_id()
        if request_id is not None:
            entry["request_id"] = request_id
        for key, value in fields.items():
            if isinstance(value, (bytes, bytearray, memoryview)):
                raise TypeError(f"audit field {key!r} is bytes; the audit log takes no raw bytes")
            if value is not None:
                entry[key] = value
        line = render(entry) + "\n"
        with self._lock:
            if self._file is not None:
                self._file.write(line)
                self._file.flush()
        if self._file is not None:
            _log.info("audit %s", event, extra={FIELDS_ATTR: {"audit": entry}})

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                self._file.close()
                self._file = None


def read_records(path: Path) -> list[dict[str, Field]]:
    """Every record of an audit log file (for tests and tools)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
