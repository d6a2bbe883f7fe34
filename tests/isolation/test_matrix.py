"""Every RPC of the service descriptor x every kind of caller, over TLS and over mTLS.

Callers: no credential, a wrong token, the principal of the other tenant, and the
owner. The owner's call is the positive control in the same test: it must succeed and
hit, so a denial cannot pass just because the store is empty or caching is off. Each
denied call is also checked for having no effect on the owner's data.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf import descriptor as _descriptor

from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import Certs
from tests.support.isolation import MODEL, Served, isolation_config, serve
from tests.support.rpc import METHODS, bearer, invoke


@dataclass
class Probe:
    """One call of a method naming `tenant`, and what the owner must see afterwards."""

    request: Any
    owner_sees: Callable[[Any], None]  # checks the owner's response (the positive control)
    unchanged: Callable[[], None]  # after a refused call: the owner's data is as it was


def probe(method: _descriptor.MethodDescriptor, owner: BlockClient, tenant: str) -> Probe:
    """A request for `method` against `tenant`, set up so the owner's call hits.

    `owner` is an admin client used to seed and check alpha's data out of band.
    """
    digest, payload = os.urandom(32), os.urandom(1000)
    owner.put("alpha", MODEL, [digest], [payload])
    fresh = os.urandom(32)

    def still_there() -> None:
        assert owner.get("alpha", MODEL, [digest]) == [payload]
        assert owner.lookup("alpha", MODEL, [fresh]) == 0

    if method.name in ("Lookup", "Get"):
        cls: Any = pb.LookupRequest if method.name == "Lookup" else pb.GetRequest
        request: Any = cls(tenant=tenant, model=MODEL, digests=[digest])
        if method.name == "Lookup":
            return Probe(request, lambda r: _eq(r.present, 1), still_there)
        return Probe(request, lambda r: _eq(_joined(r), payload), still_there)
    if method.name == "Put":
        frames = [
            pb.PutFrame(
                header=pb.PutHeader(tenant=tenant, model=MODEL),
                chunks=[pb.PutChunk(digest=fresh, block_bytes=5, offset=0, data=b"hello")],
            )
        ]

        def stored(response: Any) -> None:
            assert [r.outcome for r in response.results] == [pb.PUT_OUTCOME_STORED]
            assert owner.get("alpha", MODEL, [fresh]) == [b"hello"]

        return Probe(frames, stored, still_there)
    if method.name == "Delete":
        request = pb.DeleteRequest(tenant=tenant, model=MODEL, digests=[digest])

        def deleted(response: Any) -> None:
            assert response.deleted == 1
            assert owner.lookup("alpha", MODEL, [digest]) == 0

        return Probe(request, deleted, still_there)
    if method.name == "Stats":
        return Probe(pb.StatsRequest(), lambda r: _sees_alpha(r, True), still_there)
    if method.name == "OpenBulk":  # a one-time ticket for the bulk channel, bound to alpha

        def ticket(response: Any) -> None:
            assert len(response.ticket) == 32 and response.address

        return Probe(pb.OpenBulkRequest(tenant=tenant), ticket, still_there)
    if method.name == "Reload":  # an admin call: its owner is `root` (ADMIN_ONLY)

        def answered(response: Any) -> None:
            # These servers were started from a config built in code: nothing to reload,
            # so a refusal that says so, with the generation serving.
            assert not response.applied and response.generation == 1

        return Probe(pb.ReloadRequest(), answered, still_there)
    raise AssertionError(f"new RPC {method.name}: add it to the isolation matrix")


# RPCs whose positive control is an admin's (`root`): the tenant's owner may not call them.
ADMIN_ONLY = frozenset({"Reload"})


def _eq(found: object, expected: object) -> None:
    assert found == expected


def _joined(frames: list[Any]) -> bytes:
    return b"".join(c.data for f in frames for c in f.chunks)


def _sees_alpha(response: Any, expected: bool) -> None:
    tenants = {t.tenant: t for t in response.tenants}
    assert ("alpha" in tenants) is expected
    if expected:
        assert tenants["alpha"].blocks >= 1


def _refused(call: Callable[[], Any], code: grpc.StatusCode) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    return info.value


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Served]:
    running = serve(isolation_config(tmp_path_factory.mktemp("tls"), certs), certs)
    yield running
    running.stop()


@pytest.fixture(scope="module")
def mtls_server(tmp_path_factory: pytest.TempPathFactory, certs: Certs) -> Iterator[Served]:
    running = serve(isolation_config(tmp_path_factory.mktemp("mtls"), certs, mtls=True), certs)
    yield running
    running.stop()


def _channel(served: Served, tls: ClientTls | None) -> grpc.Channel:
    assert tls is not None
    return grpc.secure_channel(served.address, tls.credentials())


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_rpc_over_tls_by_every_kind_of_token_caller(
    tls_server: Served, method: _descriptor.MethodDescriptor
) -> None:
    owner_token = tls_server.tokens["root" if method.name in ADMIN_ONLY else "a"]
    unauthenticated = {
        "no credential": (),
        "wrong token": bearer("not-a-token"),
        "owner's token without 'Bearer'": (("authorization", owner_token),),
    }
    with tls_server.client("root") as root, _channel(tls_server, tls_server.tls()) as channel:
        p = probe(method, root, "alpha")
        for kind, metadata in unauthenticated.items():
            error = _refused(
                lambda m=metadata: invoke(channel, method, p.request, m),  # type: ignore[misc]
                grpc.StatusCode.UNAUTHENTICATED,
            )
            assert owner_token not in (error.details() or ""), kind
            p.unchanged()
        other = bearer(tls_server.tokens["b"])
        _refused_or_invisible(lambda: invoke(channel, method, p.request, other), method)
        p.unchanged()
        p.owner_sees(invoke(channel, method, p.request, bearer(owner_token)))


def _refused_or_invisible(call: Callable[[], Any], method: _descriptor.MethodDescriptor) -> None:
    """The other tenant's principal: PERMISSION_DENIED, or (Stats) no sight of alpha."""
    if method.name == "Stats":
        response = call()
        _sees_alpha(response, False)
        assert {t.tenant for t in response.tenants} == {"beta"}
        return
    error = _refused(call, grpc.StatusCode.PERMISSION_DENIED)
    assert "alpha" not in (error.details() or "")  # never echoes the tenant it refused


