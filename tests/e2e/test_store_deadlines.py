"""A store that answers too slowly holds no call past its deadline (control C67).

A socket timeout bounds one receive; a reply dripped a byte at a time restarts it with
every byte, so a call used to take as long as the store liked (18 s with `timeout_s =
2`), with the breaker closed. Here a hostile store (a fake one: real gRPC, real bulk
sockets over TCP and the same-host arena, the wire formats) and an on-path relay in
front of a real server (tests/support/mitm.py: TLS and the sealed-payload channel) drip
their replies one byte every DRIP_S. With `timeout_s = 1` each call ends
DEADLINE_EXCEEDED within BOUND_S, without a fallback that would double the stall, its
connection is closed, and the gate counts a breaker failure. Each dripped reply is long
enough to take far longer than BOUND_S where the deadline is per receive.
"""

from __future__ import annotations

import fcntl
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvcommon import bulkio, samehost
from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from policy.tickets import local_binding
from replica_agent.agent import PrefixMatch, ReplicaAgent
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.client import BlockClient
from replica_agent.errors import BlockStoreError
from replica_agent.spec import ModelSpec
from tests.support.certs import Certs
from tests.support.fake_store import AnsweringStore, serving
from tests.support.isolation import isolation_config
from tests.support.mitm import Mitm, start_behind
from tests.support.sealed_blocks import MODEL as SEALED_MODEL
from tests.support.sealed_blocks import make_blocks
from tests.support.servers import Running, require_sealed

