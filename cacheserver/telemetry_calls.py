"""One observed call as every transport sees it (`RpcCall`), and how its end reads: the
status name an error gives (`status_of`) and the span that records it (`end_span`).

`cacheserver.telemetry` opens and closes calls (`ServerTelemetry.rpc`); the wire edges
read and set `RpcCall.status` in between. Nothing here records a payload or a digest.
"""

from __future__ import annotations

import asyncio

from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from kvcommon.errors import KvshareError
from kvcommon.logs import RequestId

# gRPC status numbers by name, for the `rpc.grpc.status_code` span attribute.
_STATUS_NAMES = (
    "OK", "CANCELLED", "UNKNOWN", "INVALID_ARGUMENT", "DEADLINE_EXCEEDED", "NOT_FOUND",
    "ALREADY_EXISTS", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "FAILED_PRECONDITION",
    "ABORTED", "OUT_OF_RANGE", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE", "DATA_LOSS",
    "UNAUTHENTICATED",
)  # fmt: skip
GRPC_CODES = {name: number for number, name in enumerate(_STATUS_NAMES)}


class RpcCall:
    """One observed call; the wire edge sets `status` when it knows it better.

    `request_id` is the call's id as every reader sees it (kvcommon.logs), drawn only
    when read."""

    __slots__ = ("_request_id", "method", "status")

    def __init__(self, method: str, request_id: RequestId, status: str | None = None) -> None:
        self.method = method
        self._request_id = request_id
        self.status = status

    @property
    def request_id(self) -> str:
        return self._request_id.value

    def __repr__(self) -> str:
        return f"RpcCall({self.method!r}, {self._request_id!r}, {self.status!r})"


def end_span(span: trace.Span, status: str) -> None:
    """End the call's server span with its status (the gRPC number as an attribute)."""
    span.set_attribute("rpc.grpc.status_code", GRPC_CODES.get(status, 2))
    if status != "OK":
        span.set_status(Status(StatusCode.ERROR, status))
    span.end()


def status_of(error: BaseException) -> str:
    """The status name a call that raised `error` ends with."""
    if isinstance(error, KvshareError):
        return error.status
    if isinstance(error, (GeneratorExit, asyncio.CancelledError)):
        return "CANCELLED"
    return "UNKNOWN"
