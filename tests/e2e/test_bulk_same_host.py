"""The bulk channel's same-host transport: payloads through a shared-memory arena.

Every test runs a real server in-process with a real LMDB and talks to it through its
abstract Unix socket, as a replica on the same host does. The policy tests of the bulk
channel (tests/e2e/test_bulk.py) run over both transports.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from cacheserver.config import load_config
from cacheserver.embedded import EmbeddedServer
from kvshare import bulkwire as w
from kvshare.v1 import kvshare_pb2 as pb
from kvshare.v1 import kvshare_pb2_grpc as pb_grpc
from replica_agent.bulk import BulkChannel, _Connection
from replica_agent.client import BlockClient
from tests.conftest import Running, write_config

MODEL = "m;fp32;L2"
MiB = 1 << 20


@contextlib.contextmanager
def serving(tmp_path: Path, bulk: str = "") -> Iterator[Running]:
    """A server from a real TOML config with these `[bulk]` lines."""
    tenancy = write_config(tmp_path, extra=f"[bulk]\n{bulk}" if bulk else "")
    config = load_config(tenancy.path)
    with EmbeddedServer(config) as server:
        yield Running(server.address, config.data_dir, tenancy.tokens)


@pytest.fixture
def small_arena(tmp_path: Path) -> Iterator[Running]:
    """Arenas of 1 MiB, so that ordinary requests must be split."""
    with serving(tmp_path, "arena_bytes = 1048576\n") as running:
        yield running


def open_bulk(running: Running, who: str = "a", tenant: str = "alpha") -> pb.OpenBulkResponse:
    with grpc.insecure_channel(running.address) as channel:
        return pb_grpc.BlockStoreStub(channel).OpenBulk(
            pb.OpenBulkRequest(tenant=tenant),
            timeout=10,
            metadata=(("authorization", f"Bearer {running.tokens[who]}"),),
        )


def local_hello(name: str, ticket: bytes) -> tuple[socket.socket, bytes, list[int]]:
    """Present `ticket` on the same-host listener: the socket, the reply, any fds."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + name)
    sock.sendall(w.HELLO.pack(w.MAGIC, ticket))
    data, fds, _flags, _addr = socket.recv_fds(sock, 64, 1)
    return sock, data, fds


def connections(client: BlockClient) -> list[_Connection]:
    bulk = client._bulk
    assert isinstance(bulk, BulkChannel)
    return list(bulk._all)


def test_a_client_on_the_same_host_moves_payloads_through_the_arena(
    tenant_server: Running,
) -> None:
    digests = [os.urandom(32) for _ in range(5)]
    payloads = [os.urandom(n) for n in (1, 4097, 65536, 2 * MiB, 77)]
    with tenant_server.client("a") as local, tenant_server.client("a", same_host=False) as tcp:
        assert local.put("alpha", MODEL, digests[:3], payloads[:3]) == [True] * 3
        assert tcp.put("alpha", MODEL, digests[3:], payloads[3:]) == [True] * 2
        assert [c.arena is not None for c in connections(local)] == [True]
        assert [c.arena is None for c in connections(tcp)] == [True]
        assert local.put("alpha", MODEL, digests, payloads) == [False] * 5
        for client in (local, tcp):
            assert client.get("alpha", MODEL, digests) == payloads
            assert [bytes(v) for v in client.get_views("alpha", MODEL, digests)] == payloads
            assert [bytes(v) for v in client.iter_views("alpha", MODEL, digests)] == payloads
        missing = [digests[0], os.urandom(32), digests[2]]
        assert local.get("alpha", MODEL, missing) == payloads[:1]  # leading present only
        assert local.lookup("alpha", MODEL, digests) == 5


