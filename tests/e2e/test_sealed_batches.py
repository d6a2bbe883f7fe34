"""Sealed-channel GET replies with one header per batch (bulkwire.BATCHED, control C50).

A client that OpenBulk told `sealed_batches` flags its sealed GETs BATCHED, and the
server answers each batch of the store's reply (a run of blocks from memory, or one
read of the disk) with ONE sealed header, OK | BATCH(first index, count, final) | each
block's size, then the payloads back to back: a reply from memory is one header to
seal and open for any number of blocks, where it was one per block and one for the end.

Here the wire is read by hand with the connection's keys (the server's own Sender,
mirrored, says what every byte must be), and the real agent restores through a relay
(tests/support/mitm.py) that alters, replays or reorders what it sees: every change to
a header fails authentication and the call falls back to gRPC; a payload changed on
the way fails to open at the agent (its seal names tenant, model, digest and key
version) and is a miss, never wrong KV. A GET that is not flagged (a client from
before) gets the per-block framing byte for byte, and a client whose server does not
announce the batches asks for the per-block framing.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from cacheserver.transport.grpc.service import BlockStoreService, Context
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from policy.bulkchannel import TAG_BYTES, Receiver, Sender, client_side, server_side
from policy.sealing import BlockSealer
from replica_agent.agent import ReplicaAgent
from replica_agent.client import BlockClient
from replica_agent.grpc_calls import GrpcCalls, Ticket
from tests.support.bulk_workers import wait_in_lmdb
from tests.support.certs import Certs
from tests.support.isolation import isolation_config
from tests.support.mitm import (
    C2S,
    CLIENT_HELLO,
    FRAME,
    S2C,
    SERVER_HELLO,
    Attack,
    Mitm,
    Plan,
    flip,
    start_behind,
    untouched,
)
from tests.support.sealed_blocks import CURRENT, MODEL, SPEC, Sealed, make_blocks
from tests.support.servers import Running, Tenancy, launch, require_sealed

TIMEOUT_S = 30.0  # only failures wait on it; generous for a loaded machine
HEADER = 1 + w.BATCH.size  # a batch header's plaintext before its sizes


@pytest.fixture
def tenancy(tmp_path: Path, certs: Certs) -> Tenancy:
    return require_sealed(isolation_config(tmp_path, certs))


@pytest.fixture
def blocks() -> list[Sealed]:
    return make_blocks(3, seed=60)


def put(running: Running, blocks: list[Sealed]) -> None:
    """`blocks` stored over gRPC (TLS, not through any relay), then drained to LMDB and
    kept in memory (the store keeps what it commits hot)."""
    with running.client("a", transport="grpc", timeout_s=TIMEOUT_S) as client:
        client.put("alpha", MODEL, [b.digest for b in blocks], [b.sealed for b in blocks])
    wait_in_lmdb(running)


def open_sealed(running: Running) -> Ticket:
    """OpenBulk over TLS asking for the sealed channel, as the agent asks."""
    tls = running.tls()
    assert tls is not None
    with grpc.secure_channel(running.address, tls.credentials()) as channel:
        calls = GrpcCalls(
            channel, running.address, running.tokens["a"], TIMEOUT_S, 1 << 20, sealed_channel=True
        )
        ticket = calls.open_bulk("alpha")
    assert len(ticket.channel_secret) == 32
    return ticket


@dataclass
class Wire:
    """A sealed-channel connection by hand: the client's two directions, and a twin of
    the server's Sender (the same keys and counter), which says what the server's next
    frames must be, byte for byte."""

    sock: socket.socket
    out: Sender
    replies: Receiver
    twin: Sender

    @classmethod
    def connect(cls, running: Running) -> Wire:
        ticket = open_sealed(running)
        assert running.server.server is not None and running.server.server.bulk is not None
        host, _, port = running.server.server.bulk.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=TIMEOUT_S)
        out, replies = client_side(ticket.channel_secret, ticket.ticket)
        twin, _ = server_side(ticket.channel_secret, ticket.ticket)
        sock.sendall(w.HELLO_SEALED.pack(w.MAGIC_SEALED, ticket.ticket, out.hello_proof()))
        assert bulkio.recv_bytes(sock, 1)[0] == w.OK
        replies.check_hello(bytes(bulkio.recv_bytes(sock, w.PROOF_BYTES)))
        return cls(sock, out, replies, twin)

    def send_get(self, digests: list[bytes], flags: int) -> None:
        model = MODEL.encode()
        header = w.REQUEST.pack(w.OP_GET | flags, len(model), len(digests))
        frames = [self.out.seal_header(header), self.out.seal_header(model + b"".join(digests))]
        self.sock.sendall(b"".join(w.sealed_frame(frame) for frame in frames))

    def send_one_frame(
        self, digests: list[bytes], flags: int, *, op: int = w.OP_GET, count: int | None = None
    ) -> None:
        """A request as ONE frame (header, model, digests); `count`: what the header
        says, when not how many digests there are."""
        model = MODEL.encode()
        counted = len(digests) if count is None else count
        header = w.REQUEST.pack(op | w.ONE_FRAME | flags, len(model), counted)
        self.sock.sendall(w.sealed_frame(self.out.seal_header(header + model + b"".join(digests))))

    def expect(self, plain: bytes) -> None:
        """The server's next frame is `plain` sealed under the next counter, exactly."""
        frame = w.sealed_frame(self.twin.seal_header(plain))
        assert bytes(bulkio.recv_bytes(self.sock, len(frame))) == frame
        assert self.replies.open_header(frame[w.FRAME.size :]) == plain

    def payloads(self, blocks: list[Sealed]) -> None:
        for block in blocks:
            assert bytes(bulkio.recv_bytes(self.sock, len(block.sealed))) == block.sealed

    def close(self) -> None:
        self.sock.close()


