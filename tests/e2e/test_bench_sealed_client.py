"""The bench's sealed client (`kvshare-tls-sealed`) against a real `kvshare serve`: it
seals and opens each block as the agent does, into buffers it keeps from call to call
(BlockSealer.seal_into / open_into), not into fresh memory per block."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvshare.bench.peers.kvshare_peer import STREAM_OPEN_MIN_BYTES, KvshareClient, KvshareSystem

SIZE = 256 << 10


@pytest.fixture
def sealed_client(tmp_path: Path) -> Iterator[KvshareClient]:
    system = KvshareSystem(tls=True, sealed=True, same_host=False)
    spec = system.start(tmp_path)
    client = spec.connect()
    try:
        client.prepare(SIZE, 2)
        yield client
        # kvshare-tls-sealed's check: the calls used the sealed channel, none gRPC
        system.clear()
    finally:
        client.close()
        system.stop()


def test_blocks_are_sealed_and_opened_in_kept_buffers_over_the_sealed_channel(
    sealed_client: KvshareClient,
) -> None:
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(3)]
    values = [os.urandom(SIZE) for _ in keys]
    sealed_client.put(keys[:2], [memoryview(v) for v in values[:2]])
    sealed_client.put(keys[2:], [memoryview(values[2])])
    first = sealed_client.get(keys[:2])
    assert [bytes(b) for b in first] == values[:2]
    held = [memoryview(b).obj for b in first]
    assert held[0] is not held[1]  # one buffer per block of a call
    again = sealed_client.get(keys[1:])
    assert [bytes(b) for b in again] == values[1:]
    assert [memoryview(b).obj for b in again] == held  # the same buffers, kept
    assert sealed_client.get([hashlib.sha256(b"absent").digest()]) == []


def test_large_blocks_are_opened_as_they_arrive_and_small_ones_once_in(
    sealed_client: KvshareClient,
) -> None:
    """Blocks from STREAM_OPEN_MIN_BYTES up are opened piece by piece while the rest is
    on the wire (BlockSealer.opening); a smaller one in the same call once it is in."""
    big = STREAM_OPEN_MIN_BYTES + 4097
    keys = [hashlib.sha256(bytes([i])).digest() for i in range(10, 13)]
    values = [os.urandom(big), os.urandom(SIZE), os.urandom(big)]
    sealed_client.put(keys, [memoryview(v) for v in values])
    sealer = sealed_client._sealer
    streamed: list[int] = []
    opening = sealer.opening

    def counted(tenant: str, model: str, digest: bytes, size: int, out: memoryview) -> Any:
        streamed.append(size)
        return opening(tenant, model, digest, size, out)

    sealer.opening = counted
    try:
        got = sealed_client.get(keys)
    finally:
        del sealer.opening
    assert [bytes(b) for b in got] == values
    assert len(streamed) == 2 and all(size > big for size in streamed)  # the large two
    again = sealed_client.get(keys)
    assert [memoryview(b).obj for b in again] == [memoryview(b).obj for b in got]  # kept
