"""The bulk channel's same-host transport: payloads through a shared-memory arena.

Every test runs a real server in-process with a real LMDB and talks to it through its
abstract Unix socket, as a replica on the same host does. The policy tests of the bulk
channel (tests/e2e/test_bulk.py) run over both transports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import mmap
import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from cacheserver.telemetry import ServerTelemetry
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import InvalidArgument, Unauthenticated
from kvcommon.samehost import host_namespace
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from policy.tickets import local_binding
from replica_agent.bulk import BulkChannel
from replica_agent.bulk_connect import Connection
from replica_agent.client import BlockClient
from replica_agent.deadline import CallDeadline
from replica_agent.grpc_calls import Ticket
from tests.support.servers import Running, launch, write_config

MODEL = "m;fp32;L2"
MiB = 1 << 20


@contextlib.contextmanager
def serving(tmp_path: Path, bulk: str = "") -> Iterator[Running]:
    """A server from a real TOML config with these `[bulk]` lines."""
    tenancy = write_config(tmp_path, extra=f"[bulk]\n{bulk}" if bulk else "")
    with launch(tenancy) as running:
        yield running


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


def connections(client: BlockClient) -> list[Connection]:
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
        assert fds == [] and data[0] == Unauthenticated.wire_code
    sock, data, fds = local_hello(response.local_address, response.ticket)  # positive control
    with sock:
        assert data[:1] == bytes([w.OK]) and len(fds) == 1
        os.close(fds[0])
    sock, data, fds = local_hello(response.local_address, response.ticket)  # used once
    with sock:
        assert fds == [] and data[0] == Unauthenticated.wire_code


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
        status, length = w.ERROR.unpack(bulkio.recv_bytes(sock, w.ERROR.size))
        message = bulkio.recv_bytes(sock, length).decode()
        assert status == InvalidArgument.wire_code and "arena" in message
        assert sock.recv(1) == b""  # the connection is closed
    with tenant_server.client("a") as client:  # the server serves on
        assert client.put("alpha", MODEL, [b"k" * 32], [b"v"]) == [True]


def test_without_room_for_another_arena_a_client_uses_tcp(tmp_path: Path) -> None:
    with serving(tmp_path, "max_arenas = 0\n") as running, running.client("a") as client:
        assert client.put("alpha", MODEL, [b"k" * 32], [b"v" * 100]) == [True]
        assert client.get("alpha", MODEL, [b"k" * 32]) == [b"v" * 100]
        assert [c.arena is None for c in connections(client)] == [True]


def test_one_principal_cannot_hold_every_arena(tmp_path: Path) -> None:
    """Arenas hold memory, so their number is capped; one principal may hold only its
    share (`max_arenas_per_principal`), or its connections alone could push every
    other principal's same-host replicas to TCP."""
    bulk = "max_arenas = 4\nmax_arenas_per_principal = 1\n"
    with (
        serving(tmp_path, bulk) as running,
        running.client("a") as first,
        running.client("a") as second,
    ):
        for client in (first, second):
            assert client.put("alpha", MODEL, [b"k" * 32], [b"v" * 100]) is not None
        assert [c.arena is not None for c in connections(first)] == [True]
        assert [c.arena is None for c in connections(second)] == [True]  # TCP instead
        assert second.get("alpha", MODEL, [b"k" * 32]) == [b"v" * 100]
        with running.client("b") as other:  # another principal still gets its own
            assert other.put("beta", MODEL, [b"k" * 32], [b"v"]) == [True]
            assert [c.arena is not None for c in connections(other)] == [True]


def test_an_operator_can_turn_the_same_host_transport_off(tmp_path: Path) -> None:
    with serving(tmp_path, "same_host = false\n") as running:
        assert open_bulk(running).local_address == ""
        with running.client("a") as client:
            assert client.put("alpha", MODEL, [b"k" * 32], [b"v"]) == [True]
            assert [c.arena is None for c in connections(client)] == [True]


