"""Fuzz targets that speak the wire: protobuf requests through the handlers, the bulk
channel's HELLO and requests, and the bulk client reading a hostile server's replies.

Server targets send each input to every server in `Servers`: the live `kvshare serve`
process of the campaign (crashes, log lines and RSS are watched by benchmarks/fuzz.py)
and a server embedded in this process, whose code atheris instruments, so that the
coverage of the server's own parsing and handlers steers the mutations.

Verdicts per call: "ok" (a documented outcome), "internal" (INTERNAL status, or a
traceback the embedded server logged), "unexpected" (a status outside the contract
for that call, a reply that is not a frame, a server that neither answers nor closes).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import atheris
import grpc

from kvcommon import bulkwire as w
from kvcommon import errors, samehost
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from policy.tickets import local_binding
from replica_agent.bulk import BulkChannel
from replica_agent.errors import BlockStoreError
from replica_agent.grpc_calls import Ticket
from replica_agent.transport import UseGrpc

SERVICE = "/kvshare.v1.BlockStore/"
UNARY = ("Lookup", "Delete", "Stats", "OpenBulk")
# Statuses a call may end with (docs/design.md §5), by whether it carried a valid token.
CONTRACT = {"OK", "INVALID_ARGUMENT", "PERMISSION_DENIED", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}
TENANTS = ("alpha", "beta", "nobody", "", "ALPHA", "a" * 70)
# The status byte of a bulk error frame is an error class's code (kvcommon.errors);
# INTERNAL among them is a finding of its own (a bug the server owned up to).
KNOWN_STATUS_BYTES = {cls.wire_code for cls in errors.WIRE_ERRORS}
INTERNAL_STATUS_BYTE = errors.KvshareError.wire_code
REPLY_TIMEOUT_S = 5.0


class LoggedErrors(logging.Handler):
    """Counts records logged with a traceback (the embedded server's bugs), by logger
    and exception type."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info and record.exc_info[0] is not None:
            key = f"{record.name}:{record.exc_info[0].__name__}"
            self.counts[key] = self.counts.get(key, 0) + 1


@dataclass
class Server:
    name: str  # "live" or "embedded"
    address: str
    token: str
    channel: grpc.Channel = field(init=False)
    stub: pb_grpc.BlockStoreStub = field(init=False)
    down: bool = False  # the live server stopped answering: benchmarks/fuzz.py counts it

    def __post_init__(self) -> None:
        self.channel = grpc.insecure_channel(self.address)
        self.stub = pb_grpc.BlockStoreStub(self.channel)

    def auth(self) -> tuple[tuple[str, str], ...]:
        return (("authorization", f"Bearer {self.token}"),)


Verdicts = dict[str, int]
Target = Callable[[bytes], None]


def _note(verdicts: Verdicts, key: str) -> None:
    verdicts[key] = verdicts.get(key, 0) + 1


# -- protobuf requests -------------------------------------------------------------------


def _message(fdp: atheris.FuzzedDataProvider, method: str) -> bytes:
    """A request of `method`: a real message with fuzzed fields, then maybe mangled."""
    tenant = TENANTS[fdp.ConsumeIntInRange(0, len(TENANTS) - 1)]
    model = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 40))
    digests = [
        fdp.ConsumeBytes(fdp.PickValueInList([32, 32, 32, 0, 31, 33, 64]))
        for _ in range(fdp.ConsumeIntInRange(0, 6))
    ]
    if method == "Lookup":
        raw = pb.LookupRequest(tenant=tenant, model=model, digests=digests).SerializeToString()
    elif method == "Get":
        raw = pb.GetRequest(
            tenant=tenant,
            model=model,
            digests=digests,
            max_frame_bytes=fdp.ConsumeIntInRange(0, 2**32 - 1),
        ).SerializeToString()
    elif method == "Delete":
        raw = pb.DeleteRequest(
            tenant=tenant, model=model, digests=digests, whole_tenant=fdp.ConsumeBool()
        ).SerializeToString()
    elif method == "OpenBulk":
        raw = pb.OpenBulkRequest(tenant=tenant).SerializeToString()
    else:
        raw = pb.StatsRequest().SerializeToString()
    if fdp.ConsumeIntInRange(0, 3) == 0:  # raw bytes instead: a protobuf parser's input
        return bytes(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 200)))
    return raw