def batch(first: int, blocks: list[Sealed], *, final: bool) -> bytes:
    sizes = b"".join(w.SIZE.pack(len(b.sealed)) for b in blocks)
    return bytes([w.OK]) + w.BATCH.pack(first, len(blocks), final) + sizes


def block(index: int, size: int) -> bytes:
    return bytes([w.OK]) + w.BLOCK.pack(index, size)


# -- the framing on the wire -------------------------------------------------------------


def test_a_reply_from_memory_is_one_header_for_all_its_blocks_and_a_miss_one_empty_final(
    tenancy: Tenancy, certs: Certs, blocks: list[Sealed]
) -> None:
    with launch(tenancy, certs) as running:
        put(running, blocks)
        wire = Wire.connect(running)
        try:
            digests = [b.digest for b in blocks]
            wire.send_get(digests, w.BATCHED)
            wire.expect(batch(0, blocks, final=True))  # one header, then every payload
            wire.payloads(blocks)
            # Blocks then a miss: the reply says it is the last where it ends.
            wire.send_get([*digests[:2], os.urandom(32), digests[2]], w.BATCHED)
            wire.expect(batch(0, blocks[:2], final=True))
            wire.payloads(blocks[:2])
            wire.send_get([os.urandom(32), *digests], w.BATCHED)  # a miss from the first
            wire.expect(batch(0, [], final=True))
            # The counters still agree: nothing else was sent in between.
            wire.send_get(digests[1:], w.BATCHED)
            wire.expect(batch(0, blocks[1:], final=True))
            wire.payloads(blocks[1:])
        finally:
            wire.close()


def test_a_reply_from_memory_then_the_disk_is_a_header_per_batch(
    tenancy: Tenancy, certs: Certs, blocks: list[Sealed]
) -> None:
    with launch(tenancy, certs) as before:
        put(before, blocks)
    # Restarted: the blocks are in LMDB only; reading the first brings it to memory.
    with launch(tenancy, certs) as running:
        wire = Wire.connect(running)
        try:
            wire.send_get([blocks[0].digest], w.BATCHED)
            wire.expect(batch(0, blocks[:1], final=True))
            wire.payloads(blocks[:1])
            wire.send_get([b.digest for b in blocks], w.BATCHED)
            wire.expect(batch(0, blocks[:1], final=False))  # memory: more follows
            wire.payloads(blocks[:1])
            wire.expect(batch(1, blocks[1:], final=True))  # read from the disk
            wire.payloads(blocks[1:])
        finally:
            wire.close()