class Impostor:
    """A listener on an abstract socket that answers the handshake as a server would,
    and records what reached it: what a client in another network namespace could
    meet under the name OpenBulk gave it."""

    def __init__(self, *, sealed: bool) -> None:
        self.name = f"kvshare-test-impostor-{os.getpid()}-{time.monotonic_ns()}"
        self.sealed = sealed
        self.hellos: list[bytes | bytearray] = []
        self.arena = -1
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind("\0" + self.name)
        self._listener.listen(4)
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self._listener.accept()
            with conn:
                self.hellos.append(bulkio.recv_bytes(conn, w.HELLO.size))
                flags = os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if self.sealed else 0)
                self.arena = os.memfd_create("impostor", flags)
                os.ftruncate(self.arena, MiB)
                if self.sealed:
                    fcntl.fcntl(
                        self.arena, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                    )
                socket.send_fds(conn, [w.ARENA_REPLY.pack(w.OK, MiB)], [self.arena])
                conn.recv(1 << 16)  # whatever the client sends next, then hang up

    def close(self) -> None:
        self._listener.close()
        if self.arena >= 0:
            os.close(self.arena)


def pointing_at(
    client: BlockClient, impostor: Impostor, namespace: str, owner: int | None = None
) -> None:
    """Make `client`'s OpenBulk answers name the impostor's listener, bound (as the
    server binds its own) to `namespace` and `owner` (by default the server's user,
    which is also the impostor's here)."""
    bulk = client._bulk
    assert isinstance(bulk, BulkChannel)
    real = bulk._open_ticket

    def open_ticket(tenant: str, deadline: CallDeadline) -> Ticket:
        ticket = real(tenant, deadline)
        uid = os.getuid() if owner is None else owner
        binding = local_binding(ticket.ticket, namespace, uid)
        return dataclasses.replace(ticket, local_address=impostor.name, local_binding=binding)

    bulk._open_ticket = open_ticket


def test_a_client_uses_the_named_listener_only_in_the_namespace_openbulk_names(
    tenant_server: Running,
) -> None:
    """An abstract socket name is the server's only inside the server's network
    namespace; elsewhere anyone may bind it. So a client outside it never presents its
    ticket there, and moves its blocks over TCP instead."""
    elsewhere = Impostor(sealed=True)
    here = Impostor(sealed=True)
    try:
        with tenant_server.client("a") as client:
            pointing_at(client, elsewhere, "another-host/0:0")
            assert client.put("alpha", MODEL, [b"e" * 32], [b"payload"]) == [True]
            assert [c.arena is None for c in connections(client)] == [True]
            time.sleep(0.2)
            assert elsewhere.hellos == []  # never reached: no ticket given away
        with tenant_server.client("a") as client:  # positive control: same namespace
            pointing_at(client, here, host_namespace())
            with contextlib.suppress(Exception):
                client.put("alpha", MODEL, [b"h" * 32], [b"payload"])
            deadline = time.monotonic() + 5
            while not here.hellos and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(here.hellos) == 1
    finally:
        elsewhere.close()
        here.close()


def test_a_client_presents_no_ticket_to_a_listener_of_another_user(
    tenant_server: Running,
) -> None:
    """After a server dies its listener's name is free in its namespace; a process of
    another user that takes it must get nothing. The client compares the listener's
    peer credentials with the uid OpenBulk bound the ticket to (the previous test is the
    positive control: the same listener of the right user gets the client's hello)."""
    impostor = Impostor(sealed=True)
    try:
        with tenant_server.client("a") as client:
            pointing_at(client, impostor, host_namespace(), owner=os.getuid() + 4242)
            assert client.put("alpha", MODEL, [b"o" * 32], [b"payload"]) == [True]
            assert [c.arena is None for c in connections(client)] == [True]
            time.sleep(0.2)
            assert impostor.hellos == []
    finally:
        impostor.close()