def _put_frames(fdp: atheris.FuzzedDataProvider) -> list[bytes]:
    frames = []
    for index in range(fdp.ConsumeIntInRange(0, 4)):
        frame = pb.PutFrame()
        if index == 0 and fdp.ConsumeIntInRange(0, 4):
            frame.header.tenant = TENANTS[fdp.ConsumeIntInRange(0, len(TENANTS) - 1)]
            frame.header.model = fdp.ConsumeUnicodeNoSurrogates(fdp.ConsumeIntInRange(0, 20))
        for _ in range(fdp.ConsumeIntInRange(0, 3)):
            data = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
            frame.chunks.add(
                digest=fdp.ConsumeBytes(fdp.PickValueInList([32, 32, 0, 16])),
                block_bytes=fdp.PickValueInList(
                    [len(data), len(data) + 1, 0, 2**63, fdp.ConsumeIntInRange(0, 2**64 - 1)]
                ),
                offset=fdp.PickValueInList([0, 0, len(data), fdp.ConsumeIntInRange(0, 2**64 - 1)]),
                data=data,
            )
        raw = frame.SerializeToString()
        frames.append(fdp.ConsumeBytes(40) if fdp.ConsumeIntInRange(0, 5) == 0 else raw)
    return frames


def _metadata(
    fdp: atheris.FuzzedDataProvider, server: Server
) -> tuple[tuple[tuple[str, str], ...], bool]:
    mode = fdp.ConsumeIntInRange(0, 5)
    if mode <= 2:
        return server.auth(), True
    if mode == 3:
        return (), False
    if mode == 4:
        return (
            ("authorization", "Bearer " + fdp.ConsumeUnicodeNoSurrogates(20).replace("\n", "")),
        ), False
    return (("authorization", "Basic x"),), False


def grpc_target(servers: list[Server], verdicts: Verdicts) -> Target:
    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        method = fdp.PickValueInList([*UNARY, "Get", "Put"])
        body: bytes | list[bytes] = _put_frames(fdp) if method == "Put" else _message(fdp, method)
        choice = fdp.ConsumeIntInRange(0, 255)
        for server in servers:
            if server.down:
                continue
            metadata, authenticated = _metadata(atheris.FuzzedDataProvider(bytes([choice])), server)
            code = _call(server, method, body, metadata)
            _judge(verdicts, server, code, authenticated, method)

    return one


def raw_bytes(data: bytes) -> bytes:
    """The identity (de)serializer: the fuzzed bytes go on the wire as they are."""
    return data


def _call(
    server: Server, method: str, body: bytes | list[bytes], metadata: tuple[tuple[str, str], ...]
) -> str:
    path, channel = SERVICE + method, server.channel
    try:
        if isinstance(body, list):  # Put: a stream of frames
            put = channel.stream_unary(path, raw_bytes, raw_bytes)
            put(iter(body), metadata=metadata, timeout=REPLY_TIMEOUT_S)
        elif method == "Get":
            get = channel.unary_stream(path, raw_bytes, raw_bytes)
            for _ in get(body, metadata=metadata, timeout=REPLY_TIMEOUT_S):
                pass
        else:
            unary = channel.unary_unary(path, raw_bytes, raw_bytes)
            unary(body, metadata=metadata, timeout=REPLY_TIMEOUT_S)
    except grpc.RpcError as error:
        return error.code().name
    return "OK"


def _judge(verdicts: Verdicts, server: Server, code: str, authenticated: bool, method: str) -> None:
    if code == "INTERNAL":
        _note(verdicts, f"{server.name}:internal:{method}")
    elif code == "UNAVAILABLE" and server.name == "live" and not _alive(server):
        server.down = True
        _note(verdicts, "live:down")
    elif (authenticated and code not in CONTRACT) or (
        not authenticated and code != "UNAUTHENTICATED"
    ):
        _note(verdicts, f"{server.name}:unexpected:{method} {code}")
    else:
        _note(verdicts, f"{server.name}:ok")


def _alive(server: Server) -> bool:
    try:
        server.stub.Stats(pb.StatsRequest(), metadata=server.auth(), timeout=10)
    except grpc.RpcError as error:
        return error.code() != grpc.StatusCode.UNAVAILABLE
    return True


# -- the bulk channel, server side ---------------------------------------------------------


