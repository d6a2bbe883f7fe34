"""The wire edge of the server: authentication interceptor and error mapping.

Every RPC of every registered service passes `AuthInterceptor`, which wraps the
handler so that the caller is authenticated through `policy` (one entry point:
`AccessPolicy.authenticate`) before the handler's first line runs, and hands the
principal to the handler through a context variable. Authentication happens inside the
wrapped behaviour rather than in `intercept_service` because only the call's context
carries the verified peer certificate (mTLS); the interceptor sees just the metadata.
Only the standard health check is exempt (load balancers probe it without
credentials). A new RPC therefore cannot skip authentication.

Requests are deserialized inside the wrapper too, after authentication: the handlers are
registered with raw bytes, so a stranger's garbage costs one UNAUTHENTICATED answer and
no decoding (let alone a traceback in the log), and a malformed message from an
authenticated caller is INVALID_ARGUMENT, not an unexpected error. A call with more than
one `authorization` header is refused: which one counts must never be ambiguous.

`KvshareError`s become `context.abort(status, message)` here and nowhere else; any other
exception is a bug, logged with a request id and answered INTERNAL with a fixed message
(`kvcommon.errors.wire_error`, which the bulk listener uses too).

The same wrapper observes the call (ServerTelemetry.rpc): a request id for its log and
audit records, a server span whose parent is the caller's `traceparent` metadata, and
the call's count and latency by method and final status.
"""

from __future__ import annotations

import asyncio
import contextvars
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeAlias, TypeVar

import grpc
from opentelemetry.context import Context

from cacheserver.telemetry import ServerTelemetry
from cacheserver.telemetry_calls import RpcCall
from cacheserver.transport.grpc.open_calls import OpenCalls
from kvcommon.errors import InvalidArgument, KvshareError, Unauthenticated, wire_error
from kvcommon.tracing import context_from_metadata
from policy import AccessPolicy, Principal
from policy.audit import bind_call

UNAUTHENTICATED_METHODS = frozenset(
    {
        "/grpc.health.v1.Health/Check",
        "/grpc.health.v1.Health/Watch",
    }
)
current_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("principal")
T = TypeVar("T")


def _status(error: KvshareError) -> grpc.StatusCode:
    return getattr(grpc.StatusCode, error.status, grpc.StatusCode.INTERNAL)


async def abort_for(
    context: grpc.aio.ServicerContext[Any, Any], error: BaseException, method: str
) -> None:
    """Abort the call with `error`'s status (kvcommon.errors.wire_error: INTERNAL, logged
    with the request id, for anything but a KvshareError).

    The handler's frames are cleared first: the abort chains `error` to grpc's own
    exception, and that chain sits in a reference cycle that only a full garbage
    collection frees, holding every local of the handler meanwhile — a refused Put's
    first frames, up to max_message_bytes each, for as long as a quiet server runs."""
    answer = wire_error(error, method)
    traceback.clear_frames(error.__traceback__)
    await context.abort(_status(answer), str(answer))


async def _authenticate(
    policy: AccessPolicy,
    authorization: tuple[str, ...],
    method: str,
    context: grpc.aio.ServicerContext[Any, Any],
) -> Principal:
    """The caller's principal (also set in `current_principal`), or abort the call.

    Binds the method and peer for the audit log first, so every record of this call
    (authn failure, denial, admin action) names them.
    """
    bind_call(method, context.peer())
    try:
        if len(authorization) > 1:
            raise Unauthenticated("send one authorization header, not several")
        auth_context = _auth_context(context) if policy.reads_certificates else None
        principal = policy.authenticate(authorization[0] if authorization else None, auth_context)
    except KvshareError as error:
        await context.abort(_status(error), str(error))
        raise  # unreachable: abort raises
    current_principal.set(principal)
    return principal


def _auth_context(context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, list[bytes]]:
    raw = context.auth_context() or {}
    return {str(k): [bytes(v) for v in values] for k, values in raw.items()}


@dataclass(frozen=True)
class _Call:
    """What the interceptor learnt of a call from its metadata, for the wrapped behaviour."""

    policy: AccessPolicy
    telemetry: ServerTelemetry
    authorization: tuple[str, ...]  # every `authorization` header the call carried
    parent: Context | None  # the caller's trace context (traceparent)
    method: str
    deserialize: Callable[[bytes], Any] | None  # the handler's request deserializer
    calls: OpenCalls  # the calls in flight, which a live reload may end

    @property
    def name(self) -> str:
        """The method as metrics and spans name it: `kvshare.v1.BlockStore/Get`."""
        return self.method.lstrip("/")

    async def fail(
        self, context: grpc.aio.ServicerContext[Any, Any], error: Exception, observed: RpcCall
    ) -> None:
        """Record the call's status, then abort with it (re-raise an abort)."""
        if isinstance(error, grpc.aio.AbortError):
            code = context.code()
            observed.status = code.name if isinstance(code, grpc.StatusCode) else "UNKNOWN"
            raise error
        observed.status = error.status if isinstance(error, KvshareError) else "INTERNAL"
        await abort_for(context, error, self.method)


