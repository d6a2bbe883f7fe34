"""Call any RPC of the BlockStore service descriptor with a generic stub.

Walking the descriptor (not the hand-written client) means an RPC added to the proto
later is called by these tests too, and fails them until it is given expectations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

from kvcommon.v1 import kvshare_pb2

SERVICE = kvshare_pb2.DESCRIPTOR.services_by_name["BlockStore"]
METHODS = list(SERVICE.methods)


def invoke(
    channel: grpc.Channel,
    method: _descriptor.MethodDescriptor,
    request: Any,
    metadata: tuple[tuple[str, str], ...] = (),
    timeout_s: float = 10,
) -> Any:
    """The response; a list of messages for server-streaming methods."""
    path = f"/{SERVICE.full_name}/{method.name}"
    response_cls = message_factory.GetMessageClass(method.output_type)
    factory: Callable[..., Any]
    if method.client_streaming and method.server_streaming:
        factory = channel.stream_stream
    elif method.client_streaming:
        factory = channel.stream_unary
    elif method.server_streaming:
        factory = channel.unary_stream
    else:
        factory = channel.unary_unary
    rpc: Any = factory(
        path,
        request_serializer=lambda m: m.SerializeToString(),
        response_deserializer=response_cls.FromString,
    )
    arg = iter(request) if method.client_streaming else request
    result = rpc(arg, metadata=metadata, timeout=timeout_s)
    return list(result) if method.server_streaming else result


def bearer(token: str | None) -> tuple[tuple[str, str], ...]:
    return () if token is None else (("authorization", f"Bearer {token}"),)