def _bulk_request(fdp: atheris.FuzzedDataProvider) -> bytes:
    op = fdp.PickValueInList(
        [w.OP_GET, w.OP_PUT, w.OP_GET | w.TRACED, w.OP_PUT | w.TRACED, 0, 3, 0xFF]
    )
    model = fdp.ConsumeBytes(fdp.PickValueInList([5, 5, 0, 1, 200]))
    count = fdp.PickValueInList([1, 1, 2, 3, 0, 8193, 2**32 - 1])
    sent = min(count, 4)
    parts = [w.REQUEST.pack(op, fdp.PickValueInList([len(model), len(model), 0, 0xFFFF]), count)]
    if op & w.TRACED:
        parts.append(fdp.ConsumeBytes(fdp.PickValueInList([w.TRACE_CONTEXT_BYTES, 3])))
    parts.append(model)
    parts += [fdp.ConsumeBytes(32).ljust(32, b"\0") for _ in range(sent)]
    if op & ~w.TRACED == w.OP_PUT:
        sizes = [
            fdp.PickValueInList([16, 16, 1, 0, 128 << 20, 2**63, 2**64 - 1]) for _ in range(sent)
        ]
        parts += [w.SIZE.pack(size) for size in sizes]
        parts += [fdp.ConsumeBytes(min(size, 64)) for size in sizes]
    return b"".join(parts)


def bulk_server_target(servers: list[Server], verdicts: Verdicts) -> Target:
    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        hello_mode = fdp.ConsumeIntInRange(0, 7)
        requests = b"".join(_bulk_request(fdp) for _ in range(fdp.ConsumeIntInRange(0, 2)))
        tail = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 16))
        for server in servers:
            if server.down:
                continue
            try:
                opened = server.stub.OpenBulk(
                    pb.OpenBulkRequest(tenant="alpha"), metadata=server.auth(), timeout=10
                )
            except grpc.RpcError:
                if server.name == "live" and not _alive(server):
                    server.down = True
                    _note(verdicts, "live:down")
                else:
                    _note(verdicts, f"{server.name}:unexpected:OpenBulk failed")
                continue
            ticket = opened.ticket if hello_mode < 6 else os.urandom(32)
            magic = w.MAGIC if hello_mode != 6 else b"KVB0"
            hello = w.HELLO.pack(magic, ticket)[: 36 if hello_mode != 7 else 20]
            _note(
                verdicts, f"{server.name}:{_bulk_exchange(opened.address, hello + requests + tail)}"
            )

    return one


def _bulk_exchange(address: str, raw: bytes) -> str:
    """Send `raw`, half-close, read the reply to the end: the verdict."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection(
            (host.strip("[]"), int(port)), timeout=REPLY_TIMEOUT_S
        ) as sock:
            try:
                sock.sendall(raw)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the server refused the header and closed: its reply is still there
            reply = bytearray()
            while True:
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                reply += chunk
    except TimeoutError:
        return "unexpected:no reply and no close"
    except OSError:
        return "ok"  # reset after an error frame: the client went away mid-request
    if reply and reply[0] == INTERNAL_STATUS_BYTE:
        return "internal:bulk status INTERNAL"
    if reply and reply[0] not in KNOWN_STATUS_BYTES and reply[0] != w.OK:
        return f"unexpected:status byte {reply[0]}"
    return "ok"


# -- the bulk channel, client side: a hostile server -----------------------------------------


class HostileServer:
    """Answers bulk connections (TCP, or the same-host Unix socket with an arena
    descriptor) with the bytes of the current input, then closes."""

    def __init__(self) -> None:
        self.script = b""
        self.arena: tuple[int, bool] | None = None  # (size, sealed) of the memfd to send
        self.tcp = socket.create_server(("127.0.0.1", 0))
        self.local = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.local_name = f"kvshare-fuzz-{os.getpid()}-{os.urandom(4).hex()}"
        self.local.bind("\0" + self.local_name)
        self.local.listen(16)
        for listener in (self.tcp, self.local):
            threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    @property
    def address(self) -> str:
        host, port = self.tcp.getsockname()[:2]
        return f"{host}:{port}"

    def _accept(self, listener: socket.socket) -> None:
        while True:
            conn, _ = listener.accept()
            threading.Thread(target=self._answer, args=(conn,), daemon=True).start()

    def _answer(self, conn: socket.socket) -> None:
        with conn:
            conn.settimeout(2)
            try:
                conn.recv(w.HELLO.size, socket.MSG_WAITALL)
                script = self.script
                if conn.family == socket.AF_UNIX and self.arena is not None:
                    size, sealed = self.arena
                    fd = os.memfd_create("fuzz-arena", os.MFD_ALLOW_SEALING)
                    try:
                        os.ftruncate(fd, size)
                        if sealed:
                            import fcntl

                            fcntl.fcntl(
                                fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
                            )
                        socket.send_fds(conn, [script[:9] or b"\0"], [fd])
                    finally:
                        os.close(fd)
                    script = script[9:]
                conn.sendall(script)
                conn.shutdown(socket.SHUT_WR)  # the client reads the script, then EOF
                conn.recv(1 << 16)
            except OSError:
                pass


def hostile_ticket(hostile: HostileServer, *, local: bool) -> Ticket:
    """A ticket naming the hostile server: its TCP address and, when `local`, its
    same-host listener, bound as OpenBulk binds it (policy.tickets.local_binding), so
    the client takes it for the server's and reads its arena reply."""
    secret = os.urandom(32)
    binding = local_binding(secret, samehost.host_namespace(), os.getuid()) if local else ""
    return Ticket(secret, hostile.address, False, hostile.local_name if local else "", binding)