def test_a_reply_that_ends_at_an_unsealed_block_says_so_in_its_last_header(
    tmp_path: Path, certs: Certs, blocks: list[Sealed]
) -> None:
    tenancy = isolation_config(tmp_path, certs)
    plain, plain_digest = os.urandom(len(blocks[0].sealed)), os.urandom(32)
    with launch(tenancy, certs) as before:  # the tenant does not require sealing yet
        with before.client("a", transport="grpc", timeout_s=TIMEOUT_S) as client:
            digests = [blocks[0].digest, plain_digest, blocks[1].digest]
            client.put("alpha", MODEL, digests, [blocks[0].sealed, plain, blocks[1].sealed])
        wait_in_lmdb(before)
    with launch(require_sealed(tenancy), certs) as running:
        wire = Wire.connect(running)
        try:
            wire.send_get(digests, w.BATCHED)
            wire.expect(batch(0, blocks[:1], final=True))  # never the plaintext block
            wire.payloads(blocks[:1])
            wire.send_get(digests[1:], w.BATCHED)
            wire.expect(batch(0, [], final=True))
            wire.send_get([blocks[1].digest], w.BATCHED)  # still in step
            wire.expect(batch(0, blocks[1:2], final=True))
            wire.payloads(blocks[1:2])
        finally:
            wire.close()


def test_a_get_not_flagged_gets_the_per_block_framing_byte_for_byte(
    tenancy: Tenancy, certs: Certs, blocks: list[Sealed]
) -> None:
    """A client from before BATCHED, on the same connection as a flagged GET."""
    with launch(tenancy, certs) as running:
        put(running, blocks)
        assert open_sealed(running).sealed_batches  # the server announces the batches
        wire = Wire.connect(running)
        try:
            digests = [b.digest for b in blocks]
            wire.send_get(digests, w.BATCHED)
            wire.expect(batch(0, blocks, final=True))
            wire.payloads(blocks)
            wire.send_get(digests, 0)
            for index, each in enumerate(blocks):
                wire.expect(block(index, len(each.sealed)))
                wire.payloads([each])
            wire.expect(block(len(blocks), 0))
        finally:
            wire.close()


def test_a_client_reads_a_reply_shorter_than_it_asked_for_kept_or_not(
    tenancy: Tenancy, certs: Certs, mitm: Mitm
) -> None:
    """The header is received as long as it would be with every block asked for in it;
    for a shorter reply what came beyond it is the payloads' first bytes (here, blocks
    of a few dozen bytes: all of them), handed on to them, not read again."""
    digests = [os.urandom(32) for _ in range(3)]
    sealer = BlockSealer(CURRENT)
    tiny = [sealer.seal("alpha", MODEL, d, bytes([n])) for n, d in enumerate(digests)]
    missing = [os.urandom(32) for _ in range(60)]
    assert w.SIZE.size * len(missing) > sum(len(t) for t in tiny)  # all taken early
    with start_behind(mitm, tenancy, certs) as running:
        with running.client("a", transport="grpc", timeout_s=TIMEOUT_S) as writer:
            writer.put("alpha", MODEL, digests, tiny)
        with running.client(
            "a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S
        ) as client:
            for _ in range(2):  # in step after each
                asked = [*digests, *missing]
                assert client.get("alpha", MODEL, asked) == tiny  # kept
                assert [bytes(v) for v in client.iter_views("alpha", MODEL, asked)] == tiny
            assert client.transport_stats.bulk_fallbacks == 0
    # Four replies, each one header and the three payloads.
    reply = header_frame(len(tiny)) + sum(len(t) for t in tiny)
    assert len(mitm.connections[0].sent[S2C]) == SERVER_HELLO + 4 * reply


def test_a_get_in_one_frame_is_admitted_from_its_header_then_read_whole(
    tenancy: Tenancy, certs: Certs, blocks: list[Sealed]
) -> None:
    with launch(tenancy, certs) as running:
        put(running, blocks)
        digests = [b.digest for b in blocks]
        wire = Wire.connect(running)
        try:
            wire.send_one_frame(digests, w.BATCHED)
            wire.expect(batch(0, blocks, final=True))
            wire.payloads(blocks)
            wire.send_one_frame(digests[:1], 0)  # one frame, per-block reply
            wire.expect(block(0, len(blocks[0].sealed)))
            wire.payloads(blocks[:1])
            wire.expect(block(1, 0))
            wire.send_get(digests, w.BATCHED)  # two frames still do
            wire.expect(batch(0, blocks, final=True))
            wire.payloads(blocks)
            # The header is admitted before the model and digests are looked at: a
            # count beyond the limit is refused as such, not as a frame too short.
            wire.send_one_frame(digests[:1], w.BATCHED, count=1 << 30)
            frame = bulkio.recv_frame(wire.sock, 1 + TAG_BYTES, 2048)
            plain = wire.replies.open_header(frame)
            code, _ = w.ERROR.unpack_from(plain)
            assert code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
            assert "max_digests_per_call" in plain[w.ERROR.size :].decode()
            assert wire.sock.recv(1) == b""  # the request was not all answered: closed
        finally:
            wire.close()