def test_requests_bigger_than_the_arena_are_split_and_a_bigger_block_goes_over_tcp(
    small_arena: Running,
) -> None:
    digests = [os.urandom(32) for _ in range(9)]
    sizes = [300_000] * 6 + [3 * MiB, 5, 700_000]  # 6 x 300 KB: three arenas' worth
    payloads = [os.urandom(n) for n in sizes]
    with small_arena.client("a") as client:
        assert client.put("alpha", MODEL, digests, payloads) == [True] * 9
        assert client.get("alpha", MODEL, digests) == payloads
        assert [bytes(v) for v in client.get_views("alpha", MODEL, digests)] == payloads
        assert [bytes(v) for v in client.iter_views("alpha", MODEL, digests)] == payloads
        kinds = sorted(c.arena is not None for c in connections(client))
        assert kinds == [False, True]  # the 3 MiB block took a TCP connection beside it
    with small_arena.client("a", bulk=False) as grpc_only:  # what the server holds
        assert grpc_only.get("alpha", MODEL, digests) == payloads


def test_a_stored_block_does_not_follow_later_writes_to_the_arena(
    tenant_server: Running,
) -> None:
    digest, payload = os.urandom(32), os.urandom(MiB)
    with tenant_server.client("a") as client, tenant_server.client("a", bulk=False) as plain:
        assert client.put("alpha", MODEL, [digest], [payload]) == [True]
        (conn,) = connections(client)
        assert conn.arena is not None
        conn.arena[: 2 * MiB] = bytes(2 * MiB)
        assert plain.get("alpha", MODEL, [digest]) == [payload]
        assert client.get("alpha", MODEL, [digest]) == [payload]


def test_the_same_host_listener_takes_only_valid_tickets(tenant_server: Running) -> None:
    response = open_bulk(tenant_server)
    assert response.local_address.startswith("kvshare-bulk-")
    sock, data, fds = local_hello(response.local_address, os.urandom(32))
    with sock:
        assert fds == [] and data[0] == w.STATUS_CODES["UNAUTHENTICATED"]
    sock, data, fds = local_hello(response.local_address, response.ticket)  # positive control
    with sock:
        assert data[:1] == bytes([w.OK]) and len(fds) == 1
        os.close(fds[0])
    sock, data, fds = local_hello(response.local_address, response.ticket)  # used once
    with sock:
        assert fds == [] and data[0] == w.STATUS_CODES["UNAUTHENTICATED"]


def test_a_client_cannot_resize_its_arena_or_reach_past_it(tenant_server: Running) -> None:
    response = open_bulk(tenant_server)
    sock, data, fds = local_hello(response.local_address, response.ticket)
    with sock:
        (fd,) = fds
        try:
            size = w.ARENA_REPLY.unpack(data)[1]
            for new_size in (0, size // 2, size * 2):  # sealed: the server's map never faults
                with pytest.raises(OSError) as info:
                    os.ftruncate(fd, new_size)
                assert info.value.errno == errno.EPERM
        finally:
            os.close(fd)
        model = MODEL.encode()
        request = w.REQUEST.pack(w.OP_PUT, len(model), 2) + model + os.urandom(64)
        sock.sendall(request + w.SIZE.pack(size - 100) + w.SIZE.pack(200))  # past the end
        status, length = w.ERROR.unpack(w.recv_bytes(sock, w.ERROR.size))
        message = w.recv_bytes(sock, length).decode()
        assert status == w.STATUS_CODES["INVALID_ARGUMENT"] and "arena" in message
        assert sock.recv(1) == b""  # the connection is closed
    with tenant_server.client("a") as client:  # the server serves on
        assert client.put("alpha", MODEL, [b"k" * 32], [b"v"]) == [True]


def test_without_room_for_another_arena_a_client_uses_tcp(tmp_path: Path) -> None:
    with serving(tmp_path, "max_arenas = 0\n") as running, running.client("a") as client:
        assert client.put("alpha", MODEL, [b"k" * 32], [b"v" * 100]) == [True]
        assert client.get("alpha", MODEL, [b"k" * 32]) == [b"v" * 100]
        assert [c.arena is None for c in connections(client)] == [True]


def test_an_operator_can_turn_the_same_host_transport_off(tmp_path: Path) -> None:
    with serving(tmp_path, "same_host = false\n") as running:
        assert open_bulk(running).local_address == ""
        with running.client("a") as client:
            assert client.put("alpha", MODEL, [b"k" * 32], [b"v"]) == [True]
            assert [c.arena is None for c in connections(client)] == [True]