# What the client's caller handles (replica_agent.client: a store error, a broken
# connection, a call to send over gRPC instead): anything else out of a hostile reply
# is a bug.
HANDLED = (BlockStoreError, OSError, UseGrpc)


def bulk_client_target(verdicts: Verdicts) -> Target:
    hostile = HostileServer()

    def one(data: bytes) -> None:
        fdp = atheris.FuzzedDataProvider(data)
        local = fdp.ConsumeBool()
        hostile.arena = (
            fdp.PickValueInList([4096, 1 << 20, 0, 4095]),
            fdp.ConsumeIntInRange(0, 4) > 0,
        )
        script = bytearray()
        if local and fdp.ConsumeBool():  # an ARENA_REPLY naming the size or another
            script += w.ARENA_REPLY.pack(
                fdp.PickValueInList([0, 0, 8, 99]),
                fdp.PickValueInList([hostile.arena[0], 2**63, 4096]),
            )
        elif fdp.ConsumeBool():
            script += bytes([w.OK])
        script += _reply_script(fdp)
        hostile.script = bytes(script)
        ticket = hostile_ticket(hostile, local=local)
        channel = BulkChannel(lambda _tenant, _deadline: ticket, timeout_s=2)
        try:
            if fdp.ConsumeBool():
                channel.get("t", "m", [bytes(32)] * fdp.ConsumeIntInRange(1, 3))
            else:
                channel.put("t", "m", [bytes(32)], [b"x" * fdp.ConsumeIntInRange(1, 8)])
            _note(verdicts, "client:ok")
        except HANDLED:
            _note(verdicts, "client:ok")
        except Exception as error:  # a hostile reply must end in an error the client handles
            from benchmarks.reliability.fuzz_parsers import describe

            _note(verdicts, f"client:internal:{describe(error)}")
        finally:
            channel.close()

    return one


def _reply_script(fdp: atheris.FuzzedDataProvider) -> bytes:
    """What follows the handshake: sizes and payloads, LOCAL_GET, outcomes, errors."""
    parts = []
    for _ in range(fdp.ConsumeIntInRange(0, 4)):
        kind = fdp.ConsumeIntInRange(0, 4)
        if kind == 0:
            parts.append(
                w.SIZE.pack(
                    fdp.PickValueInList([0, 1, 8, 4096, 2**31, 2**62, 2**63 + 5, 2**64 - 1])
                )
            )
        elif kind == 1:
            parts.append(
                w.LOCAL_GET.pack(
                    fdp.PickValueInList([0, 1, 2, 2**16, 2**32 - 1]), fdp.ConsumeIntInRange(0, 2)
                )
            )
        elif kind == 2:
            message = fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 10))
            parts.append(
                struct.pack(
                    ">BH",
                    fdp.ConsumeIntInRange(1, 255),
                    fdp.PickValueInList([len(message), 0xFFFF]),
                )
                + message
            )
        elif kind == 3:
            parts.append(bytes([w.OK]))
        else:
            parts.append(fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 24)))
    return b"".join(parts)
