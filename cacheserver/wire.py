"""The wire edge of the server: authentication interceptor and error mapping.

Every RPC of every registered service passes `AuthInterceptor`, which authenticates the
caller through `policy` before the handler runs and hands the principal to the handler
through a context variable. Only the standard health check is exempt (load balancers
probe it without credentials). A new RPC therefore cannot skip authentication.

`KvshareError`s become `context.abort(status, message)` here and nowhere else; any other
exception is a bug, logged with a request id and answered INTERNAL with a fixed message.
"""

from __future__ import annotations

import contextvars
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeAlias, TypeVar

import grpc

from kvshare.errors import KvshareError
from policy import AccessPolicy, Principal

log = logging.getLogger(__name__)
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
    if isinstance(error, KvshareError):
        await context.abort(_status(error), str(error))
    request_id = uuid.uuid4().hex[:12]
    log.error(
        "internal error in %s (request id %s)",
        method,
        request_id,
        exc_info=(type(error), error, error.__traceback__),
    )
    await context.abort(grpc.StatusCode.INTERNAL, f"internal error (request id {request_id})")


def _wrap_unary(
    behavior: Callable[..., Awaitable[T]],
    principal: Principal | None,
    error: KvshareError | None,
    method: str,
) -> Callable[..., Awaitable[T]]:
    async def wrapped(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> T:
        if error is not None:
            await context.abort(_status(error), str(error))
        assert principal is not None
        current_principal.set(principal)
        try:
            return await behavior(request, context)
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_for(context, exc, method)
            raise  # unreachable: abort raises

    return wrapped


def _wrap_stream(
    behavior: Callable[..., AsyncIterator[T]],
    principal: Principal | None,
    error: KvshareError | None,
    method: str,
) -> Callable[..., AsyncIterator[T]]:
    async def wrapped(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[T]:
        if error is not None:
            await context.abort(_status(error), str(error))
        assert principal is not None
        current_principal.set(principal)
        try:
            async for item in behavior(request, context):
                yield item
        except Exception as exc:
            if isinstance(exc, grpc.aio.AbortError):
                raise
            await abort_for(context, exc, method)

    return wrapped


Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"  # generic only in the stubs


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, policy: AccessPolicy) -> None:
        self._policy = policy

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
        authorization = next((str(v) for k, v in metadata if k == "authorization"), None)
        principal: Principal | None = None
        error: KvshareError | None = None
        try:
            principal = self._policy.authenticate(authorization)
        except KvshareError as exc:
            error = exc
        return _rewrap(handler, principal, error, method)


def _rewrap(
    handler: Any, principal: Principal | None, error: KvshareError | None, method: str
) -> Handler:
    """The same handler (a namedtuple) with its one behaviour wrapped."""
    replaced: Handler
    if handler.unary_unary is not None:
        replaced = handler._replace(
            unary_unary=_wrap_unary(handler.unary_unary, principal, error, method)
        )
    elif handler.stream_unary is not None:
        replaced = handler._replace(
            stream_unary=_wrap_unary(handler.stream_unary, principal, error, method)
        )
    elif handler.unary_stream is not None:
        replaced = handler._replace(
            unary_stream=_wrap_stream(handler.unary_stream, principal, error, method)
        )
    else:
        replaced = handler._replace(
            stream_stream=_wrap_stream(handler.stream_stream, principal, error, method)
        )
    return replaced