@pytest.mark.parametrize("method", METHODS, ids=lambda m: m.name)
def test_every_rpc_over_mtls_by_every_kind_of_certificate(
    mtls_server: Served, certs: Certs, method: _descriptor.MethodDescriptor
) -> None:
    with mtls_server.client("root", cert="stranger") as root:
        p = probe(method, root, "alpha")
        _mtls_matrix(mtls_server, certs, method, p)


def _mtls_matrix(
    mtls_server: Served, certs: Certs, method: _descriptor.MethodDescriptor, p: Probe
) -> None:
    root_only = ClientTls(root_ca=certs.ca.cert_path)
    rogue = ClientTls(certs.ca.cert_path, certs.other_ca_client.cert, certs.other_ca_client.key)
    for tls in (root_only, rogue):  # no certificate, or one from an untrusted CA: no handshake
        with _channel(mtls_server, tls) as channel:
            _refused(
                lambda c=channel: invoke(c, method, p.request, timeout_s=5),  # type: ignore[misc]
                grpc.StatusCode.UNAVAILABLE,
            )
    with _channel(mtls_server, mtls_server.tls("stranger")) as channel:  # valid, mapped to nobody
        _refused(lambda: invoke(channel, method, p.request), grpc.StatusCode.UNAUTHENTICATED)
    with _channel(mtls_server, mtls_server.tls("cert-a")) as channel:  # owner cert, wrong token
        _refused(
            lambda: invoke(channel, method, p.request, bearer("wrong")),
            grpc.StatusCode.UNAUTHENTICATED,
        )
    p.unchanged()
    with _channel(mtls_server, mtls_server.tls("cert-b")) as channel:
        _refused_or_invisible(lambda: invoke(channel, method, p.request), method)
    p.unchanged()
    if method.name in ADMIN_ONLY:  # cert-a may not: denied like cert-b; root's token may
        with _channel(mtls_server, mtls_server.tls("cert-a")) as channel:
            _refused(lambda: invoke(channel, method, p.request), grpc.StatusCode.PERMISSION_DENIED)
        with _channel(mtls_server, mtls_server.tls("stranger")) as channel:
            p.owner_sees(invoke(channel, method, p.request, bearer(mtls_server.tokens["root"])))
        return
    with _channel(mtls_server, mtls_server.tls("cert-a")) as channel:
        p.owner_sees(invoke(channel, method, p.request))


def test_denial_is_the_same_whether_or_not_the_tenant_exists(tls_server: Served) -> None:
    digest = os.urandom(32)
    with tls_server.client("b") as b, tls_server.client("a") as a:
        a.put("alpha", MODEL, [digest], [b"x"])
        answers = set()
        for tenant in ("alpha", "gamma", "no-such-tenant"):
            for call in (
                lambda t=tenant: b.lookup(t, MODEL, [digest]),
                lambda t=tenant: b.get(t, MODEL, [digest]),
                lambda t=tenant: b.put(t, MODEL, [digest], [b"y"]),
                lambda t=tenant: b.delete(t, MODEL, [digest]),
                lambda t=tenant: b.delete_tenant(t),
            ):
                with pytest.raises(Exception) as info:
                    call()
                answers.add((info.value.code(), info.value.details()))  # type: ignore[attr-defined]
        assert len({code for code, _ in answers}) == 1
        assert {code for code, _ in answers} == {grpc.StatusCode.PERMISSION_DENIED}
        details = {d for _, d in answers}
        assert all("alpha" not in d and "gamma" not in d for d in details)
        assert a.lookup("alpha", MODEL, [digest]) == 1  # positive control
        assert b.lookup("beta", MODEL, [digest]) == 0  # b's own tenant works: a miss


def test_a_client_for_the_other_tenant_cannot_name_the_tenant_in_any_client_method(
    tls_server: Served,
) -> None:
    """The hand-written client too (docs/design.md §9 names), with the owner's hit as control."""
    digest = os.urandom(32)
    with tls_server.client("a") as a, tls_server.client("b") as b:
        a.put("alpha", MODEL, [digest], [b"secret"])
        calls: list[Callable[[BlockClient], Any]] = [
            lambda c: c.lookup("alpha", MODEL, [digest]),
            lambda c: c.get("alpha", MODEL, [digest]),
            lambda c: c.put("alpha", MODEL, [digest], [b"poison"]),
            lambda c: c.delete("alpha", MODEL, [digest]),
        ]
        for call in calls:
            with pytest.raises(Exception) as info:
                call(b)
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
        assert a.get("alpha", MODEL, [digest]) == [b"secret"]
