"""The one exception tree for errors that cross the wire, and their status codes.

Each class names the gRPC status it becomes (`status`, a `grpc.StatusCode` member name)
and that status's number (`wire_code`), so both wire formats carry the same status for the
same error: the gRPC interceptor aborts with it (cacheserver/transport/grpc/wire.py),
the bulk channel writes it in its error frame (kvcommon/bulkwire.py), and the client
maps it back to the same class through one static table (`error_class`). Messages say
what to change and never echo tokens, digests, payloads or another tenant's data.
Anything else raised in a handler is a bug: `wire_error` logs it with a request id and
turns it into INTERNAL with a fixed message, for every transport.
"""

from __future__ import annotations

import logging

from kvcommon.logs import current_request_id, new_request_id

log = logging.getLogger(__name__)


class KvshareError(Exception):
    """Base class; `status` is the name of a `grpc.StatusCode` member, `wire_code` its number."""

    status = "INTERNAL"
    wire_code = 13


class Unauthenticated(KvshareError):
    status = "UNAUTHENTICATED"
    wire_code = 16


class PermissionDenied(KvshareError):
    status = "PERMISSION_DENIED"
    wire_code = 7


class InvalidArgument(KvshareError):
    status = "INVALID_ARGUMENT"
    wire_code = 3


class ResourceExhausted(KvshareError):
    status = "RESOURCE_EXHAUSTED"
    wire_code = 8


class Unavailable(KvshareError):
    status = "UNAVAILABLE"
    wire_code = 14


class DataLoss(KvshareError):
    status = "DATA_LOSS"
    wire_code = 15


class ConfigError(ValueError):
    """A configuration problem found at start-up; the message names the key to fix."""


# Every wire error class by status name and by code: the one table both directions use.
WIRE_ERRORS: tuple[type[KvshareError], ...] = (
    KvshareError,
    Unauthenticated,
    PermissionDenied,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    DataLoss,
)
_BY_STATUS = {cls.status: cls for cls in WIRE_ERRORS}
_BY_CODE = {cls.wire_code: cls for cls in WIRE_ERRORS}


def error_class(status: str | int) -> type[KvshareError]:
    """The class of a status name or code; KvshareError (INTERNAL) for any other."""
    found = _BY_STATUS.get(status) if isinstance(status, str) else _BY_CODE.get(status)
    return found or KvshareError


def status_name(code: int) -> str:
    """The status name of a code this tree knows; INTERNAL for any other."""
    return error_class(code).status


def wire_error(error: BaseException, where: str) -> KvshareError:
    """`error` as a transport answers it: a `KvshareError` as itself; anything else is a
    bug, logged with its traceback under the call's request id and answered INTERNAL
    with a fixed message naming that id (never the exception's own text, which may
    carry data). `where`: the method, for the log."""
    if isinstance(error, KvshareError):
        return error
    request_id = current_request_id() or new_request_id()
    log.error(
        "internal error in %s (request id %s)",
        where,
        request_id,
        exc_info=(type(error), error, error.__traceback__),
    )
    return KvshareError(f"internal error (request id {request_id})")
