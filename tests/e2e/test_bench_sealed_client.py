"""The bench's sealed client (`kvshare-tls-sealed`) against a real `kvshare serve`: it
seals and opens each block as the agent does, into buffers it keeps from call to call
(BlockSealer.seal_into / open_into), not into fresh memory per block."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvshare.bench.peers.kvshare_peer import KvshareClient, KvshareSystem

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
