"""Fault scenarios, continued: resources exhausted by peers that need no credentials
(see fault_scenarios.py for the common parts)."""

from __future__ import annotations

import os
import socket
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from benchmarks.reliability.fault_scenarios import MODEL, Env, Outcome
from benchmarks.reliability.harness import wait_until
from replica_agent.client import BlockClient

FLOOD_CONNECTIONS = 400  # well past the server's descriptor limit below
SERVER_DESCRIPTORS = 256


def _bulk_serving(channel: grpc.Channel) -> bool:
    check = health_pb2_grpc.HealthStub(channel).Check
    request = health_pb2.HealthCheckRequest(service="kvshare.bulk")
    return check(request, timeout=10).status == health_pb2.HealthCheckResponse.SERVING


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
