"""The bulk channel's grant, as a client asks for it over gRPC (OpenBulk)."""

from __future__ import annotations

import grpc

from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from tests.support.servers import Running

MODEL = "m;fp32;L2"


def open_bulk(running: Running, who: str, tenant: str) -> pb.OpenBulkResponse:
    with grpc.insecure_channel(running.address) as channel:
        return pb_grpc.BlockStoreStub(channel).OpenBulk(
            pb.OpenBulkRequest(tenant=tenant),
            timeout=10,
            metadata=(("authorization", f"Bearer {running.tokens[who]}"),),
        )
