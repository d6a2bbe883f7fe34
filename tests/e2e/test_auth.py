"""Authentication on every RPC: a test walks the service descriptor, so no RPC can skip it."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as _descriptor
from google.protobuf import message_factory

from kvcommon.v1 import kvshare_pb2
from tests.support.rpc import invoke
from tests.support.servers import Running

SERVICE = kvshare_pb2.DESCRIPTOR.services_by_name["BlockStore"]


def call_method(
    channel: grpc.Channel,
    method: _descriptor.MethodDescriptor,
    request: Any,
    metadata: tuple[tuple[str, str], ...],
) -> None:
    """Invoke any method of the descriptor with one request message."""
    invoke(channel, method, [request] if method.client_streaming else request, metadata)


ADMIN_ONLY = frozenset({"Reload"})  # RPCs only a principal with `admin` may call


def example_request(method: _descriptor.MethodDescriptor, tenant: str) -> Any:
    """A well-formed request naming `tenant` where the message has such a field."""
    cls = message_factory.GetMessageClass(method.input_type)
    request: Any = cls()
    fields = {f.name for f in method.input_type.fields}
    if "tenant" in fields:
        request.tenant = tenant
    if "digests" in fields:
        request.model = "m"
        request.digests.append(b"\x01" * 32)
    if "header" in fields:
        request.header.tenant = tenant
        request.header.model = "m"
        request.chunks.add(digest=b"\x01" * 32, block_bytes=3, offset=0, data=b"abc")
    return request


def test_the_descriptor_lists_the_rpcs_of_the_contract() -> None:
    assert {m.name for m in SERVICE.methods} >= {"Lookup", "Get", "Put", "Delete", "Stats"}


@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
@pytest.mark.parametrize("credential", ["none", "wrong", "malformed"])
def test_every_method_requires_a_valid_token(
    dev_server: Running, method: Any, credential: str
) -> None:
    metadata = {
        "none": (),
        "wrong": (("authorization", "Bearer not-the-token"),),
        "malformed": (("authorization", dev_server.tokens["dev"]),),  # no "Bearer "
    }[credential]
    with grpc.insecure_channel(dev_server.address) as channel:
        with pytest.raises(grpc.RpcError) as info:
            call_method(channel, method, example_request(method, "dev"), metadata)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # Positive control: the same call with the real token is not refused (Reload,
        # an admin call, gets past authentication to its authorization: the dev
        # principal may read and write, not administer).
        real = (("authorization", f"Bearer {dev_server.tokens['dev']}"),)
        if method.name in ADMIN_ONLY:
            with pytest.raises(grpc.RpcError) as admin:
                call_method(channel, method, example_request(method, "dev"), real)
            assert admin.value.code() == grpc.StatusCode.PERMISSION_DENIED
        else:
            call_method(channel, method, example_request(method, "dev"), real)


def test_reflection_requires_a_token_and_health_does_not(dev_server: Running) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(dev_server.address) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=10
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.ServerReflectionInfo(iter([request]), timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        replies = list(
            stub.ServerReflectionInfo(
                iter([request]),
                timeout=10,
                metadata=(("authorization", f"Bearer {dev_server.tokens['dev']}"),),
            )
        )
        names = {s.name for s in replies[0].list_services_response.service}
        assert SERVICE.full_name in names


def _raw_call(
    channel: grpc.Channel, method: _descriptor.MethodDescriptor, raw: bytes, metadata: Any
) -> grpc.StatusCode:
    """Send `raw` bytes as the request of `method` (no client-side encoding)."""
    path = f"/{SERVICE.full_name}/{method.name}"
    stream_unary: Any = channel.stream_unary(path)
    unary_stream: Any = channel.unary_stream(path)
    unary_unary: Any = channel.unary_unary(path)
    try:
        if method.client_streaming:
            stream_unary(iter([raw]), metadata=metadata, timeout=10)
        elif method.server_streaming:
            list(unary_stream(raw, metadata=metadata, timeout=10))
        else:
            unary_unary(raw, metadata=metadata, timeout=10)
    except grpc.RpcError as error:
        return error.code()
    return grpc.StatusCode.OK


GARBAGE = b"\xff\xff\xff\x0f not a protobuf message"


def test_garbage_is_decoded_only_after_authentication_and_logs_no_traceback(
    dev_server: Running, caplog: pytest.LogCaptureFixture
) -> None:
    """Garbage from a stranger was once decoded before the auth wrapper ran
    (a traceback in the log per call, and no audit record); a malformed message from an
    authenticated caller was INTERNAL with a traceback."""
    token = (("authorization", f"Bearer {dev_server.tokens['dev']}"),)
    with caplog.at_level(logging.INFO), grpc.insecure_channel(dev_server.address) as channel:
        for method in SERVICE.methods:
            assert _raw_call(channel, method, GARBAGE, ()) == grpc.StatusCode.UNAUTHENTICATED
            assert _raw_call(channel, method, GARBAGE, token) == grpc.StatusCode.INVALID_ARGUMENT
        empty = kvshare_pb2.StatsRequest().SerializeToString()  # positive control
        assert _raw_call(channel, SERVICE.methods_by_name["Stats"], empty, token).name == "OK"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    audited = [r for r in caplog.records if r.getMessage() == "audit authn_failure"]
    assert len(audited) == len(SERVICE.methods)  # each stranger's call is on the record


def test_two_authorization_headers_are_refused(dev_server: Running) -> None:
    """With two authorization headers the first one used to win; now neither does."""
    good = ("authorization", f"Bearer {dev_server.tokens['dev']}")
    stats = SERVICE.methods_by_name["Stats"]
    empty = kvshare_pb2.StatsRequest().SerializeToString()
    with grpc.insecure_channel(dev_server.address) as channel:
        assert _raw_call(channel, stats, empty, (good,)) == grpc.StatusCode.OK  # control
        for pair in ((good, ("authorization", "Bearer x")), (("authorization", "x"), good)):
            assert _raw_call(channel, stats, empty, pair) == grpc.StatusCode.UNAUTHENTICATED
