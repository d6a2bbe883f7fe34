"""The client's assembly of a Get stream's chunks into blocks (no server): a reply that
does not add up is DATA_LOSS, a store failure the gate's breaker counts, never a
shorter prefix that would look like an answer."""

from __future__ import annotations

import grpc
import pytest

from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.errors import BlockStoreError
from replica_agent.grpc_calls import _assembled


def chunk(index: int, block_bytes: int, offset: int, data: bytes) -> pb.BlockChunk:
    return pb.BlockChunk(index=index, block_bytes=block_bytes, offset=offset, data=data)


def frames(*chunks: pb.BlockChunk) -> list[pb.GetFrame]:
    return [pb.GetFrame(chunks=[c]) for c in chunks]


def test_blocks_whole_or_in_pieces_are_assembled_in_order() -> None:
    stream = frames(
        chunk(0, 3, 0, b"abc"),
        chunk(1, 5, 0, b"de"),
        chunk(1, 5, 2, b"fgh"),
        chunk(2, 0, 0, b""),
    )
    assert list(_assembled(iter(stream))) == [b"abc", b"defgh", b""]


@pytest.mark.parametrize(
    "stream",
    [
        frames(chunk(1, 3, 0, b"abc")),  # out of order
        frames(chunk(0, 5, 2, b"abc")),  # no start
        frames(chunk(0, 5, 0, b"ab"), chunk(0, 5, 3, b"de")),  # a gap
        frames(chunk(0, 5, 0, b"ab"), chunk(0, 5, 1, b"bc")),  # an overlap
        frames(chunk(0, 5, 0, b"ab"), chunk(0, 5, 2, b"cdefg")),  # past the block's end
        frames(chunk(0, 5, 0, b"ab"), chunk(0, 9, 2, b"cde")),  # the size changed
        frames(chunk(0, 5, 0, b"ab")),  # the stream ended inside the block
        frames(chunk(0, 2**40, 0, b"ab")),  # a size no block has
    ],
    ids=["order", "start", "gap", "overlap", "overrun", "resized", "cut", "absurd"],
)
def test_a_stream_that_does_not_add_up_is_data_loss(stream: list[pb.GetFrame]) -> None:
    with pytest.raises(BlockStoreError) as info:
        list(_assembled(iter(stream)))
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
