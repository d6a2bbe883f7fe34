"""Live reloads under load (cacheserver.reload), end to end.

Two real servers, reloaded together 20 times while 8 clients of 4 tenants put and get
for 30 s: a plaintext one with a bulk worker (`[bulk] workers = 2`), whose clients use
gRPC, the bulk channel over TCP (connections a worker serves) and the same-host arena,
and a TLS one, whose clients use TLS and whose certificate is rotated midway. The
reloads add and remove tenants and principals, raise and lower a quota, and remove one
victim principal per transport: gRPC, bulk TCP served by a worker, same-host, TLS and
the sealed channel.

Must hold: no request of a principal that stays fails; every acknowledged block is
still there at the end; each victim's open connections are closed and its next call
refused within one second of the reload that removed it (measured from before the
reload was sent, so the reload's own work counts); a lowered quota holds within one
second.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import grpc
import pytest

from cacheserver.transport.bulk import BulkServer
from kvshare.reload_cli import request_reload
from policy.tickets import Grant as TicketGrant
from policy.types import TenantId
from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import CertFiles, TestCA
from tests.support.reload import MODEL, Grant, LiveConfig, digest, start
from tests.support.servers import Running

LOAD_S = 30.0
RELOADS = 20
WITHIN_S = 1.0  # the bound for revocation and a lowered quota
BLOCK = bytes(range(256)) * 16  # 4 KiB
TENANTS = ("t0", "t1", "t2", "t3")
QUOTA_BLOCKS = 20  # the quota tenant `q` is filled with this many blocks
RW = ["read", "write"]

pytestmark = pytest.mark.slow


@dataclass
class Victim:
    """A principal removed at `reload`, holding open connections of one transport."""

    name: str
    server: str  # "plain" or "tls"
    transport: str
    reload: int
    clients: list[BlockClient] = field(default_factory=list)
    closed_after_s: float | None = None  # its connections, closed by the server
    refused_after_s: float | None = None  # its next call


def _options(transport: str, tls: ClientTls | None) -> dict[str, object]:
    return {
        "grpc": {"bulk": False},
        "bulk-tcp": {"same_host": False},
        "same-host": {},
        "tls": {"same_host": False},
        "sealed": {"same_host": False, "sealed_channel": True},
    }[transport] | {"tls": tls, "timeout_s": 10}


class Fleet:
    """Both servers, their configs, and how a client reaches each."""

    def __init__(self, directory: Path) -> None:
        self.ca = TestCA(directory / "pki")
        self.certs = [self.ca.server_cert("server-1"), self.ca.server_cert("server-2")]
        self.client_tls = ClientTls(root_ca=self.ca.cert_path)
        stayers = {f"s{i}": Grant([t], RW) for i, t in enumerate(TENANTS)}
        admin = {"root": Grant([*TENANTS, "q"], ["read", "write", "admin"])}
        self.plain = LiveConfig(
            directory / "plain",
            dict.fromkeys((*TENANTS, "q"), 0),
            {**stayers, **admin},
            "[bulk]\nworkers = 2\n",
        )
        self.tls = LiveConfig(
            directory / "tls",
            dict.fromkeys((*TENANTS, "sealed", "q"), 0),
            {**{k: Grant(list(g.tenants), RW) for k, g in stayers.items()}, **admin},
            self._tls_table(self.certs[0]),
            sealed={"sealed"},
        )
        for live in (self.plain, self.tls):
            live.directory.mkdir(parents=True)
        self.victims = [
            Victim("v-grpc", "plain", "grpc", 4),
            Victim("v-worker", "plain", "bulk-tcp", 7),
            Victim("v-same-host", "plain", "same-host", 10),
            Victim("v-tls", "tls", "tls", 13),
            Victim("v-sealed", "tls", "sealed", 16),
        ]
        for victim in self.victims:
            tenant = "sealed" if victim.transport == "sealed" else "t0"
            self.live(victim.server).principals[victim.name] = Grant([tenant], RW)

    @staticmethod
    def _tls_table(files: CertFiles) -> str:
        return f'[tls]\ncert = "{files.cert}"\nkey = "{files.key}"\n'

    def live(self, server: str) -> LiveConfig:
        return self.plain if server == "plain" else self.tls


def client_of(
    running: Running, live: LiveConfig, name: str, transport: str, tls: ClientTls | None
) -> BlockClient:
    return BlockClient(running.address, live.principals[name].token, **_options(transport, tls))  # type: ignore[arg-type]


def bulk_of(running: Running) -> BulkServer:
    assert running.server.server is not None and running.server.server.bulk is not None
    return running.server.server.bulk


def refused(client: BlockClient, tenant: str) -> bool:
    try:
        client.lookup(tenant, MODEL, [digest("probe", 0)])
    except Exception as error:
        code = getattr(error, "code", None)
        code = code() if callable(code) else code
        return code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)
    return False


@dataclass
class Load:
    """One client of a principal that stays: puts new blocks, reads them back."""

    name: str
    tenant: str
    client: BlockClient
    acknowledged: list[bytes] = field(default_factory=list)
    requests: int = 0
    failures: list[str] = field(default_factory=list)

    def run(self, stop: threading.Event) -> None:
        for n in itertools.count():
            if stop.is_set():
                return
            digests = [digest(f"{self.name}/{self.tenant}", 2 * n + i) for i in range(2)]
            try:
                self.client.put(self.tenant, MODEL, digests, [BLOCK, BLOCK])
                self.acknowledged += digests
                got = self.client.get(self.tenant, MODEL, digests)
                self.requests += 2
                if got != [BLOCK, BLOCK]:
                    self.failures.append(f"read back {len(got)} of 2 just put")
            except Exception as error:  # any failure of a principal that stays counts
                self.failures.append(f"{type(error).__name__}: {error}")


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Fleet, Running, Running]]:
    fleet = Fleet(tmp_path)
    plain = start(fleet.plain)
    try:
        tls = start(fleet.tls)
    except BaseException:
        plain.stop()
        raise
    try:
        yield fleet, plain, tls
    finally:
        tls.stop()
        plain.stop()


class Reloads:
    """Both servers reloaded on a thread of its own, so that the test watches the
    victims while a reload runs: `sent` holds when each reload's request went out."""

    def __init__(self, fleet: Fleet, plain: Running, tls: Running) -> None:
        self.sent: dict[str, float] = {}
        self.failures: list[str] = []
        self._jobs = (
            ("plain", plain, fleet.plain, None),
            ("tls", tls, fleet.tls, fleet.client_tls),
        )
        for _, _, live, _ in self._jobs:
            live.write()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def _run(self) -> None:
        for server, running, live, client_tls in self._jobs:
            self.sent[server] = time.monotonic()
            reply = request_reload(running.address, live.principals["root"].token, client_tls)
            if not reply.applied:
                self.failures.append(reply.message)

    def sent_at(self, server: str) -> float:
        while server not in self.sent:
            time.sleep(0.001)
        return self.sent[server]

    def join(self) -> None:
        self._thread.join(60)
        assert self.failures == []


