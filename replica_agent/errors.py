"""The client's errors: one static class per status, whatever transport answered.

A failed call raises a `BlockStoreError` whose `.code()` is the `grpc.StatusCode`
(DESIGN §9) and whose class is also the matching `kvcommon.errors` class, so a caller
may catch `PermissionDenied` or `KvshareError` alike. gRPC statuses and the bulk
channel's error frames (which carry the same codes, `kvcommon.errors`) map through the
same table (`store_error`).
"""

from __future__ import annotations

import grpc

from kvcommon import errors


class BlockStoreError(errors.KvshareError):
    """A failed call. `.code()` is the gRPC status; `.details()` the server's message."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code = code
        self._details = details
        if not isinstance(self, errors.WIRE_ERRORS[1:]):  # a status kvshare never sends
            self.status = code.name

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class StoreUnauthenticated(BlockStoreError, errors.Unauthenticated):
    pass


class StorePermissionDenied(BlockStoreError, errors.PermissionDenied):
    pass


class StoreInvalidArgument(BlockStoreError, errors.InvalidArgument):
    pass


class StoreResourceExhausted(BlockStoreError, errors.ResourceExhausted):
    pass


class StoreUnavailable(BlockStoreError, errors.Unavailable):
    pass


class StoreDataLoss(BlockStoreError, errors.DataLoss):
    pass


_BY_STATUS: dict[str, type[BlockStoreError]] = {
    cls.status: cls
    for cls in (
        StoreUnauthenticated,
        StorePermissionDenied,
        StoreInvalidArgument,
        StoreResourceExhausted,
        StoreUnavailable,
        StoreDataLoss,
    )
}


def store_error(status: grpc.StatusCode | str | int, details: str) -> BlockStoreError:
    """The error of a status: a `grpc.StatusCode`, its name, or its number (the bulk
    channel's error frame)."""
    if isinstance(status, int):
        status = errors.status_name(status)
    code = status if isinstance(status, grpc.StatusCode) else _status_code(status)
    return _BY_STATUS.get(code.name, BlockStoreError)(code, details)


def from_rpc_error(error: grpc.RpcError) -> BlockStoreError:
    code = error.code() if hasattr(error, "code") else grpc.StatusCode.UNKNOWN
    details = error.details() if hasattr(error, "details") else str(error)
    return store_error(code, details or "")


def _status_code(name: str) -> grpc.StatusCode:
    found: grpc.StatusCode = getattr(grpc.StatusCode, name, grpc.StatusCode.INTERNAL)
    return found
