"""Opening sealed blocks as their bytes arrive (`get_views(..., pieces=...)` with
`BlockSealer.opening`): over the sealed channel a block is fed in pieces while the rest
of it is on the wire, so the reader decrypts while the server still sends; over gRPC
and the TLS bulk channel each block is fed whole. Either way the opened bytes are what
`open` gives, a block altered anywhere fails to open and leaves nothing in the caller's
buffer, and a read that broke inside its first block and started over on gRPC opens
that block afresh."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvcommon import bulkio
from kvcommon import bulkwire as w
from policy.sealing import HEADER_BYTES, TAG_BYTES, BlockOpening, BlockSealer, SealError
from replica_agent.client import BlockClient
from tests.support.certs import Certs
from tests.support.isolation import isolation_config
from tests.support.mitm import C2S, FRAME, S2C, SERVER_HELLO, Attack, Cut, Mitm, start_behind
from tests.support.sealed_blocks import CURRENT, MODEL
from tests.support.servers import Running, require_sealed

TIMEOUT_S = 30.0  # only failures wait on it
BIG = 2 * bulkio.FEED_CHUNK_BYTES + 12_345  # a block received in several pieces
SEALER = BlockSealer(CURRENT)


@pytest.fixture
def store(tmp_path: Path, certs: Certs, mitm: Mitm) -> Iterator[Running]:
    running = start_behind(mitm, require_sealed(isolation_config(tmp_path, certs)), certs)
    yield running
    running.stop()


class Block:
    def __init__(self, seed: int, size: int = BIG) -> None:
        self.digest = os.urandom(32)
        self.plaintext = os.urandom(size) if seed >= 0 else bytes(size)
        self.sealed = SEALER.seal("alpha", MODEL, self.digest, self.plaintext)


class Openings:
    """A reader's `pieces`: each block opened into its own buffer as it arrives; the
    calls and the pieces each block was fed in, counted."""

    def __init__(self, digests: list[bytes]) -> None:
        self._digests = digests
        self.calls: list[tuple[int, int]] = []
        self.pieces: dict[int, int] = {}
        self.outs: dict[int, bytearray] = {}
        self._open: dict[int, BlockOpening] = {}

    def sink(self, index: int, size: int) -> Callable[[memoryview], None]:
        self.calls.append((index, size))
        self.pieces[index] = 0
        out = self.outs[index] = bytearray(b"\xaa" * (size - HEADER_BYTES - TAG_BYTES))
        opening = SEALER.opening("alpha", MODEL, self._digests[index], size, out)
        self._open[index] = opening

        def feed(piece: memoryview) -> None:
            self.pieces[index] += 1
            opening.feed(piece)

        return feed

    def finish(self, index: int) -> bytes:
        return bytes(self._open[index].finish())


def put(store: Running, blocks: list[Block]) -> None:
    with store.client("a", transport="grpc", timeout_s=TIMEOUT_S) as client:
        client.put("alpha", MODEL, [b.digest for b in blocks], [b.sealed for b in blocks])


def sealed_client(store: Running) -> BlockClient:
    return store.client("a", transport="bulk-tcp", sealed_channel=True, timeout_s=TIMEOUT_S)


def test_blocks_are_opened_in_pieces_as_they_arrive_over_the_sealed_channel(
    store: Running, mitm: Mitm
) -> None:
    blocks = [Block(seed) for seed in range(3)]
    put(store, blocks)
    digests = [b.digest for b in blocks]
    openings = Openings(digests)
    with sealed_client(store) as client:
        views = client.get_views("alpha", MODEL, digests, pieces=openings.sink)
        assert client.transport_stats.bulk_fallbacks == 0
    assert mitm.connections[0].sent[C2S].startswith(w.MAGIC_SEALED)  # the sealed channel
    assert [bytes(v) for v in views] == [b.sealed for b in blocks]  # the views as before
    assert openings.calls == [(i, len(b.sealed)) for i, b in enumerate(blocks)]
    assert [openings.finish(i) for i in range(3)] == [b.plaintext for b in blocks]
    # Fed in pieces while the rest arrived, not once whole (what gives the overlap).
    assert all(openings.pieces[i] >= 2 for i in range(3)), openings.pieces


def test_a_block_altered_in_the_store_fails_to_open_and_leaves_no_plaintext(
    store: Running,
) -> None:
    good, bad = Block(1), Block(2)
    altered = bytearray(bad.sealed)
    altered[len(altered) // 2] ^= 0x01  # the server cannot tell: it never holds the key
    bad.sealed = bytes(altered)
    put(store, [good, bad])
    openings = Openings([good.digest, bad.digest])
    with sealed_client(store) as client:
        views = client.get_views("alpha", MODEL, [good.digest, bad.digest], pieces=openings.sink)
    assert len(views) == 2
    assert openings.finish(0) == good.plaintext  # positive control
    with pytest.raises(SealError, match=r"^block cannot be opened$"):
        openings.finish(1)
    assert openings.outs[1] == bytes(len(openings.outs[1]))  # decrypted, then zeroed


@pytest.mark.parametrize("transport", ["grpc", "bulk-tcp"])
def test_over_grpc_and_the_tls_bulk_channel_each_block_is_fed_whole(
    store: Running, transport: str
) -> None:
    blocks = [Block(seed) for seed in range(2)]
    put(store, blocks)
    digests = [b.digest for b in blocks]
    openings = Openings(digests)
    with store.client("a", transport=transport, timeout_s=TIMEOUT_S) as client:
        views = client.get_views("alpha", MODEL, digests, pieces=openings.sink)
        assert client.transport_stats.bulk_fallbacks == 0
    assert [bytes(v) for v in views] == [b.sealed for b in blocks]
    assert openings.pieces == {0: 1, 1: 1}
    assert [openings.finish(i) for i in range(2)] == [b.plaintext for b in blocks]


def test_a_read_cut_inside_its_first_block_opens_it_afresh_over_grpc(
    store: Running, mitm: Mitm
) -> None:
    blocks = [Block(seed) for seed in range(2)]
    put(store, blocks)

    def cut_after_some_of_block_0(direction: str, index: int, segment: bytes) -> list[bytes]:
        if direction == S2C and index == 3:
            raise Cut  # 1,000 bytes of block 0 went through: the reader fed them
        return [segment]

    # The reply: the hello, the batch's header, then block 0's first bytes.
    mitm.attacks = [Attack(s2c=[SERVER_HELLO, FRAME, 1000, 1000], tamper=cut_after_some_of_block_0)]
    digests = [b.digest for b in blocks]
    openings = Openings(digests)
    with sealed_client(store) as client:
        views = client.get_views("alpha", MODEL, digests, pieces=openings.sink)
        assert client.transport_stats.bulk_fallbacks == 1
    size = len(blocks[0].sealed)
    assert openings.calls[:2] == [(0, size), (0, size)]  # started over for block 0
    assert [bytes(v) for v in views] == [b.sealed for b in blocks]
    assert [openings.finish(i) for i in range(2)] == [b.plaintext for b in blocks]


def test_a_reader_may_take_a_block_whole(store: Running) -> None:
    blocks = [Block(seed) for seed in range(2)]
    put(store, blocks)
    asked: list[int] = []

    def whole(index: int, size: int) -> None:
        asked.append(index)
        return None

    with sealed_client(store) as client:
        views = client.get_views("alpha", MODEL, [b.digest for b in blocks], pieces=whole)
    assert asked == [0, 1]
    opened = [SEALER.open("alpha", MODEL, b.digest, v) for b, v in zip(blocks, views, strict=True)]
    assert opened == [b.plaintext for b in blocks]
