"""A fake block store on loopback: real gRPC, a servicer a test writes its answers into."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent import futures
from typing import Any

import grpc

from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc


class AnsweringStore(pb_grpc.BlockStoreServicer):
    """Says every block is present and takes every write; subclasses choose what a read
    returns."""

    def Lookup(self, request: Any, context: Any) -> pb.LookupResponse:
        return pb.LookupResponse(present=len(request.digests))

    def Put(self, request_iterator: Any, context: Any) -> pb.PutResponse:
        return pb.PutResponse()

    def Delete(self, request: Any, context: Any) -> pb.DeleteResponse:
        return pb.DeleteResponse()

    def Stats(self, request: Any, context: Any) -> pb.StatsResponse:
        return pb.StatsResponse()

    def Reload(self, request: Any, context: Any) -> pb.ReloadResponse:
        return pb.ReloadResponse()


@contextlib.contextmanager
def serving(store: pb_grpc.BlockStoreServicer, workers: int = 4) -> Iterator[str]:
    """`store` as a gRPC server on loopback; its address."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pb_grpc.add_BlockStoreServicer_to_server(store, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(0)
