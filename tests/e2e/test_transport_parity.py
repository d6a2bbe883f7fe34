"""The same bad call gets the same status over every transport (cacheserver/core/requests.py).

Each case is sent as raw wire bytes — gRPC through the generated stub, the bulk channel
through its framing over TCP and over the same-host arena — so no client-side check can
stand in for the server's answer. Every row has a positive control: the same call,
corrected, succeeds over that transport. An unexpected error (the in-process store made
to raise) is INTERNAL with a request id on each transport.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import select
import socket
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import grpc
import pytest

from cacheserver.transport.bulk.handler import TRANSFER_SLACK_S
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import (
    InvalidArgument,
    KvshareError,
    PermissionDenied,
    ResourceExhausted,
)
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from replica_agent.errors import BlockStoreError
from tests.support.servers import Running, launch, write_config

MODEL = "parity/model;fp32"
OK = 0
TRANSPORTS = ("grpc", "bulk-tcp", "bulk-same-host")
SEALED_ONLY = '\n[[tenants]]\nid = "sealed"\nrequire_sealed = true\n'


@pytest.fixture(scope="module")
def parity_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    directory = tmp_path_factory.mktemp("parity")
    tenancy = write_config(
        directory,
        quotas={"beta": 2 << 20},
        principals={
            "a": (["alpha", "sealed"], ["read", "write"]),
            "reader": (["alpha"], ["read"]),
            "b": (["beta"], ["read", "write"]),
        },
        extra="[limits]\nmax_digests_per_call = 16\nmax_block_bytes = 4194304\n",
    )
    tenancy.path.write_text(tenancy.path.read_text() + SEALED_ONLY)
    with launch(tenancy) as running:
        yield running


@dataclass(frozen=True)
class Call:
    """One request: who makes it, on which tenant, and what it carries."""

    who: str
    tenant: str
    op: str  # "get" or "put"
    model: bytes = MODEL.encode()
    count: int = 1
    size: int = 64
    digest_bytes: int = 32
    payload: bytes | None = None  # default: `size` random bytes


def digests(call: Call) -> list[bytes]:
    return [os.urandom(call.digest_bytes) for _ in range(call.count)]


def payloads(call: Call) -> list[bytes]:
    return [call.payload if call.payload is not None else os.urandom(call.size)] * call.count


# -- gRPC ---------------------------------------------------------------------------


def grpc_status(running: Running, call: Call) -> int:
    metadata = (("authorization", f"Bearer {running.tokens[call.who]}"),)
    model = call.model.decode("utf-8")
    with grpc.insecure_channel(running.address) as channel:
        stub = pb_grpc.BlockStoreStub(channel)
        try:
            if call.op == "get":
                request = pb.GetRequest(tenant=call.tenant, model=model, digests=digests(call))
                for _ in stub.Get(request, timeout=10, metadata=metadata):
                    pass
            else:
                frames = [pb.PutFrame(header=pb.PutHeader(tenant=call.tenant, model=model))]
                for digest, data in zip(digests(call), payloads(call), strict=True):
                    chunk = pb.PutChunk(digest=digest, block_bytes=len(data), offset=0, data=data)
                    frames.append(pb.PutFrame(chunks=[chunk]))
                stub.Put(iter(frames), timeout=10, metadata=metadata)
        except grpc.RpcError as error:
            return int(error.code().value[0])
    return OK


# -- the bulk channel, raw -------------------------------------------------------------


def open_bulk(running: Running, call: Call) -> pb.OpenBulkResponse:
    """A ticket for `call.who` on a tenant it holds (so the connection opens: the call
    itself names its tenant through the ticket, see `bulk_status`)."""
    metadata = (("authorization", f"Bearer {running.tokens[call.who]}"),)
    with grpc.insecure_channel(running.address) as channel:
        return pb_grpc.BlockStoreStub(channel).OpenBulk(
            pb.OpenBulkRequest(tenant=call.tenant), timeout=10, metadata=metadata
        )


def connect(
    response: pb.OpenBulkResponse, same_host: bool
) -> tuple[socket.socket, mmap.mmap | None]:
    if not same_host:
        host, _, port = response.address.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(w.HELLO.pack(w.MAGIC, response.ticket))
        assert bulkio.recv_bytes(sock, 1)[0] == OK
        return sock, None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + response.local_address)
    sock.sendall(w.HELLO.pack(w.MAGIC, response.ticket))
    data, fds, _flags, _addr = socket.recv_fds(sock, w.ARENA_REPLY.size, 1)
    assert data[:1] == bytes([OK]) and len(fds) == 1
    data += bulkio.recv_bytes(sock, w.ARENA_REPLY.size - len(data))
    arena = mmap.mmap(fds[0], w.ARENA_REPLY.unpack(data)[1])
    os.close(fds[0])
    return sock, arena


def bulk_status(running: Running, call: Call, same_host: bool, refused: bool = True) -> int:
    """The status of `call` on a bulk connection opened for its tenant. A call whose
    principal may not use that tenant cannot get a ticket for it at all (OpenBulk
    refuses, PERMISSION_DENIED); that refusal is this transport's answer.

    A put that may be `refused` sends its payloads only once the server had a moment to
    answer the header (see below); one expected to succeed sends them at once."""
    try:
        response = open_bulk(running, call)
    except grpc.RpcError as error:
        return int(error.code().value[0])
    sock, arena = connect(response, same_host)
    with sock:
        ds, ps = digests(call), payloads(call)
        op = w.OP_GET if call.op == "get" else w.OP_PUT
        header = w.REQUEST.pack(op, len(call.model), len(ds))
        parts: list[bytes] = [header, call.model, b"".join(ds)]
        if op == w.OP_PUT:
            parts.append(b"".join(w.SIZE.pack(len(p)) for p in ps))
            if arena is not None:
                offsets, end = w.arena_offsets([len(p) for p in ps])
                if end <= len(arena):
                    for offset, data in zip(offsets, ps, strict=True):
                        arena[offset : offset + len(data)] = data
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(b"".join(parts))  # a refused header closes the connection
        if op == w.OP_PUT and arena is None and not (refused and answered(sock)):
            # Payloads only once the server took the header and sizes: a server that
            # refused them has answered already (sending more would reset the socket).
            # The wait stays well inside the server's TRANSFER_SLACK_S for the payloads,
            # so a server that took the header still gets them in time.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                sock.sendall(b"".join(ps))
        status = bulkio.recv_bytes(sock, 1)[0]
        if status != OK:
            code, _message = bulkio.recv_error(sock, bytes([status]))
            return code
        return OK


def answered(sock: socket.socket, wait_s: float = TRANSFER_SLACK_S / 4) -> bool:
    readable, _, _ = select.select([sock], [], [], wait_s)
    return bool(readable)


def status_over(transport: str, running: Running, call: Call, refused: bool = True) -> int:
    if transport == "grpc":
        return grpc_status(running, call)
    return bulk_status(running, call, transport == "bulk-same-host", refused)


# -- the table -------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    bad: Call
    status: type[KvshareError]
    control: Call  # the same call, corrected: succeeds


CASES: Sequence[Case] = (
    Case(
        "another tenant's get",
        Call("a", "beta", "get"),
        PermissionDenied,
        Call("a", "alpha", "get"),
    ),
    Case(
        "a put without the write action",
        Call("reader", "alpha", "put"),
        PermissionDenied,
        Call("a", "alpha", "put"),
    ),
    Case(
        "too many digests",
        Call("a", "alpha", "get", count=17),
        InvalidArgument,
        Call("a", "alpha", "get", count=16),
    ),
    Case(
        "too many digests on another tenant: the tenant is checked first",
        Call("a", "beta", "get", count=17),
        PermissionDenied,
        Call("a", "alpha", "get", count=16),
    ),
    Case(
        "a put without the write action, of too many blocks: the action is checked first",
        Call("reader", "alpha", "put", count=17),
        PermissionDenied,
        Call("a", "alpha", "put", count=16),
    ),
    Case(
        "empty model",
        Call("a", "alpha", "get", model=b""),
        InvalidArgument,
        Call("a", "alpha", "get"),
    ),
    Case(
        "model over 512 characters",
        Call("a", "alpha", "put", model=b"m" * 513),
        InvalidArgument,
        Call("a", "alpha", "put", model=b"m" * 512),
    ),
    Case(
        "a block over max_block_bytes",
        Call("a", "alpha", "put", size=(4 << 20) + 1),
        InvalidArgument,
        Call("a", "alpha", "put", size=4 << 20),
    ),
    Case(
        "an empty block",
        Call("a", "alpha", "put", size=0),
        InvalidArgument,
        Call("a", "alpha", "put", size=1),
    ),
    Case(
        "a plaintext block for a tenant that requires sealed blocks",
        Call("a", "sealed", "put", payload=b"plain" * 20),
        InvalidArgument,
        Call("a", "alpha", "put", payload=b"plain" * 20),
    ),
    Case(
        "a block bigger than the tenant's quota",
        Call("b", "beta", "put", size=(2 << 20) + 1),
        ResourceExhausted,
        Call("b", "beta", "put", size=2 << 20),
    ),
    Case(
        "a malformed tenant id",
        Call("a", "Alpha!", "get"),
        InvalidArgument,
        Call("a", "alpha", "get"),
    ),
)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_the_same_bad_call_gets_the_same_status_everywhere(
    parity_server: Running, transport: str, case: Case
) -> None:
    if transport != "grpc" and case.bad.tenant == "Alpha!":
        # The bulk channel names its tenant only through OpenBulk, which is gRPC: the
        # malformed id is refused there, as it would be for a gRPC call.
        assert bulk_status(parity_server, case.bad, same_host=False) == case.status.wire_code
        return
    assert status_over(transport, parity_server, case.control, refused=False) == OK
    assert status_over(transport, parity_server, case.bad) == case.status.wire_code


def test_bad_digest_length_and_bad_utf8_model_are_refused_where_they_can_be_sent(
    parity_server: Running,
) -> None:
    """Two cases only one wire format can express: gRPC carries digests of any length
    (the bulk framing has 32 bytes each) and bulk carries model bytes (gRPC strings are
    UTF-8). Each is refused where it can be sent."""
    short = Call("a", "alpha", "get", digest_bytes=31)
    assert grpc_status(parity_server, short) == InvalidArgument.wire_code
    assert grpc_status(parity_server, Call("a", "alpha", "get")) == OK
    for same_host in (False, True):
        bad_utf8 = Call("a", "alpha", "get", model=b"\xff\xfemodel")
        assert bulk_status(parity_server, bad_utf8, same_host) == InvalidArgument.wire_code


def test_put_path_parity_for_stored_then_present(parity_server: Running, tmp_path: Path) -> None:
    """Positive control across transports: a block put over one transport is already
    present for the others (one store, one naming)."""
    digest, data = os.urandom(32), os.urandom(1000)
    with (
        parity_server.client("a", bulk=False) as over_grpc,
        parity_server.client("a", same_host=False) as over_tcp,
        parity_server.client("a") as same_host,
    ):
        assert over_tcp.put("alpha", MODEL, [digest], [data]) == [True]
        assert over_grpc.put("alpha", MODEL, [digest], [data]) == [False]
        assert same_host.put("alpha", MODEL, [digest], [data]) == [False]
        for client in (over_grpc, over_tcp, same_host):
            assert client.get("alpha", MODEL, [digest]) == [data]


# -- an unexpected error ------------------------------------------------------------


def broken(*args: object, **kwargs: object) -> NoReturn:
    raise RuntimeError("a store bug: secret-ish details that must not reach the client")


@pytest.mark.parametrize("op", ["get", "put"])
@pytest.mark.parametrize("transport", TRANSPORTS)
def test_an_unexpected_error_is_internal_with_a_request_id_everywhere(
    parity_server: Running, transport: str, op: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug in the server (here: the store raising what no code expects) answers
    INTERNAL with a request id on every transport, never the exception's text, and is
    no reason for the client to fall back to gRPC; the client's next call works."""
    digest, data = os.urandom(32), os.urandom(1000)
    with parity_server.client("a", transport=transport) as client:
        assert client.put("alpha", MODEL, [digest], [data]) == [True]  # control first
        monkeypatch.setattr(parity_server.store, "read" if op == "get" else "put", broken)
        with pytest.raises(BlockStoreError) as info:
            if op == "get":
                client.get("alpha", MODEL, [digest])
            else:
                client.put("alpha", MODEL, [os.urandom(32)], [data])
        assert info.value.code() == grpc.StatusCode.INTERNAL
        assert re.fullmatch(r"internal error \(request id [0-9a-f]{16}\)", info.value.details())
        assert client.transport_stats.bulk_fallbacks == 0
        monkeypatch.undo()
        assert client.get("alpha", MODEL, [digest]) == [data]
        assert client.put("alpha", MODEL, [os.urandom(32)], [data]) == [True]


@pytest.mark.parametrize("same_host", [False, True], ids=["bulk-tcp", "bulk-same-host"])
def test_a_bulk_connection_serves_on_after_an_internal_error(
    parity_server: Running, same_host: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET fails inside the server after its request was read whole and before any
    reply went out: the error frame leaves the connection at a request boundary, so
    the same connection takes the next request."""
    call = Call("a", "alpha", "get")
    sock, _arena = connect(open_bulk(parity_server, call), same_host)
    model = call.model
    request = w.REQUEST.pack(w.OP_GET, len(model), 1) + model + os.urandom(32)
    with sock:
        monkeypatch.setattr(parity_server.store, "read", broken)
        sock.sendall(request)
        code, message = bulkio.recv_error(sock, bytes(bulkio.recv_bytes(sock, 1)))
        assert code == KvshareError.wire_code and "request id" in message
        assert "secret" not in message
        monkeypatch.undo()
        sock.sendall(request)
        assert bulkio.recv_bytes(sock, 1)[0] == OK  # the same connection, served