@pytest.mark.parametrize(
    "misframed",
    ["fewer digests than counted", "more digests than counted", "a put", "a frame after it"],
)
def test_a_one_frame_request_that_is_not_a_well_formed_get_closes_the_connection(
    tenancy: Tenancy, certs: Certs, blocks: list[Sealed], misframed: str
) -> None:
    with launch(tenancy, certs) as running:
        put(running, blocks)
        digests = [b.digest for b in blocks]
        # Positive control: the same connection's first request, well formed.
        wire = Wire.connect(running)
        try:
            wire.send_one_frame(digests, w.BATCHED)
            wire.expect(batch(0, blocks, final=True))
            wire.payloads(blocks)
            if misframed == "fewer digests than counted":
                wire.send_one_frame(digests[:2], w.BATCHED, count=3)
            elif misframed == "more digests than counted":
                wire.send_one_frame(digests, w.BATCHED, count=2)
            elif misframed == "a put":
                wire.send_one_frame(digests, 0, op=w.OP_PUT)
            else:  # a second request sent before the first was answered
                model = MODEL.encode()
                header = w.REQUEST.pack(w.OP_GET | w.ONE_FRAME, len(model), 1)
                frames = [wire.out.seal_header(header + model + d) for d in digests[:2]]
                wire.sock.sendall(b"".join(w.sealed_frame(f) for f in frames))
            assert wire.sock.recv(1) == b""  # closed, nothing served
        finally:
            wire.close()


def test_a_get_too_long_for_one_frame_is_sent_in_two(
    tenancy: Tenancy, certs: Certs, mitm: Mitm, blocks: list[Sealed]
) -> None:
    asked = [*(b.digest for b in blocks), *(os.urandom(32) for _ in range(600))]
    body = len(MODEL.encode()) + w.DIGEST_BYTES * len(asked)
    assert w.REQUEST.size + body > w.ONE_FRAME_BYTES
    seen: dict[str, list[int]] = {C2S: [], S2C: []}

    def measure(direction: str, index: int, segment: bytes) -> list[bytes]:
        seen[direction].append(len(segment))
        return [segment]

    sizes = [len(b.sealed) for b in blocks]
    reply: Plan = [SERVER_HELLO, FRAME, *sizes]
    with start_behind(mitm, tenancy, certs) as running:
        put(running, blocks)
        mitm.attacks = [Attack(c2s=[CLIENT_HELLO, FRAME, FRAME], s2c=reply, tamper=measure)]
        with running.client(
            "a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S
        ) as client:
            assert client.get("alpha", MODEL, asked) == [b.sealed for b in blocks]
            assert client.get("alpha", MODEL, asked[:3]) == [b.sealed for b in blocks]
            assert client.transport_stats.bulk_fallbacks == 0
    frame = w.FRAME.size + TAG_BYTES
    # The long GET: its header, then its body; its reply one batch header.
    assert seen[C2S] == [CLIENT_HELLO, frame + w.REQUEST.size, frame + body]
    assert seen[S2C] == [SERVER_HELLO, header_frame(3), *sizes]
    # Then the short GET: one frame, header, model and digests together.
    one = frame + w.REQUEST.size + len(MODEL.encode()) + 3 * w.DIGEST_BYTES
    assert len(mitm.connections[0].sent[C2S]) == sum(seen[C2S]) + one


# -- the agent through a relay: headers authenticated, payloads opened ---------------------


