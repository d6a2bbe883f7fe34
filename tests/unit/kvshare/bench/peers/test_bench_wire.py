"""The raw-TCP ceiling's protocol and LMCache's header layout, over socket pairs only."""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Iterator

import pytest

from kvshare.bench.buffers import PAGE_BYTES, aligned_buffer, random_value, read_stamp, stamp
from kvshare.bench.peers import lmcache_peer, tcp_wire
from kvshare.bench.peers.tcp import TcpClient
from kvshare.bench.peers.tcp_server import _serve_connection, _Store


@pytest.fixture
def tcp_client() -> Iterator[TcpClient]:
    server_end, client_end = socket.socketpair()
    thread = threading.Thread(target=_serve_connection, args=(server_end, _Store(), None))
    thread.start()
    client = TcpClient(client_end)
    yield client
    client.close()
    thread.join(timeout=5)


def _keys(count: int) -> list[bytes]:
    return [hashlib.sha256(f"k{i}".encode()).digest() for i in range(count)]


def test_put_then_get_returns_the_same_bytes(tcp_client: TcpClient) -> None:
    size = 3 * PAGE_BYTES + 5
    value = memoryview(random_value(size, seed=1))[:size]
    keys = _keys(3)
    for index, key in enumerate(keys):
        stamp(value, index)
        tcp_client.put([key], [value])
    found = tcp_client.get(keys)
    assert [read_stamp(v) for v in found] == [0, 1, 2]
    assert bytes(found[2]) == bytes(value)


def test_get_stops_at_the_first_miss_and_clear_drops_everything(tcp_client: TcpClient) -> None:
    value = memoryview(random_value(100, seed=2))[:100]
    keys = _keys(3)
    tcp_client.put([keys[0]], [value])
    tcp_client.put([keys[2]], [value])
    assert len(tcp_client.get(keys)) == 1
    tcp_client.control(tcp_wire.OP_RESERVE, 4, 100)
    tcp_client.control(tcp_wire.OP_CLEAR)
    assert tcp_client.get(keys) == []


def test_send_buffers_survives_partial_sends() -> None:
    left, right = socket.socketpair()
    left.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    payload = [b"head", bytes(range(256)) * 4096, b"", b"tail"]
    received = bytearray(sum(len(p) for p in payload))
    reader = threading.Thread(target=tcp_wire.recv_exact, args=(right, memoryview(received)))
    reader.start()
    tcp_wire.send_buffers(left, payload)
    reader.join(timeout=10)
    assert bytes(received) == b"".join(payload)
    left.close()
    right.close()


def test_aligned_buffers_are_page_aligned_and_whole_pages() -> None:
    buffer = aligned_buffer(10_000)
    assert len(buffer) == 10_000
    import ctypes

    address = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert address % PAGE_BYTES == 0


def test_lmcache_headers_have_the_servers_sizes() -> None:
    digest = bytes(range(32))
    header = lmcache_peer.pack_request(lmcache_peer.CMD_GET, digest, 0)
    assert len(header) == 186
    assert lmcache_peer.REPLY.size == 36
    key = lmcache_peer.lmcache_key(digest).decode().strip()
    model, world_size, worker_id, chunk_hash, dtype = key.split("@")
    assert int(chunk_hash, 16) == int.from_bytes(digest, "big")
    assert (world_size, worker_id, dtype) == ("1", "0", "uint8")
    assert model


def test_exists_counts_the_leading_keys_held(tcp_client: TcpClient) -> None:
    value = memoryview(random_value(100, seed=3))[:100]
    keys = _keys(4)
    for key in (keys[0], keys[1], keys[3]):
        tcp_client.put([key], [value])
    assert tcp_client.lookup(keys) == 2
    assert tcp_client.lookup(keys[:2]) == 2
    assert tcp_client.lookup([]) == 0


def test_lmcache_lookup_pipelines_one_exist_per_key_and_reads_every_reply() -> None:
    """Against a stand-in for the server: EXIST requests in, header-only replies out
    (200 for the first two keys, 400 after); the client stays in sync for the next."""
    server_end, client_end = socket.socketpair()
    seen: list[int] = []

    def serve(rounds: int) -> None:
        for _ in range(rounds):
            for index in range(3):
                request = bytearray(lmcache_peer.REQUEST.size)
                tcp_wire.recv_exact(server_end, memoryview(request))
                seen.append(lmcache_peer.REQUEST.unpack(request)[0])
                code = lmcache_peer.CODE_SUCCESS if index < 2 else 400
                server_end.sendall(lmcache_peer.REPLY.pack(code, 0, 0, 0, 0, 0, 0, 0, 0))

    thread = threading.Thread(target=serve, args=(2,))
    thread.start()
    client = lmcache_peer.LmcacheClient(client_end)
    try:
        assert client.lookup(_keys(3)) == 2
        assert client.lookup(_keys(3)) == 2
    finally:
        thread.join(timeout=5)
        client.close()
        server_end.close()
    assert seen == [lmcache_peer.CMD_EXIST] * 6


def test_reserve_counts_buffers_not_keys(tcp_client: TcpClient) -> None:
    """16 clients x 1024 PUTs of 64 KiB: a RESERVE past MAX_KEYS_PER_REQUEST is fine."""
    tcp_client.control(tcp_wire.OP_RESERVE, tcp_wire.MAX_KEYS_PER_REQUEST + 1, 1)
    value = memoryview(random_value(100, seed=4))[:100]
    tcp_client.put(_keys(1), [value])
    assert tcp_client.lookup(_keys(1)) == 1


@pytest.mark.parametrize("count", [1, 3, 8])
def test_a_get_reply_starts_its_values_at_a_multiple_of_64_bytes(count: int) -> None:
    """The ceiling must not pay the kernel's slow copies of values that begin 1-31
    bytes into a page (benchmarks/socket_alignment.py): its lengths are padded."""
    server_end, client_end = socket.socketpair()
    thread = threading.Thread(target=_serve_connection, args=(server_end, _Store(), None))
    thread.start()
    try:
        keys, value = _keys(count), bytes(range(256)) * 16
        client = TcpClient(client_end)
        client.put(keys, [memoryview(value)] * count)
        client_end.sendall(tcp_wire.REQUEST.pack(tcp_wire.OP_GET, count, 0) + b"".join(keys))
        reply = b""
        expected = tcp_wire.REPLY.size + tcp_wire.LENGTH.size * count
        start = expected + tcp_wire.padding(count)
        while len(reply) < start + count * len(value):
            reply += client_end.recv(1 << 16)
        assert start % tcp_wire.VALUE_ALIGN == 0
        assert reply[expected:start] == bytes(start - expected)  # the padding, zeros
        assert reply[start : start + len(value)] == value
        assert [bytes(v) for v in client.get(keys)] == [value] * count  # the client reads it
    finally:
        client_end.close()
        thread.join(timeout=5)