def test_a_client_refuses_an_arena_that_is_not_sealed(tenant_server: Running) -> None:
    """An arena that could shrink under the client's mapping would kill it (SIGBUS): it
    is not mapped, and the client moves its blocks over TCP instead."""
    impostor = Impostor(sealed=False)
    try:
        with tenant_server.client("a") as client:
            pointing_at(client, impostor, host_namespace())
            assert client.put("alpha", MODEL, [b"u" * 32], [b"x" * 5000]) == [True]
            assert client.get("alpha", MODEL, [b"u" * 32]) == [b"x" * 5000]
            assert [c.arena is None for c in connections(client)] == [True]
            assert len(impostor.hellos) == 1  # it was asked, and refused
        assert os.pread(impostor.arena, 5000, 0) == bytes(5000)  # no payload went there
    finally:
        impostor.close()


def test_an_arena_kept_after_its_connection_holds_no_memory(tenant_server: Running) -> None:
    with tenant_server.client("a") as client:
        client.put("alpha", MODEL, [b"m" * 32], [os.urandom(4 * MiB)])
    response = open_bulk(tenant_server)
    sock, _reply, fds = local_hello(response.local_address, response.ticket)
    (fd,) = fds
    try:
        with sock:
            model = MODEL.encode()
            sock.sendall(w.REQUEST.pack(w.OP_GET, len(model), 1) + model + b"m" * 32)
            assert bulkio.recv_bytes(sock, 1)[0] == w.OK
            count, _ = w.LOCAL_GET.unpack(bulkio.recv_bytes(sock, w.LOCAL_GET.size))
            bulkio.recv_bytes(sock, count * w.SIZE.size)
            assert count == 1 and os.fstat(fd).st_blocks * 512 >= 4 * MiB  # positive control
        deadline = time.monotonic() + 5  # the server notices the close, then frees
        while os.fstat(fd).st_blocks and time.monotonic() < deadline:
            time.sleep(0.02)
        assert os.fstat(fd).st_blocks == 0
        with mmap.mmap(fd, MiB) as kept:
            assert kept[:4096] == bytes(4096)
    finally:
        os.close(fd)


def test_a_get_split_over_the_arena_counts_its_blocks_once(tmp_path: Path) -> None:
    tenancy = write_config(tmp_path, extra="[bulk]\narena_bytes = 1048576\n")
    reader = InMemoryMetricReader()
    digests = [os.urandom(32) for _ in range(6)]
    payloads = [os.urandom(300_000) for _ in digests]  # three arenas' worth
    with launch(tenancy, server_telemetry=ServerTelemetry(metric_readers=[reader])) as running:
        with running.client("a") as client:
            client.put("alpha", MODEL, digests, payloads)
            assert client.get("alpha", MODEL, digests) == payloads
        blocks = {}
        for resource in reader.get_metrics_data().resource_metrics:  # type: ignore[union-attr]
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == "kvshare.get.blocks":
                        for point in metric.data.data_points:
                            result = str((point.attributes or {})["result"])
                            blocks[result] = getattr(point, "value", 0)
    assert blocks == {"hit": 6, "miss": 0}


def test_openbulk_tells_no_caller_the_servers_boot_id_or_uid(tenant_server: Running) -> None:
    """OpenBulk used to tell every caller the server's uid and boot id, which only
    a same-host client needs, to check the listener. Now it sends a value bound to the
    one-time ticket that a client on the server's host can recompute and check."""
    response = open_bulk(tenant_server)
    boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    assert response.local_owner == ""
    assert boot_id not in response.local_namespace and host_namespace() != ""
    assert len(response.local_namespace) == 64  # hex of an HMAC-SHA256
    assert local_binding(response.ticket, host_namespace(), os.getuid()) == (
        response.local_namespace
    )  # positive control: what a client on this host computes
    assert open_bulk(tenant_server).local_namespace != response.local_namespace  # per ticket