def _decode(call: _Call, raw: Any) -> Any:
    """One request message, decoded once the caller is authenticated."""
    if call.deserialize is None:
        return raw
    try:
        return call.deserialize(raw)
    except Exception:  # DecodeError, or a field protobuf refuses (invalid UTF-8)
        raise InvalidArgument(
            "malformed request message; send a valid kvshare.v1 message"
        ) from None


async def _decoded(call: _Call, context: grpc.aio.ServicerContext[Any, Any]) -> AsyncIterator[Any]:
    """A request stream's messages, read with `context.read()` rather than through
    grpc's request iterator: that iterator's closure keeps the last raw message (up to
    max_message_bytes) alive after a refused call, in a pool of them that the garbage
    collector never frees. Here no local outlives the message it was read for."""
    while True:
        raw = await context.read()
        if raw is grpc.aio.EOF:
            return
        message, raw = _decode(call, raw), None
        yield message
        message = None


def _request_of(
    call: _Call, request: Any, streaming: bool, context: grpc.aio.ServicerContext[Any, Any]
) -> Any:
    return _decoded(call, context) if streaming else _decode(call, request)


def _wrap_unary(
    behavior: Callable[..., Awaitable[T]], call: _Call, streaming: bool
) -> Callable[..., Awaitable[T]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> T:
        with call.telemetry.rpc(call.name, call.parent) as observed:
            try:
                principal = await _authenticate(
                    call.policy, call.authorization, call.method, context
                )
                with call.calls.open(principal.name):
                    return await behavior(_request_of(call, request, streaming, context), context)
            except asyncio.CancelledError:
                await _end_if_revoked(call, context, observed)
                raise
            except Exception as exc:
                await call.fail(context, exc, observed)
                raise  # unreachable: abort raises

    return wrapped


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[T]], call: _Call, streaming: bool
) -> Callable[..., AsyncIterator[T]]:
    async def wrapped(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[T]:
        with call.telemetry.rpc(call.name, call.parent, restore_context=False) as observed:
            try:
                principal = await _authenticate(
                    call.policy, call.authorization, call.method, context
                )
                with call.calls.open(principal.name):
                    request_of = _request_of(call, request, streaming, context)
                    async for item in behavior(request_of, context):
                        yield item
            except asyncio.CancelledError:
                await _end_if_revoked(call, context, observed)
                raise
            except Exception as exc:
                await call.fail(context, exc, observed)

    return wrapped


async def _end_if_revoked(
    call: _Call, context: grpc.aio.ServicerContext[Any, Any], observed: RpcCall
) -> None:
    """A cancelled call: when a live reload ended it (OpenCalls.end), abort it with the
    revocation's status; else (the client cancelled) return, and the cancellation goes on."""
    ended = call.calls.ended_with()
    if ended is not None:
        await call.fail(context, ended, observed)


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the stubs


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, policy: AccessPolicy, telemetry: ServerTelemetry | None = None) -> None:
        self._policy = policy
        self._telemetry = telemetry or ServerTelemetry()
        self.calls = OpenCalls()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler | None]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = await continuation(handler_call_details)
        method = str(handler_call_details.method)
        if handler is None or method in UNAUTHENTICATED_METHODS:
            return handler
        metadata = handler_call_details.invocation_metadata or ()
        authorization = tuple(str(v) for k, v in metadata if k == "authorization")
        parent = context_from_metadata(metadata)
        call = _Call(
            self._policy,
            self._telemetry,
            authorization,
            parent,
            method,
            handler.request_deserializer,
            self.calls,
        )
        return _rewrap(handler, call)


def _rewrap(handler: Any, call: _Call) -> Handler:
    """The same handler (a namedtuple) with its one behaviour wrapped, taking raw bytes
    (deserialized by the wrapper once the caller is authenticated)."""
    raw = handler._replace(request_deserializer=None)
    replaced: Handler
    if handler.unary_unary is not None:
        replaced = raw._replace(unary_unary=_wrap_unary(handler.unary_unary, call, False))
    elif handler.stream_unary is not None:
        replaced = raw._replace(stream_unary=_wrap_unary(handler.stream_unary, call, True))
    elif handler.unary_stream is not None:
        replaced = raw._replace(unary_stream=_wrap_stream(handler.unary_stream, call, False))
    else:
        replaced = raw._replace(stream_stream=_wrap_stream(handler.stream_stream, call, True))
    return replaced
