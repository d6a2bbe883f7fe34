"""A read worker's connection (cacheserver.transport.bulk.readworker) decides with the
request core's own admission, run on the data the server delegated (its grants): so
the permission decision the server's policy makes is the one the worker applies, even
when that decision changes after the connection was delegated.

Real parts, in one process: the server's policy and delegation code, LMDB written by
the server's tier (then closed: one process must not open an environment twice) and
read by the worker's core, the worker's connection over real sockets (a socket pair
stands for the delegated TCP connection, a SEQPACKET pair for its hand-back pair).
The test plays the server's end of the hand-back pair.
"""

from __future__ import annotations

import dataclasses
import os
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from cacheserver.config import ServerConfig
from cacheserver.core.readonly import ReadOnlyCore
from cacheserver.core.served import EventSums, TenantReport
from cacheserver.tiers import PendingWrite
from cacheserver.tiers.lmdb.tier import LmdbTier
from cacheserver.transport.bulk import delegation as d
from cacheserver.transport.bulk.handler import Pace
from cacheserver.transport.bulk.readworker import Connection
from cacheserver.transport.bulk.readworkers import delegation_for
from kvcommon import bulkio
from kvcommon import bulkwire as w
from kvcommon.errors import PermissionDenied
from policy import AccessPolicy, Action, Principal, permissions
from policy.identity import Authenticator
from policy.naming import BlockNamer
from policy.ratelimit import RequestRateLimiter, SharedBuckets
from policy.tickets import Grant
from policy.types import BlockDigest, ModelName, TenantId

MiB = 1 << 20
ALPHA = TenantId("alpha")
MODEL = "workers/model"
READER = Principal("reader", frozenset({ALPHA}), frozenset({Action.READ, Action.WRITE}))
WRITER = Principal("writer", frozenset({ALPHA}), frozenset({Action.WRITE}))


@dataclasses.dataclass
class Setup:
    policy: AccessPolicy
    limiter: RequestRateLimiter
    core: ReadOnlyCore
    served: EventSums
    digest: bytes
    payload: bytes
    key: bytes


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    """One block of alpha in LMDB, the server's policy, and a worker's core."""
    policy = AccessPolicy(Authenticator([]), BlockNamer(os.urandom(32), {ALPHA: 0}), {ALPHA: 0})
    digest, payload = os.urandom(32), os.urandom(4096)
    [key] = policy.storage_keys(ALPHA, ModelName(MODEL), [BlockDigest(digest)])
    tier = LmdbTier(tmp_path / "lmdb", map_bytes=64 * MiB, sync_writes=False)
    tier.write([PendingWrite(key, ALPHA, 0, 1, payload)], [])
    tier.close()
    buckets = SharedBuckets([READER.name, WRITER.name])
    limiter = RequestRateLimiter(0, shared=buckets)  # unlimited: this test is not the rate's
    served = EventSums()
    core = ReadOnlyCore(tmp_path / "lmdb", 64 * MiB, buckets, served)
    yield Setup(policy, limiter, core, served, digest, payload, key)
    core.close()


class Delegated:
    """A connection as the server delegates it to a worker: the client's end, the
    server's end of the hand-back pair, and the worker's Connection."""

    def __init__(self, setup: Setup, principal: Principal) -> None:
        grant = Grant(principal, ALPHA)
        sent = delegation_for(grant, setup.policy, setup.limiter, ServerConfig())
        grants = d.Delegation.decode(sent.encode()).grants()  # what crosses to the worker
        self.client, self.conn = socket.socketpair()
        self.server, self.handback = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for sock in (self.client, self.conn, self.server, self.handback):
            sock.settimeout(10)
        core = setup.core.bind(grants)
        self.worker = Connection(self.conn, self.handback, core, Pace(MiB, 30.0))

    def close(self) -> None:
        self.worker.close()
        self.client.close()
        self.server.close()

    def ask(self, digest: bytes) -> bytes:
        """Send a GET of `digest`; the request's bytes."""
        model = MODEL.encode()
        request = w.REQUEST.pack(w.OP_GET, len(model), 1) + model + digest
        self.client.sendall(request)
        return request


@pytest.fixture
def delegated(setup: Setup) -> Iterator[tuple[Setup, Delegated, Delegated]]:
    reader, writer = Delegated(setup, READER), Delegated(setup, WRITER)
    yield setup, reader, writer
    reader.close()
    writer.close()


def served_by_the_worker(setup: Setup, delegated: Delegated) -> TenantReport | None:
    """Serve the GET at the head of `delegated`'s socket on the worker; its report (the
    worker's served counters) if it answered, None if it handed the request back
    (the request left whole for the server, its rate drawn)."""
    request = delegated.ask(setup.digest)
    delegated.server.send(d.SERVED_ON)  # the server's answer, should it be handed back
    assert delegated.worker.serve_one()
    reports = setup.served.take()
    delegated.server.settimeout(0)  # what the worker said, if anything: no waiting
    try:
        handed_back = delegated.server.recv(8)
    except BlockingIOError:
        handed_back = b""
    finally:
        delegated.server.settimeout(10)
    if handed_back:
        assert handed_back == d.HAND_BACK + d.RATE_DRAWN
        assert reports == {}
        head = delegated.conn.recv(len(request) + 1, socket.MSG_PEEK)
        assert head == request  # still whole at the head of the socket, for the server
        delegated.conn.recv(len(request))  # as the server would: read it
        return None
    assert delegated.handback.recv(8) == d.SERVED_ON  # the answer it did not need
    assert bulkio.recv_bytes(delegated.client, 1)[0] == w.OK
    (size,) = w.SIZE.unpack(bulkio.recv_bytes(delegated.client, w.SIZE.size))
    assert bytes(bulkio.recv_bytes(delegated.client, size)) == setup.payload
    assert bytes(bulkio.recv_bytes(delegated.client, len(w.END))) == w.END
    return reports[ALPHA]


def test_a_principal_without_read_is_handed_back_and_refused_by_the_server(
    delegated: tuple[Setup, Delegated, Delegated],
) -> None:
    setup, reader, writer = delegated
    # Positive control: the reader's GET is the worker's, counted in its served events.
    report = served_by_the_worker(setup, reader)
    assert report is not None
    assert (report.gets, report.get_asked, report.get_blocks) == (1, 1, 1)
    assert (report.served_blocks, report.bytes_served) == (1, len(setup.payload))
    assert report.keys == {setup.key}
    # The writer may not read: the worker hands its GET back, and the server refuses it.
    assert served_by_the_worker(setup, writer) is None
    with pytest.raises(PermissionDenied):
        setup.policy.admit(WRITER, ALPHA, Action.READ)


def test_a_permission_rule_changed_on_the_server_is_the_one_the_worker_applies(
    delegated: tuple[Setup, Delegated, Delegated], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup, reader, _ = delegated
    assert served_by_the_worker(setup, reader) is not None  # control: served, as delegated
    # The server's permission rule changes after the connection was delegated: nobody
    # may read now. The server refuses the reader; its worker, holding the same grants
    # as before, must refuse too (a rule or decision of its own would still serve).
    rule = permissions.allows

    def no_reads(
        principal: Principal, tenant: TenantId, action: Action, public: permissions.PublicScope
    ) -> bool:
        return action is not Action.READ and rule(principal, tenant, action, public)

    monkeypatch.setattr(permissions, "allows", no_reads)
    with pytest.raises(PermissionDenied):
        setup.policy.admit(READER, ALPHA, Action.READ)
    assert served_by_the_worker(setup, reader) is None
    monkeypatch.undo()
    assert served_by_the_worker(setup, reader) is not None  # and served again