def change(fleet: Fleet, n: int) -> None:
    """Reload n's edits: a tenant and a principal of it added, the previous ones
    removed, the quota tenant's quota lowered or raised, the certificate rotated once."""
    for live in (fleet.plain, fleet.tls):
        live.tenants.pop(f"x{n - 1}", None)
        live.principals.pop(f"p{n - 1}", None)
        live.tenants[f"x{n}"] = 0
        live.principals[f"p{n}"] = Grant([f"x{n}"], RW, requests_per_s=100 + n)
    if n == RELOADS // 2:
        fleet.tls.extra = fleet._tls_table(fleet.certs[1])


def fill_quota_tenant(running: Running, live: LiveConfig, round_: int = 0) -> None:
    """Fill the quota tenant `q` up to QUOTA_BLOCKS blocks with new ones."""
    digests = [digest(f"q{round_}", i) for i in range(QUOTA_BLOCKS)]
    with BlockClient(running.address, live.principals["root"].token, bulk=False) as c:
        c.put("q", MODEL, digests, [BLOCK] * QUOTA_BLOCKS)


def record_delegations(running: Running) -> list[str]:
    """The principals whose connections the server hands to a bulk worker from now on
    (the real hand-over, observed)."""
    server = running.server.server
    assert server is not None and server.workers is not None
    workers = server.workers
    real = workers.delegate
    names: list[str] = []

    def delegate(raw: socket.socket, grant: TicketGrant, to_a_worker: bool) -> socket.socket | None:
        handed = real(raw, grant, to_a_worker)
        if handed is not None:
            names.append(grant.principal.name)
        return handed

    workers.delegate = delegate  # type: ignore[method-assign,assignment]
    return names


def all_closed(bulk: BulkServer, principal: str) -> Callable[[], bool]:
    return lambda: bulk.connections_of(principal) == 0


def within_quota(running: Running, quota: int) -> Callable[[], bool]:
    return lambda: running.store.tenant_usage(TenantId("q"))[1] <= quota


def seconds_until(condition: Callable[[], bool], started: float, limit_s: float = 10.0) -> float:
    while not condition():
        if time.monotonic() - started > limit_s:
            raise AssertionError(f"not within {limit_s} s")
        time.sleep(0.005)
    return time.monotonic() - started


