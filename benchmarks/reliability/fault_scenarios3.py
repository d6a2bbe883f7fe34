"""Fault scenarios, continued: resources exhausted by peers that need no credentials
(see fault_scenarios.py for the common parts)."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.reliability.fault_scenarios import (
    MODEL,
    PRINCIPALS,
    TENANTS,
    Env,
    MiB,
    Outcome,
)
from benchmarks.reliability.harness import (
    PrincipalSpec,
    owned_rss_bytes,
    wait_until,
    write_tenancy,
)
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from replica_agent.client import BlockClient
from replica_agent.errors import BlockStoreError

FLOOD_CONNECTIONS = 400  # well past the server's descriptor limit below
SERVER_DESCRIPTORS = 256


def _bulk_serving(channel: grpc.Channel) -> bool:
    check = health_pb2_grpc.HealthStub(channel).Check
    request = health_pb2.HealthCheckRequest(service="kvshare.bulk")
    status = check(request, timeout=10).status
    return bool(status == health_pb2.HealthCheckResponse.SERVING)


def descriptor_flood(env: Env) -> Outcome:
    """Idle connections to the gRPC port (no credentials) exhaust the server's
    descriptors (RLIMIT_NOFILE 256), while a client knocks on the bulk port. Passes when
    the bulk listener says so (log, `kvshare.bulk` health NOT_SERVING), serves bulk
    calls again once the flood ends (no fallback to gRPC), and no acknowledged block
    is lost."""
    tenancy = env.config()
    server = env.start(tenancy, max_descriptors=SERVER_DESCRIPTORS)
    digest, payload = os.urandom(32), os.urandom(256 << 10)
    health = grpc.insecure_channel(server.address)
    if not _bulk_serving(health):  # connects the channel before the flood
        return Outcome(False, "the bulk listener was not SERVING before the flood")
    host, _, port = server.address.rpartition(":")
    flood: list[socket.socket] = []
    try:
        with BlockClient(server.address, tenancy.tokens["b"], same_host=False) as client:
            client.put("beta", MODEL, [digest], [payload])
            bulk_port = _bulk_port(client)
        for _ in range(FLOOD_CONNECTIONS):
            flood.append(socket.create_connection((host, int(port)), timeout=10))
        flood.append(socket.create_connection((host, bulk_port), timeout=10))
        said = wait_until(lambda: "cannot accept" in server.log_path.read_text(), 20)
        unhealthy = wait_until(lambda: not _bulk_serving(health), 20)
    finally:
        for sock in flood:
            sock.close()
    started = time.monotonic()
    healthy = wait_until(lambda: _bulk_serving(health), 30)
    recovered_s = time.monotonic() - started
    with BlockClient(server.address, tenancy.tokens["b"], same_host=False) as client:
        served = client.get("beta", MODEL, [digest]) == [payload]
        fallbacks = client.transport_stats.bulk_fallbacks
    health.close()
    passed = said and unhealthy and healthy and served and fallbacks == 0
    detail = (
        f"logged: {said}, health NOT_SERVING during: {unhealthy}, SERVING again after "
        f"{recovered_s:.1f} s: {healthy}, block served over bulk: {served and not fallbacks}"
    )
    return Outcome(passed, detail, acknowledged_lost=0 if served else 1)


def _bulk_port(client: BlockClient) -> int:
    ticket = client._grpc.open_bulk("beta")
    return int(ticket.address.rpartition(":")[2])


REFUSED_FRAME_BYTES = 14 * MiB


def refuse_puts(address: str, tokens: dict[str, str], count: int) -> int:
    """`count` gRPC Puts whose first frame (14 MiB) is refused: half by a read-only
    principal `r` (PERMISSION_DENIED), half of principal `a` for a chunk at the wrong
    offset (INVALID_ARGUMENT), both of tenant alpha. Returns how many got that refusal."""
    refusals = (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
    options = [("grpc.max_send_message_length", 64 * MiB)]
    refused = 0
    with grpc.insecure_channel(address, options=options) as channel:
        put = pb_grpc.BlockStoreStub(channel).Put
        for i in range(count):
            who, offset = ("r", 0) if i % 2 else ("a", 5)
            chunk = pb.PutChunk(
                digest=os.urandom(32),
                block_bytes=16 * MiB,
                offset=offset,
                data=bytes(REFUSED_FRAME_BYTES),
            )
            frame = pb.PutFrame(header=pb.PutHeader(tenant="alpha", model=MODEL), chunks=[chunk])
            try:
                metadata = (("authorization", f"Bearer {tokens[who]}"),)
                put(iter([frame]), timeout=60, metadata=metadata)
            except grpc.RpcError as error:
                refused += error.code() in refusals
    return refused


def refused_put_memory(env: Env) -> Outcome:
    """gRPC Puts refused after a 14 MiB first frame (a read-only principal, a chunk at
    the wrong offset). Passes when 48 more refusals after the first 16 grow the server's
    own memory by less than 96 MiB (each kept its frame before: +14 MiB a call, for
    good), and the server then stores and serves a block."""
    principals = [*PRINCIPALS, PrincipalSpec("r", ("alpha",), ("read",))]
    tenancy = write_tenancy(
        env.directory,
        TENANTS,
        principals,
        storage={"journal_dir": str(env.journal_dir)},
        limits={"max_block_bytes": 32 * MiB},
    )
    server = env.start(tenancy)
    start = owned_rss_bytes(server.pid)
    refused = refuse_puts(server.address, tenancy.tokens, 16)
    time.sleep(1.0)
    after_16 = owned_rss_bytes(server.pid)
    refused += refuse_puts(server.address, tenancy.tokens, 48)
    time.sleep(1.0)
    after_64 = owned_rss_bytes(server.pid)
    digest, payload = os.urandom(32), os.urandom(MiB)
    with BlockClient(server.address, tenancy.tokens["b"]) as client:
        served = client.put("beta", MODEL, [digest], [payload]) == [True] and client.get(
            "beta", MODEL, [digest]
        ) == [payload]
    growth = after_64 - after_16
    passed = refused == 64 and growth < 96 * MiB and served
    detail = (
        f"{refused} of 64 refused; server memory +{(after_16 - start) / MiB:.0f} MiB after "
        f"16, +{(after_64 - start) / MiB:.0f} MiB after 64; serves on: {served}"
    )
    return Outcome(passed, detail)


class _DrippingRelay:
    """A TCP relay in front of the bulk listener; once `drip` is set, the server's
    bytes reach the client one at a time, `every_s` apart (a hostile store, or an
    on-path attacker, that never quite stops answering)."""

    def __init__(self) -> None:
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self._listener.getsockname()[1])
        self.target: tuple[str, int] | None = None
        self.every_s = 0.0

    def start(self, target: tuple[str, int]) -> None:
        self.target = target
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self._listener.accept()
                assert self.target is not None
                server = socket.create_connection(self.target)
                threading.Thread(
                    target=self._pipe, args=(client, server, False), daemon=True
                ).start()
                threading.Thread(
                    target=self._pipe, args=(server, client, True), daemon=True
                ).start()

    def _pipe(self, source: socket.socket, sink: socket.socket, from_server: bool) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                if from_server and self.every_s:
                    for i in range(len(data)):
                        sink.sendall(data[i : i + 1])
                        time.sleep(self.every_s)
                else:
                    sink.sendall(data)
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._listener.close()


def dripped_reply(env: Env) -> Outcome:
    """The bulk listener's replies reach the client through a relay that drips them a
    byte every 50 ms. Passes when a GET with `timeout_s = 1` ends (DEADLINE_EXCEEDED or
    a miss) within 3 s instead of the minutes the drip would take, and once the drip
    stops the block is served exactly."""
    relay = _DrippingRelay()
    tenancy = env.config()
    with tenancy.path.open("a") as config:
        config.write(f'[bulk]\nadvertise = "127.0.0.1:{relay.port}"\n')
    server = env.start(tenancy)
    assert server.proc.stdout is not None
    bulk = re.search(r"bulk on (\S+):(\d+)", server.proc.stdout.readline())
    if bulk is None:
        return Outcome(False, "the server did not say where its bulk listener is")
    relay.start((bulk.group(1), int(bulk.group(2))))
    digest, payload = os.urandom(32), os.urandom(MiB)
    try:
        with BlockClient(server.address, tenancy.tokens["b"], same_host=False, timeout_s=1.0) as c:
            c.put("beta", MODEL, [digest], [payload])
            relay.every_s = 0.05
            started = time.monotonic()
            try:
                ended = "miss" if c.get("beta", MODEL, [digest]) == [] else "served"
            except BlockStoreError as error:
                ended = error.code().name
            took_s = time.monotonic() - started
            relay.every_s = 0.0
        with BlockClient(server.address, tenancy.tokens["b"], same_host=False) as c:
            served = c.get("beta", MODEL, [digest]) == [payload]
    finally:
        relay.close()
    passed = took_s < 3.0 and ended in ("DEADLINE_EXCEEDED", "miss") and served
    detail = f"dripped GET ended {ended} after {took_s:.1f} s; served after the drip: {served}"
    return Outcome(passed, detail)
