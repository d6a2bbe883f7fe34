"""The sealed-payload bulk channel under a network attacker (control C50).

The production configuration across hosts: TLS, tenant `alpha` requires sealed blocks,
the replica agent seals with its keyring, so OpenBulk (over TLS) grants the sealed
channel: plain TCP, AEAD headers, GMAC-tagged PUT payloads, sealed GET payloads. A
relay on loopback (tests/support/mitm.py) sits where the network is and alters, swaps,
replays, reorders or cuts what it sees. Every case is refused (the call falls back to
gRPC over TLS) or a miss for the agent, never wrong KV; the positive control goes
through the same relay untouched.
"""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import grpc
import pytest
import torch

from cacheserver.config import BulkConfig
from cacheserver.transport.bulk import server_tls_context
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument, Unauthenticated
from policy.sealing import BlockSealer
from replica_agent import codec
from replica_agent.agent import ReplicaAgent
from replica_agent.client import BlockClient
from replica_agent.errors import BlockStoreError
from replica_agent.grpc_calls import GrpcCalls
from tests.support.certs import Certs
from tests.support.isolation import isolation_config
from tests.support.mitm import (
    C2S,
    CLIENT_HELLO,
    FRAME,
    S2C,
    SERVER_HELLO,
    Attack,
    Cut,
    Mitm,
    flip,
    put_plan,
    start_behind,
    untouched,
)
from tests.support.sealed_blocks import CURRENT, MODEL, SPEC, Sealed, make_blocks
from tests.support.servers import Running, launch, require_sealed

TIMEOUT_S = 30.0  # only failures wait on it; generous for a loaded machine


@pytest.fixture
def store(tmp_path: Path, certs: Certs, mitm: Mitm) -> Iterator[Running]:
    running = start_behind(mitm, require_sealed(isolation_config(tmp_path, certs)), certs)
    yield running
    running.stop()