def test_reloads_under_load_lose_nothing_and_revoke_within_a_second(
    fleet: tuple[Fleet, Running, Running],
) -> None:
    config, plain, tls = fleet
    servers = {"plain": (plain, None), "tls": (tls, config.client_tls)}
    fill_quota_tenant(plain, config.plain)
    delegated = record_delegations(plain)
    # The victims' connections, opened by a read each (a read keeps a worker's turn).
    for victim in config.victims:
        running, client_tls = servers[victim.server]
        live = config.live(victim.server)
        tenant = live.principals[victim.name].tenants[0]
        for _ in range(3 if victim.transport == "bulk-tcp" else 1):  # a worker takes one in turn
            client = client_of(running, live, victim.name, victim.transport, client_tls)
            client.get(tenant, MODEL, [digest("victim", 0)])
            victim.clients.append(client)
        if victim.transport != "grpc":
            assert bulk_of(running).connections_of(victim.name) == len(victim.clients)
    assert "v-worker" in delegated  # a bulk worker serves one of its connections
    # 8 clients of 4 tenants, principals that stay: 6 on the plaintext server over each
    # of its transports, 2 over TLS.
    plan = [
        ("plain", "s0", "grpc"), ("plain", "s1", "bulk-tcp"), ("plain", "s2", "same-host"),
        ("plain", "s3", "bulk-tcp"), ("plain", "s0", "bulk-tcp"), ("plain", "s1", "same-host"),
        ("tls", "s2", "tls"), ("tls", "s3", "grpc"),
    ]  # fmt: skip
    loads = []
    for server, name, transport in plan:
        running, client_tls = servers[server]
        live = config.live(server)
        client = client_of(running, live, name, transport, client_tls)
        loads.append(Load(f"{server}-{name}-{transport}", live.principals[name].tenants[0], client))
    stop = threading.Event()
    threads = [threading.Thread(target=load.run, args=(stop,)) for load in loads]
    for thread in threads:
        thread.start()
    quota_held_s: list[float] = []
    try:
        started = time.monotonic()
        for n in range(1, RELOADS + 1):
            change(config, n)
            victims = [v for v in config.victims if v.reload == n]
            for victim in victims:
                del config.live(victim.server).principals[victim.name]
            quota = (QUOTA_BLOCKS // 4 if n % 2 else QUOTA_BLOCKS) * len(BLOCK)
            config.plain.tenants["q"] = quota
            reloads = Reloads(config, plain, tls)
            for victim in victims:
                sent = reloads.sent_at(victim.server)
                running, _ = servers[victim.server]
                tenant = "sealed" if victim.transport == "sealed" else "t0"
                bulk = bulk_of(running)
                # Measured from the reload's request: its open connections closed by the
                # server, then a call of one of its clients refused; its other clients
                # are refused too (not timed: each waits its turn on a busy machine).
                victim.closed_after_s = seconds_until(all_closed(bulk, victim.name), sent)
                victim.refused_after_s = seconds_until(
                    partial(refused, victim.clients[0], tenant), sent
                )
                assert all(refused(c, tenant) for c in victim.clients), victim.name
            if n % 2:
                quota_held_s.append(
                    seconds_until(within_quota(plain, quota), reloads.sent_at("plain"))
                )
            reloads.join()
            if not n % 2:  # the quota is raised again: fill it, for the next to lower
                fill_quota_tenant(plain, config.plain, n)
            # Spread the reloads over the load.
            time.sleep(max(0.0, started + n * LOAD_S / (RELOADS + 1) - time.monotonic()))
        time.sleep(max(0.0, started + LOAD_S - time.monotonic()))
    finally:
        stop.set()
        for thread in threads:
            thread.join(60)
    try:
        for victim in config.victims:
            timings = (victim.name, victim.closed_after_s, victim.refused_after_s)
            assert victim.closed_after_s is not None and victim.refused_after_s is not None
            assert victim.closed_after_s < WITHIN_S and victim.refused_after_s < WITHIN_S, timings
        assert len(quota_held_s) == RELOADS // 2
        assert max(quota_held_s) < WITHIN_S, quota_held_s
        for load in loads:
            assert load.failures == [], (load.name, load.failures[:3])
            assert load.requests > 0, load.name
            # Nothing acknowledged is lost: every block put is still there.
            for start_at in range(0, len(load.acknowledged), 256):
                chunk = load.acknowledged[start_at : start_at + 256]
                assert load.client.lookup(load.tenant, MODEL, chunk) == len(chunk), load.name
    finally:
        for load in loads:
            load.client.close()
        for victim in config.victims:
            for client in victim.clients:
                client.close()
