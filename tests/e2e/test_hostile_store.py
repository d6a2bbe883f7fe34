"""A hostile or broken store must not crash the client.

A fake server (real gRPC and a real bulk socket, speaking the wire formats) announces
absurd block sizes. The client answers DATA_LOSS — a KvshareError, which the agent
treats as a miss — instead of letting the size reach an allocation (OverflowError,
MemoryError), which would escape into inference.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import grpc
import pytest

from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.client import BlockClient
from replica_agent.errors import BlockStoreError
from tests.support.fake_store import AnsweringStore, serving
from tests.support.servers import Running

HOSTILE_SIZES = [2**63 + 5, 2**62, 2**40 + 3, (1 << 30) + 1]
MODEL = "m;fp32"


class FakeStore(AnsweringStore):
    """Answers every Get and bulk GET with one block of `size` bytes (announced)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.bulk = socket.create_server(("127.0.0.1", 0))
        threading.Thread(target=self._serve_bulk, daemon=True).start()

    def OpenBulk(self, request: Any, context: Any) -> pb.OpenBulkResponse:
        host, port = self.bulk.getsockname()[:2]
        return pb.OpenBulkResponse(ticket=b"t" * 32, address=f"{host}:{port}", ttl_ms=1000)

    def Get(self, request: Any, context: Any) -> Iterator[pb.GetFrame]:
        chunk = pb.BlockChunk(index=0, block_bytes=self.size, offset=0, data=b"x")
        yield pb.GetFrame(chunks=[chunk])

    def _serve_bulk(self) -> None:
        while True:
            try:
                conn, _ = self.bulk.accept()
            except OSError:
                return
            with conn:
                try:
                    bulkio.recv_bytes(conn, w.HELLO.size)
                    conn.sendall(bytes([w.OK]))
                    _op, model_len, count = w.REQUEST.unpack(
                        bulkio.recv_bytes(conn, w.REQUEST.size)
                    )
                    bulkio.recv_bytes(conn, model_len + 32 * count)
                    conn.sendall(bytes([w.OK]) + w.SIZE.pack(min(self.size, 2**64 - 1)))
                    conn.recv(1)
                except OSError:
                    pass


@pytest.fixture(params=HOSTILE_SIZES)
def fake_store(request: pytest.FixtureRequest) -> Iterator[str]:
    store = FakeStore(int(request.param))
    try:
        with serving(store) as address:
            yield address
    finally:
        store.bulk.close()


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_an_absurd_announced_size_is_data_loss_not_a_crash(fake_store: str, bulk: bool) -> None:
    with BlockClient(fake_store, "token", bulk=bulk, same_host=False, timeout_s=10) as client:
        for read in (client.get, client.get_views, lambda *a: list(client.iter_views(*a))):
            with pytest.raises(BlockStoreError) as info:
                read("t", MODEL, [b"d" * 32])
            assert info.value.code() == grpc.StatusCode.DATA_LOSS
            assert "announced" in info.value.details()
        if bulk:
            assert client.transport_stats.bulk_fallbacks == 0  # the bulk path answered


def test_the_agent_serves_a_miss_from_a_hostile_store(fake_store: str) -> None:
    """End to end: `ReplicaAgent.load` used to raise OverflowError/MemoryError from the
    sizes such a server announces. Now the replica recomputes: a miss, counted."""
    from replica_agent.agent import PrefixMatch, ReplicaAgent
    from replica_agent.spec import ModelSpec

    spec = ModelSpec("m", "r1", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")
    for bulk in (True, False):
        client = BlockClient(fake_store, "token", bulk=bulk, same_host=False, timeout_s=10)
        agent = ReplicaAgent(client, spec)
        try:
            match = PrefixMatch("t", (b"d" * 32,), 1, spec.block_tokens)
            assert agent.load(match).shape[0] == 0  # nothing restored, nothing raised
            assert agent.stats.store_errors == 1
        finally:
            agent.close()


def test_the_agent_serves_a_miss_when_the_client_fails_unexpectedly(
    dev_server: Running, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defense in depth: an error below the agent that is not a store error (a bug) is
    still a miss, never an exception into inference."""
    from replica_agent.agent import ReplicaAgent
    from replica_agent.spec import ModelSpec

    spec = ModelSpec("m", "r1", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")
    agent = ReplicaAgent(dev_server.client(), spec)
    try:
        digests = agent.digests(list(range(2 * spec.block_tokens)))

        def broken(*args: object) -> Iterator[bytes]:
            raise OverflowError("a bug below the agent")

        monkeypatch.setattr(agent.client, "iter_views", broken)
        match = agent.match("dev", digests)  # the real store: a miss, answered
        assert match.blocks == 0
        forced = type(match)("dev", match.digests, 2, spec.block_tokens)
        assert agent.load(forced).shape[0] == 0
        assert agent.stats.store_errors == 1
    finally:
        agent.close()