def agent_restore(running: Running, blocks: list[Sealed]) -> tuple[torch.Tensor, BlockClient]:
    """The agent's restore of `blocks` over the sealed channel (through the relay the
    server announces), and its client (closed)."""
    client = running.client("a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S)
    agent = ReplicaAgent(client, SPEC, sealer=BlockSealer(CURRENT))
    try:
        return agent.load(agent.match("alpha", [b.digest for b in blocks])), client
    finally:
        agent.close()


def assert_exact(restored: torch.Tensor, blocks: list[Sealed], count: int) -> None:
    """The leading `count` blocks, exactly: a shorter prefix is a miss, never wrong KV."""
    assert restored.shape[0] == count
    for row, each in zip(restored, blocks, strict=False):
        assert torch.equal(row, each.tensor)


def one_batch(blocks: list[Sealed]) -> Attack:
    """A GET of `blocks`, all in memory: the request one frame; segments of the reply 0
    the server's hello, 1 the batch's header, 2 + i payload i."""
    sizes = [len(b.sealed) for b in blocks]
    return Attack(c2s=[CLIENT_HELLO, FRAME], s2c=[SERVER_HELLO, FRAME, *sizes])


# Where a batch header's fields lie in its segment: the frame's length (4 bytes), then
# the ciphertext, byte for byte over the plaintext OK | first | count | final | sizes.
COUNT_AT, FINAL_AT, SIZE_AT = w.FRAME.size + 8, w.FRAME.size + 9, w.FRAME.size + HEADER + 7


def header_frame(count: int) -> int:
    """The length on the wire of a batch header of `count` blocks."""
    return w.FRAME.size + HEADER + w.SIZE.size * count + TAG_BYTES


@pytest.mark.parametrize(
    "position",
    [COUNT_AT, FINAL_AT, SIZE_AT, -1],
    ids=["the count", "the final flag", "a size", "the tag"],
)
def test_a_tampered_batch_header_fails_and_the_call_falls_back_to_grpc(
    tenancy: Tenancy, certs: Certs, mitm: Mitm, blocks: list[Sealed], position: int
) -> None:
    seen: list[bytes] = []

    def tamper(direction: str, index: int, segment: bytes) -> list[bytes]:
        if (direction, index) != (S2C, 1):
            return [segment]
        seen.append(segment)
        return [flip(segment, position)]

    with start_behind(mitm, tenancy, certs) as running:
        put(running, blocks)
        attack = one_batch(blocks)
        attack.tamper = tamper
        mitm.attacks = [attack, one_batch(blocks)]
        restored, client = agent_restore(running, blocks)
        assert_exact(restored, blocks, 3)  # served over gRPC instead
        assert client.transport_stats.bulk_fallbacks == 1
        # Positive control: untouched, the same path restores everything, on a new
        # connection (the one whose header failed was closed).
        restored, client = agent_restore(running, blocks)
        assert_exact(restored, blocks, 3)
        assert client.transport_stats.bulk_fallbacks == 0
    assert len(mitm.connections) == 2
    assert [len(segment) for segment in seen] == [header_frame(3)]  # the one header


def test_a_replayed_batch_header_fails_and_the_call_falls_back_to_grpc(
    tenancy: Tenancy, certs: Certs, mitm: Mitm, blocks: list[Sealed]
) -> None:
    """The second GET's header replaced by the first's (the same blocks, the same
    sizes): only its counter differs, and that is enough."""
    sizes = [len(b.sealed) for b in blocks]
    held: list[bytes] = []

    def replay(direction: str, index: int, segment: bytes) -> list[bytes]:
        if (direction, index) == (S2C, 1):
            held.append(segment)
        return [held[0]] if (direction, index) == (S2C, 5) else [segment]

    frames: Plan = [CLIENT_HELLO, FRAME, FRAME]  # two GETs, one frame each
    with start_behind(mitm, tenancy, certs) as running:
        put(running, blocks)
        digests, payloads = [b.digest for b in blocks], [b.sealed for b in blocks]
        for tamper, fallbacks in ((untouched, 0), (replay, 1)):  # positive control first
            reply: Plan = [SERVER_HELLO, FRAME, *sizes, FRAME, *sizes]
            mitm.attacks = [Attack(c2s=frames, s2c=reply, tamper=tamper)]
            with running.client(
                "a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S
            ) as client:
                assert client.get("alpha", MODEL, digests) == payloads
                assert client.get("alpha", MODEL, digests) == payloads
                assert client.transport_stats.bulk_fallbacks == fallbacks
    assert [len(header) for header in held] == [header_frame(3)]


@pytest.mark.parametrize(
    ("kind", "restored_blocks", "fallbacks"),
    [
        ("untouched", 3, 0),  # positive control: two batches, two headers
        ("the batches swapped", 3, 1),  # the disk batch's header first: its counter fails
        ("the memory batch's final flag set", 3, 1),
        ("a payload of the disk batch altered", 1, 0),  # fails to open: a miss from there
    ],
)
def test_a_reply_of_two_batches_altered_on_the_way_is_refused_or_a_miss(
    tenancy: Tenancy,
    certs: Certs,
    mitm: Mitm,
    blocks: list[Sealed],
    kind: str,
    restored_blocks: int,
    fallbacks: int,
) -> None:
    with launch(tenancy, certs) as before:
        put(before, blocks)
    sizes = [len(b.sealed) for b in blocks]
    held: dict[int, bytes] = {}

    def tamper(direction: str, index: int, segment: bytes) -> list[bytes]:
        """Reply segments: 1 the memory batch's header, 2 its payload, 3 the disk
        batch's header, 4 and 5 its payloads."""
        if direction != S2C:
            return [segment]
        held[index] = segment
        if kind == "the batches swapped" and index in (1, 2, 3, 4):
            return []
        if kind == "the batches swapped" and index == 5:
            return [held[3], held[4], segment, held[1], held[2]]
        if kind == "the memory batch's final flag set" and index == 1:
            return [flip(segment, FINAL_AT)]
        if kind == "a payload of the disk batch altered" and index == 4:
            return [flip(segment, len(segment) // 2)]
        return [segment]

    # Restarted: the blocks are in LMDB only; a read of the first brings it to memory.
    with start_behind(mitm, tenancy, certs) as running:
        with running.client("a", transport="grpc", timeout_s=TIMEOUT_S) as reader:
            assert reader.get("alpha", MODEL, [blocks[0].digest]) == [blocks[0].sealed]
        reply: Plan = [SERVER_HELLO, FRAME, sizes[0], FRAME, *sizes[1:]]
        mitm.attacks = [Attack(c2s=[CLIENT_HELLO, FRAME], s2c=reply, tamper=tamper)]
        restored, client = agent_restore(running, blocks)
        assert_exact(restored, blocks, restored_blocks)
        assert client.transport_stats.bulk_fallbacks == fallbacks
    # The server sent the two batches' headers where the plan read them.
    assert [len(held[1]), len(held[3])] == [header_frame(1), header_frame(2)]


# -- negotiation -------------------------------------------------------------------------


def test_a_client_asks_for_batches_only_from_a_server_that_announces_them(
    tmp_path: Path, certs: Certs, blocks: list[Sealed], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A server from before BATCHED does not set `sealed_batches` (it would refuse the
    flag as an unknown op): the client then reads the per-block framing."""
    sizes = [len(b.sealed) for b in blocks]
    digests, payloads = [b.digest for b in blocks], [b.sealed for b in blocks]
    frame = w.FRAME.size + TAG_BYTES + 1  # a reply header's frame, less its fields
    batched = SERVER_HELLO + frame + w.BATCH.size + w.SIZE.size * len(blocks) + sum(sizes)
    per_block = SERVER_HELLO + (len(blocks) + 1) * (frame + w.BLOCK.size) + sum(sizes)
    original = BlockStoreService.OpenBulk

    async def from_before(
        self: BlockStoreService, request: pb.OpenBulkRequest, context: Context
    ) -> pb.OpenBulkResponse:
        response = await original(self, request, context)
        response.ClearField("sealed_batches")  # as a server without the field answers
        return response

    for announced, expected in ((True, batched), (False, per_block)):
        if not announced:
            monkeypatch.setattr(BlockStoreService, "OpenBulk", from_before)
        directory = tmp_path / str(announced)
        directory.mkdir()
        relay = Mitm()
        try:
            tenancy = require_sealed(isolation_config(directory, certs))
            with start_behind(relay, tenancy, certs) as running:
                put(running, blocks)
                with running.client(
                    "a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S
                ) as client:
                    assert client.get("alpha", MODEL, digests) == payloads
                    assert client.transport_stats.bulk_fallbacks == 0
        finally:
            relay.close()
        assert len(relay.connections[0].sent[S2C]) == expected