def sealed_client(store: Running) -> BlockClient:
    """A replica on another host that opens every block it reads: the sealed channel."""
    return store.client("a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S)


def grpc_client(store: Running) -> BlockClient:
    return store.client("a", transport="grpc", timeout_s=TIMEOUT_S)


@pytest.fixture
def blocks() -> list[Sealed]:
    return make_blocks(3, seed=50)


def stored(store: Running, blocks: list[Sealed]) -> list[Sealed]:
    with grpc_client(store) as client:  # over TLS, not through the relay
        client.put("alpha", MODEL, [b.digest for b in blocks], [b.sealed for b in blocks])
    return blocks


def restore(store: Running, blocks: list[Sealed]) -> tuple[torch.Tensor, ReplicaAgent]:
    """The agent's restore of `blocks` through the relay (closed after)."""
    agent = ReplicaAgent(sealed_client(store), SPEC, sealer=BlockSealer(CURRENT))
    try:
        return agent.load(agent.match("alpha", [b.digest for b in blocks])), agent
    finally:
        agent.close()


def assert_exact(restored: torch.Tensor, blocks: list[Sealed], count: int) -> None:
    """The leading `count` blocks, exactly: a shorter prefix is a miss, never wrong KV."""
    assert restored.shape[0] == count
    for row, block in zip(restored, blocks, strict=False):
        assert torch.equal(row, block.tensor)


def size(blocks: list[Sealed]) -> int:
    sizes = {len(b.sealed) for b in blocks}
    assert len(sizes) == 1
    return sizes.pop()


def get_plan(blocks: int, size: int) -> Attack:
    """A GET of `blocks` present blocks of `size` bytes, all in memory, as the agent
    asks for it (bulkwire.BATCHED, ONE_FRAME): the client's hello and its one frame
    (header, model and digests); the server's hello, the batch's one header, the
    payloads back to back. Segments of the reply: 0 hello, 1 the header, 2 + i payload i."""
    return Attack(c2s=[CLIENT_HELLO, FRAME], s2c=[SERVER_HELLO, FRAME, *[size] * blocks])


# -- positive control ------------------------------------------------------------------


def test_the_untouched_stream_carries_puts_and_restores_over_the_sealed_channel(
    store: Running, mitm: Mitm, blocks: list[Sealed]
) -> None:
    mitm.attacks = [put_plan(3, size(blocks)), get_plan(3, size(blocks))]
    with sealed_client(store) as client:
        digests = [b.digest for b in blocks]
        assert client.put("alpha", MODEL, digests, [b.sealed for b in blocks]) == [True] * 3
        assert client.transport_stats.bulk_fallbacks == 0
    restored, agent = restore(store, blocks)
    assert_exact(restored, blocks, 3)
    assert agent.client.transport_stats.bulk_fallbacks == 0
    put, get = mitm.connections
    assert put.sent[C2S].startswith(w.MAGIC_SEALED) and get.sent[C2S].startswith(w.MAGIC_SEALED)
    wire = b"".join(bytes(c.sent[d]) for c in mitm.connections for d in (C2S, S2C))
    # Headers are encrypted: no model name, digest or size in clear ...
    assert MODEL.encode() not in wire
    assert not any(b.digest in wire for b in blocks)
    assert w.SIZE.pack(size(blocks)) not in wire
    # ... sealed payloads cross as they are (not encrypted twice), the KV never in clear.
    assert all(b.sealed in get.sent[S2C] and b.sealed in put.sent[C2S] for b in blocks)
    assert not any(codec.encode_block(SPEC, b.tensor)[64:1024] in wire for b in blocks)


def test_an_unexpected_error_is_internal_with_a_request_id_over_the_sealed_channel(
    store: Running, blocks: list[Sealed], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the server (the store raising what no code expects) is a sealed INTERNAL
    error frame with a request id, as over gRPC: no fallback, and the next call works."""
    digests = [b.digest for b in stored(store, blocks)]
    with sealed_client(store) as client:
        monkeypatch.setattr(store.store, "read", _broken)
        with pytest.raises(BlockStoreError) as info:
            client.get("alpha", MODEL, digests)
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert "request id" in info.value.details()
        assert client.transport_stats.bulk_fallbacks == 0
        monkeypatch.undo()
        assert client.get("alpha", MODEL, digests) == [b.sealed for b in blocks]
        assert client.transport_stats.bulk_fallbacks == 0


def _broken(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("a store bug")


# -- the hello ---------------------------------------------------------------------------


@pytest.mark.slow
def test_a_hello_with_a_wrong_proof_is_refused_and_its_ticket_is_not_spent(
    store: Running, mitm: Mitm, blocks: list[Sealed]
) -> None:
    stored(store, blocks)
    attack = get_plan(3, size(blocks))
    attack.tamper = lambda d, i, seg: [flip(seg, CLIENT_HELLO - 1) if (d, i) == (C2S, 0) else seg]
    mitm.attacks = [attack]
    with sealed_client(store) as client:
        assert client.get("alpha", MODEL, [b.digest for b in blocks]) == [b.sealed for b in blocks]
        assert client.transport_stats.bulk_fallbacks == 1  # refused: this call used gRPC
    ticket = bytes(mitm.connections[0].sent[C2S][4:36])
    assert store.server.server is not None
    assert store.server.server.tickets.peek(ticket) is not None  # not redeemed


def test_a_ticket_read_off_the_wire_opens_nothing_and_a_replayed_hello_is_refused(
    store: Running, mitm: Mitm, blocks: list[Sealed]
) -> None:
    stored(store, blocks)
    bulk = _bulk_address(store)
    attempts: list[int] = []

    def steal(direction: str, index: int, segment: bytes) -> list[bytes]:
        if (direction, index) == (C2S, 0):  # present the ticket first, without the secret
            forged = segment[: CLIENT_HELLO - 16] + os.urandom(16)
            attempts.append(_hello_status(bulk, forged))
        return [segment]

    attack = get_plan(3, size(blocks))
    attack.tamper = steal
    mitm.attacks = [attack]
    with sealed_client(store) as client:
        assert client.get("alpha", MODEL, [b.digest for b in blocks]) == [b.sealed for b in blocks]
        assert client.transport_stats.bulk_fallbacks == 0  # the real client still got in
    assert attempts == [Unauthenticated.wire_code]
    genuine = bytes(mitm.connections[0].sent[C2S][:CLIENT_HELLO])
    assert _hello_status(bulk, genuine) == Unauthenticated.wire_code  # one-time ticket


def test_an_impostor_on_the_bulk_port_gets_the_hello_and_nothing_more(
    tmp_path: Path, certs: Certs, blocks: list[Sealed]
) -> None:
    impostor = socket.create_server(("127.0.0.1", 0))
    received = bytearray()

    def answer() -> None:  # says OK, but cannot prove the secret
        conn, _ = impostor.accept()
        with conn:
            received.extend(bulkio.recv_bytes(conn, CLIENT_HELLO))
            conn.sendall(bytes([w.OK]) + os.urandom(SERVER_HELLO - 1))
            conn.settimeout(1.0)
            try:
                while chunk := conn.recv(4096):
                    received.extend(chunk)
            except OSError:
                pass

    listening = threading.Thread(target=answer, daemon=True)
    listening.start()
    advertise = f"127.0.0.1:{impostor.getsockname()[1]}"
    tenancy = require_sealed(isolation_config(tmp_path, certs))
    with launch(tenancy, certs, bulk=BulkConfig(advertise=advertise)) as running:
        stored(running, blocks)
        with sealed_client(running) as client:
            digests = [b.digest for b in blocks]
            assert client.get("alpha", MODEL, digests) == [b.sealed for b in blocks]
            assert client.transport_stats.bulk_fallbacks == 1
    listening.join(timeout=10)
    impostor.close()
    assert len(received) == CLIENT_HELLO  # no request reached it


# -- requests and PUT payloads -------------------------------------------------------------


def test_a_tampered_request_frame_is_refused_and_the_restore_is_still_exact(
    store: Running, mitm: Mitm, blocks: list[Sealed]
) -> None:
    stored(store, blocks)
    attack = get_plan(3, size(blocks))
    # The request's one frame: header, model and digests (inside the first digest).
    attack.tamper = lambda d, i, seg: [flip(seg, -16 - 32 * 3 + 8) if (d, i) == (C2S, 1) else seg]
    mitm.attacks = [attack]
    restored, agent = restore(store, blocks)
    assert agent.client.transport_stats.bulk_fallbacks == 1
    assert_exact(restored, blocks, 3)


@pytest.mark.parametrize("segment", [5, 6], ids=["payload", "tag"])
def test_a_tampered_put_payload_is_never_stored(store: Running, mitm: Mitm, segment: int) -> None:
    first, second = make_blocks(2, seed=51)
    attack = put_plan(2, len(first.sealed))
    attack.tamper = lambda d, i, seg: [flip(seg, 7) if (d, i) == (C2S, segment) else seg]
    mitm.attacks = [attack]
    digests, payloads = [first.digest, second.digest], [first.sealed, second.sealed]
    with sealed_client(store) as client:
        client.put("alpha", MODEL, digests, payloads)
        assert client.transport_stats.bulk_fallbacks == 1  # refused: put again over gRPC
    with grpc_client(store) as reader:
        assert reader.get("alpha", MODEL, digests) == payloads


def test_put_payloads_swapped_between_blocks_are_refused(store: Running, mitm: Mitm) -> None:
    first, second = make_blocks(2, seed=52)
    held: list[bytes] = []

    def swap(direction: str, index: int, segment: bytes) -> list[bytes]:
        if direction != C2S or index not in (3, 4, 5, 6):
            return [segment]
        held.append(segment)
        return [held[2], held[3], held[0], held[1]] if index == 6 else []

    attack = put_plan(2, len(first.sealed))
    attack.tamper = swap
    mitm.attacks = [attack]
    digests, payloads = [first.digest, second.digest], [first.sealed, second.sealed]
    with sealed_client(store) as client:
        client.put("alpha", MODEL, digests, payloads)
        assert client.transport_stats.bulk_fallbacks == 1
    with grpc_client(store) as reader:
        assert reader.get("alpha", MODEL, digests) == payloads


# -- GET replies -------------------------------------------------------------------------------


def _reply_attack(blocks: list[Sealed], kind: str) -> Attack:
    """Segments of a reply: 1 the batch's header, 2 + i payload i."""
    attack = get_plan(3, size(blocks))
    held: dict[int, bytes] = {}

    def tamper(direction: str, index: int, segment: bytes) -> list[bytes]:
        if direction != S2C:
            return [segment]
        held[index] = segment
        if kind == "flip payload 1" and index == 3:
            return [flip(segment, len(segment) // 2)]
        if kind == "swap payloads 0 and 1" and index == 2:
            return []
        if kind == "swap payloads 0 and 1" and index == 3:
            return [segment, held[2]]
        if kind == "replay payload 0 as payload 1" and index == 3:
            return [held[2]]
        if kind == "flip the header" and index == 1:
            return [flip(segment, len(segment) // 2)]
        if kind == "cut inside block 1" and index == 3:
            raise Cut
        return [segment]

    attack.tamper = tamper
    return attack


@pytest.mark.parametrize(
    ("kind", "restored_blocks", "fallbacks"),
    [
        ("flip payload 1", 1, 0),  # the seal fails to open: a miss from block 1
        ("swap payloads 0 and 1", 0, 0),  # the seal names the digest: a miss from block 0
        ("replay payload 0 as payload 1", 1, 0),  # the seal names the digest
        ("flip the header", 3, 1),  # the header fails: gRPC serves it all
        ("cut inside block 1", 1, 0),  # no authenticated end: what arrived, checked
    ],
)
def test_a_tampered_reply_is_a_miss_never_wrong_kv(
    store: Running,
    mitm: Mitm,
    blocks: list[Sealed],
    kind: str,
    restored_blocks: int,
    fallbacks: int,
) -> None:
    stored(store, blocks)
    mitm.attacks = [_reply_attack(blocks, kind)]
    restored, agent = restore(store, blocks)
    assert_exact(restored, blocks, restored_blocks)
    assert agent.client.transport_stats.bulk_fallbacks == fallbacks
    # Positive control: the same agent path, untouched, restores everything.
    mitm.attacks = [Attack(tamper=untouched)]
    assert_exact(restore(store, blocks)[0], blocks, 3)


def test_a_block_stored_before_the_tenant_required_sealing_is_never_sent_in_clear(
    tmp_path: Path, certs: Certs
) -> None:
    tenancy = isolation_config(tmp_path, certs)
    sealed = make_blocks(1, seed=53)[0]
    plain, plain_digest = os.urandom(4096), os.urandom(32)
    with launch(tenancy, certs) as before, grpc_client(before) as client:  # not required yet
        client.put("alpha", MODEL, [sealed.digest, plain_digest], [sealed.sealed, plain])
    relay = Mitm()
    try:
        with start_behind(relay, require_sealed(tenancy), certs) as after:
            with sealed_client(after) as client:
                got = client.get("alpha", MODEL, [sealed.digest, plain_digest])
                assert client.transport_stats.bulk_fallbacks == 0
            with grpc_client(after) as over_tls:  # TLS still serves what is stored
                assert over_tls.get("alpha", MODEL, [plain_digest]) == [plain]
    finally:
        relay.close()
    assert got == [sealed.sealed]  # the plaintext block is a miss on this channel
    assert plain[:256] not in bytes(relay.connections[0].sent[S2C])


# -- who gets the channel --------------------------------------------------------------------


def _secret(running: Running, tenant: str, *, ask: bool = True) -> bytes:
    tls = running.tls()
    target = running.address
    channel = (
        grpc.secure_channel(target, tls.credentials())
        if tls is not None
        else grpc.insecure_channel(target)
    )
    with channel:
        calls = GrpcCalls(
            channel, target, running.tokens["root"], TIMEOUT_S, 1 << 20, sealed_channel=ask
        )
        return calls.open_bulk(tenant).channel_secret


def test_the_channel_is_granted_only_over_tls_and_only_to_tenants_that_require_sealing(
    store: Running, tmp_path: Path
) -> None:
    assert len(_secret(store, "alpha")) == 32  # TLS, require_sealed
    assert _secret(store, "beta") == b""  # TLS, sealing not required: TLS bulk channel
    assert _secret(store, "alpha", ask=False) == b""  # not asked: a caller that may not open
    plaintext = tmp_path / "plaintext"
    plaintext.mkdir()
    with launch(require_sealed(isolation_config(plaintext))) as insecure:
        assert _secret(insecure, "alpha") == b""  # the secret only ever crosses TLS


def _bulk_address(running: Running) -> tuple[str, int]:
    assert running.server.server is not None and running.server.server.bulk is not None
    host, _, port = running.server.server.bulk.address.rpartition(":")
    return host, int(port)


def _hello_status(address: tuple[str, int], hello: bytes) -> int:
    """The status a plain-TCP hello gets from the bulk listener (0: OK)."""
    with socket.create_connection(address, timeout=TIMEOUT_S) as sock:
        sock.sendall(hello)
        return int(bulkio.recv_bytes(sock, 1)[0])


def test_the_tls_listener_refuses_a_clear_ticket_and_a_sealed_hello_without_a_secret(
    store: Running,
) -> None:
    bulk = _bulk_address(store)
    with BlockClient(store.address, store.tokens["b"], tls=store.tls(), timeout_s=TIMEOUT_S) as b:
        tls_ticket = b._grpc.open_bulk("beta").ticket  # no secret: beta does not require sealing
    hello = w.HELLO.pack(w.MAGIC, tls_ticket)
    assert _hello_status(bulk, hello) == InvalidArgument.wire_code  # the listener speaks TLS
    forged = w.HELLO_SEALED.pack(w.MAGIC_SEALED, tls_ticket, os.urandom(16))
    assert _hello_status(bulk, forged) == Unauthenticated.wire_code


def test_on_the_servers_host_the_arena_is_used_as_before(store: Running, mitm: Mitm) -> None:
    """C30 unchanged: a same-host client with a keyring still gets the arena, not TCP."""
    block = make_blocks(1, seed=54)[0]
    # The client's default on its server's host (named: KVSHARE_TEST_BULK_WORKERS makes
    # the test clients default to TCP).
    with store.client(
        "a", transport="bulk-same-host", sealed_channel=True, timeout_s=TIMEOUT_S
    ) as client:
        assert client.put("alpha", MODEL, [block.digest], [block.sealed]) == [True]
        assert client.get("alpha", MODEL, [block.digest]) == [block.sealed]
        assert store.server.server is not None and store.server.server.bulk is not None
        assert store.server.server.bulk.arenas == 1
    assert mitm.connections == []  # nothing went over TCP


def test_tenants_without_sealing_keep_tls_on_the_bulk_channel_with_kernel_tls_asked_for(
    store: Running, mitm: Mitm, certs: Certs
) -> None:
    """beta does not require sealed blocks: its bulk connection is TLS (kTLS where the
    kernel has the `tls` module; OpenSSL falls back to user space where it has not)."""
    digest, payload = os.urandom(32), os.urandom(50_000)
    with store.client("b", transport="bulk-tcp", sealed_channel=True) as client:
        assert client.put("beta", MODEL, [digest], [payload]) == [True]
        assert client.get("beta", MODEL, [digest]) == [payload]
        assert client.transport_stats.bulk_fallbacks == 0
    for connection in mitm.connections:
        assert connection.sent[C2S][0] == w.TLS_RECORD_HANDSHAKE
        assert payload[:64] not in connection.sent[C2S]
    tls = store.tls()
    assert tls is not None and tls.ssl_context().options & bulkio.SSL_OP_ENABLE_KTLS
    server = server_tls_context(certs.server.cert.read_bytes(), certs.server.key.read_bytes(), None)
    assert server.options & bulkio.SSL_OP_ENABLE_KTLS


def test_a_connection_that_used_up_its_keys_is_replaced_and_no_call_goes_wrong(
    store: Running, blocks: list[Sealed], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No nonce may repeat under a key: a connection ends after its last header (here
    after 6 instead of 2^32), and the calls go on, right, over a new one or gRPC."""
    from policy import bulkchannel

    stored(store, blocks)
    monkeypatch.setattr(bulkchannel, "MAX_HEADERS_PER_CONNECTION", 6)
    digests, payloads = [b.digest for b in blocks], [b.sealed for b in blocks]
    with sealed_client(store) as client:
        for _ in range(4):
            assert client.get("alpha", MODEL, digests[:1]) == payloads[:1]
            assert client.put("alpha", MODEL, digests[1:], payloads[1:]) == [False, False]
        assert client.transport_stats.bulk_fallbacks >= 1  # the used-up connection ended
