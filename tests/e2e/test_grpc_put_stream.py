"""The gRPC Put stream's framing rules: every rule the bulk channel's fixed framing
enforces by construction, the stream enforces explicitly (at most max_digests_per_call
blocks, one header and only in the first frame, no empty chunks)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

import grpc
import pytest

from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from tests.support.servers import Running

MODEL = "put-stream;fp32"


@pytest.fixture
def running(start_server: Callable[..., Running]) -> Running:
    return start_server(extra="[limits]\nmax_digests_per_call = 8\n")


def put(running: Running, frames: Iterable[pb.PutFrame]) -> grpc.StatusCode:
    metadata = (("authorization", f"Bearer {running.tokens['a']}"),)
    with grpc.insecure_channel(running.address) as channel:
        try:
            pb_grpc.BlockStoreStub(channel).Put(iter(list(frames)), timeout=30, metadata=metadata)
        except grpc.RpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def header() -> pb.PutFrame:
    return pb.PutFrame(header=pb.PutHeader(tenant="alpha", model=MODEL))


def block(data: bytes) -> pb.PutFrame:
    chunk = pb.PutChunk(digest=os.urandom(32), block_bytes=len(data), offset=0, data=data)
    return pb.PutFrame(chunks=[chunk])


def test_a_stream_of_more_blocks_than_max_digests_per_call_is_refused(running: Running) -> None:
    """The stream used to have no cap (8,193 blocks were accepted)."""
    assert put(running, [header(), *(block(b"x") for _ in range(8))]) == grpc.StatusCode.OK
    too_many = [header(), *(block(b"x") for _ in range(9))]
    assert put(running, too_many) == grpc.StatusCode.INVALID_ARGUMENT


def test_a_header_in_a_later_frame_is_refused(running: Running) -> None:
    """A second header used to be ignored silently (the blocks went to the first tenant)."""
    second = pb.PutFrame(header=pb.PutHeader(tenant="beta", model=MODEL))
    assert put(running, [header(), block(b"a"), block(b"b")]) == grpc.StatusCode.OK
    assert put(running, [header(), block(b"a"), second, block(b"b")]) == (
        grpc.StatusCode.INVALID_ARGUMENT
    )


def test_empty_chunks_are_refused(running: Running) -> None:
    """Zero-byte chunks at the same offset used to be accepted forever, each one kept
    (14 MiB on the wire grew the server by 174 MiB for a declared 1 KiB block)."""
    digest = os.urandom(32)

    def chunk(offset: int, data: bytes) -> pb.PutFrame:
        return pb.PutFrame(
            chunks=[pb.PutChunk(digest=digest, block_bytes=4, offset=offset, data=data)]
        )

    whole = [header(), chunk(0, b"ab"), chunk(2, b"cd")]
    assert put(running, whole) == grpc.StatusCode.OK  # control: a block in two chunks
    empty = [header(), chunk(0, b"ab"), *(chunk(2, b"") for _ in range(100)), chunk(2, b"cd")]
    assert put(running, empty) == grpc.StatusCode.INVALID_ARGUMENT