TIMEOUT_S = 1.0
DRIP_S = 0.5
BOUND_S = 3 * TIMEOUT_S  # generous for a loaded machine; every dripped reply takes > 7 s
MODEL = "m;fp32"
DIGESTS = [bytes([i]) * 32 for i in range(3)]
BLOCK_BYTES = 16
ARENA_BYTES = 1 << 20
SPEC = ModelSpec("m", "r1", num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32")


class DrippingStore(AnsweringStore):
    """Answers every Get and bulk GET correctly, but one byte (or one byte's frame)
    every DRIP_S: on TCP 33 bytes (16.5 s), in the arena's reply 30 bytes (15 s), over
    gRPC 16 frames (8 s)."""

    def __init__(self) -> None:
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.local_name = f"kvshare-drip-{os.getpid()}-{os.urandom(4).hex()}"
        self.local.bind("\0" + self.local_name)
        self.local.listen(8)
        for listener in (self.tcp, self.local):
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def close(self) -> None:
        for listener in (self.tcp, self.local):
            listener.close()

    def OpenBulk(self, request: Any, context: Any) -> pb.OpenBulkResponse:
        ticket = os.urandom(32)
        host, port = self.tcp.getsockname()[:2]
        return pb.OpenBulkResponse(
            ticket=ticket,
            address=f"{host}:{port}",
            ttl_ms=10_000,
            local_address=self.local_name,  # bound as a real server binds it
            local_namespace=local_binding(ticket, samehost.host_namespace(), os.getuid()),
        )

    def Get(self, request: Any, context: Any) -> Iterator[pb.GetFrame]:
        for offset in range(BLOCK_BYTES):
            time.sleep(DRIP_S)
            if not context.is_active():
                return
            chunk = pb.BlockChunk(index=0, block_bytes=BLOCK_BYTES, offset=offset, data=b"x")
            yield pb.GetFrame(chunks=[chunk])

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        local = conn.family == socket.AF_UNIX
        with conn:
            try:
                bulkio.recv_bytes(conn, w.HELLO.size)
                if local:
                    _send_arena(conn)
                else:
                    conn.sendall(bytes([w.OK]))
                while True:
                    _op, model_len, count = w.REQUEST.unpack(
                        bulkio.recv_bytes(conn, w.REQUEST.size)
                    )
                    bulkio.recv_bytes(conn, model_len + 32 * count)
                    for byte in _arena_reply(count) if local else _tcp_reply():
                        time.sleep(DRIP_S)
                        conn.sendall(bytes([byte]))
            except OSError:
                return  # the client gave up and closed


def _tcp_reply() -> bytes:
    return bytes([w.OK]) + w.SIZE.pack(BLOCK_BYTES) + b"x" * BLOCK_BYTES + w.END


def _arena_reply(count: int) -> bytes:
    return bytes([w.OK]) + w.LOCAL_GET.pack(count, 0) + w.SIZE.pack(BLOCK_BYTES) * count


def _send_arena(conn: socket.socket) -> None:
    fd = os.memfd_create("drip-arena", os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, ARENA_BYTES)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        socket.send_fds(conn, [w.ARENA_REPLY.pack(w.OK, ARENA_BYTES)], [fd])
    finally:
        os.close(fd)


@pytest.fixture
def dripping() -> Iterator[str]:
    store = DrippingStore()
    try:
        with serving(store, workers=8) as address:
            yield address
    finally:
        store.close()


TRANSPORTS = {"bulk-tcp": (True, False), "bulk-arena": (True, True), "grpc": (False, False)}


def client_for(address: str, transport: str) -> BlockClient:
    bulk, same_host = TRANSPORTS[transport]
    return BlockClient(address, "token", timeout_s=TIMEOUT_S, bulk=bulk, same_host=same_host)


def timed(action: Callable[[], object]) -> tuple[object, float]:
    started = time.monotonic()
    try:
        result: object = action()
    except BlockStoreError as error:
        result = error
    return result, time.monotonic() - started


def assert_ended_at_its_deadline(client: BlockClient, action: Callable[[], object]) -> None:
    """`action` raised DEADLINE_EXCEEDED within BOUND_S, fell back to nothing, and left
    no bulk connection to be reused."""
    error, seconds = timed(action)
    assert isinstance(error, BlockStoreError), error
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert seconds < BOUND_S, f"the call took {seconds:.1f} s with timeout_s {TIMEOUT_S}"
    assert client.transport_stats.bulk_fallbacks == 0  # the budget was spent: no fallback
    bulk = client._bulk
    assert bulk is None or bulk._all == []  # its stream position is unknown: closed


@pytest.mark.slow
@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_a_dripped_reply_ends_the_call_at_its_deadline(dripping: str, transport: str) -> None:
    for streamed in (False, True):  # a client each: after a stall the next calls use
        with client_for(dripping, transport) as client:  # gRPC for a while

            def read(client: BlockClient = client, streamed: bool = streamed) -> object:
                if streamed:
                    return list(client.iter_views("t", MODEL, DIGESTS))
                return client.get("t", MODEL, DIGESTS)

            assert_ended_at_its_deadline(client, read)


@pytest.mark.parametrize("transport", list(TRANSPORTS))
def test_the_agent_serves_a_miss_at_the_deadline_and_the_breaker_counts_it(
    dripping: str, transport: str
) -> None:
    breaker = CircuitBreaker(failure_threshold=1)
    agent = ReplicaAgent(client_for(dripping, transport), SPEC, breaker=breaker)
    try:
        match = PrefixMatch("t", tuple(DIGESTS), len(DIGESTS), SPEC.block_tokens)
        started = time.monotonic()
        assert agent.load(match).shape[0] == 0  # a miss, nothing raised
        seconds = time.monotonic() - started
        assert seconds < BOUND_S, f"the load took {seconds:.1f} s with timeout_s {TIMEOUT_S}"
        assert agent.stats.store_errors == 1
        assert breaker.state is BreakerState.OPEN  # a slow store is a failing store
    finally:
        agent.close(flush_timeout_s=0)


# -- a relay that drips what a real server sends ---------------------------------------------


@pytest.fixture
def relayed(tmp_path: Path, certs: Certs) -> Iterator[tuple[Running, Mitm]]:
    """A real server over TLS whose bulk address is the relay: tenant alpha requires
    sealed blocks (the sealed-payload channel), beta does not (TLS)."""
    mitm = Mitm()
    running = start_behind(mitm, require_sealed(isolation_config(tmp_path, certs)), certs)
    yield running, mitm
    running.stop()
    mitm.close()


@pytest.mark.parametrize("channel", ["sealed", "tls"])
def test_a_relay_that_drips_a_real_servers_reply_holds_no_call_past_its_deadline(
    relayed: tuple[Running, Mitm], channel: str
) -> None:
    running, mitm = relayed
    who, tenant, model = (
        ("a", "alpha", SEALED_MODEL) if channel == "sealed" else ("b", "beta", MODEL)
    )
    if channel == "sealed":
        block = make_blocks(1, seed=67)[0]
        digest, payload = block.digest, block.sealed
    else:
        digest, payload = os.urandom(32), os.urandom(4096)
    # The connection is set up with time to spare on a loaded machine; then the budget
    # under test applies to the dripped call (a client reads `timeout_s` per call).
    client = running.client(who, transport="bulk-tcp", sealed_channel=True, timeout_s=30)
    with client:
        assert client.put(tenant, model, [digest], [payload]) == [True]
        assert client.get(tenant, model, [digest]) == [payload]  # positive control
        assert client.transport_stats.bulk_fallbacks == 0 and len(mitm.connections) == 1
        client._grpc.timeout_s = TIMEOUT_S
        mitm.drip(count=40, every_s=DRIP_S)  # the reply's first 40 bytes: 20 s
        assert_ended_at_its_deadline(client, lambda: client.get(tenant, model, [digest]))
