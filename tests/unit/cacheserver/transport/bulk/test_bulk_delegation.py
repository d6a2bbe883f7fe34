"""What the server and a bulk read worker tell each other
(cacheserver.transport.bulk.delegation), and the tenant-scoped namer a worker gets
(policy.naming.TenantNamer)."""

from __future__ import annotations

import dataclasses
import os

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cacheserver.core.readonly import Grants
from cacheserver.core.served import TenantReport
from cacheserver.transport.bulk import delegation as d
from policy import Action, Principal
from policy.naming import BlockNamer
from policy.permissions import PublicScope
from policy.types import BlockDigest, ModelName, StorageKey, TenantId


def test_a_delegation_round_trips_its_grants_and_a_bad_key_is_refused() -> None:
    alpha = TenantId("alpha")
    principal = Principal("p", frozenset({alpha}), frozenset({Action.READ, Action.WRITE}), 7)
    public = PublicScope(True, frozenset({alpha}))
    grants = Grants(principal, alpha, os.urandom(32), public, 5000, 2, 8192)
    sent = d.Delegation.of(grants, 300.0, 1 << 25)
    received = d.Delegation.decode(sent.encode())
    assert received == sent
    assert received.grants() == grants  # data, from which the worker decides
    assert sent.naming_key.hex() not in repr(sent)  # never in a log line
    assert grants.naming_key.hex() not in repr(grants)
    short = dataclasses.replace(sent, naming_key=b"k")
    with pytest.raises(ValueError):
        d.Delegation.decode(short.encode())


@given(st.integers(0, 3000), st.integers(0, 10), st.integers(0, 10))
def test_reports_round_trip_and_stay_under_the_datagram_size(
    keys: int, lookups: int, gets: int
) -> None:
    report = TenantReport(lookups, lookups * 64, lookups * 60, gets, gets * 3, gets * 3)
    report.served_blocks, report.bytes_served = gets * 3, gets * 4096
    report.keys = {StorageKey(i.to_bytes(32, "big")) for i in range(keys)}
    datagrams = list(d.encode_reports({TenantId("alpha"): report}))
    assert all(len(datagram) <= d.MAX_REPORT_BYTES for datagram in datagrams)
    decoded = [d.decode_report(datagram) for datagram in datagrams]
    assert {tenant for tenant, _ in decoded} == {"alpha"}
    assert set().union(*(r.keys for _, r in decoded)) == report.keys
    assert sum(r.lookups for _, r in decoded) == lookups
    assert sum(r.bytes_served for _, r in decoded) == gets * 4096
    assert decoded[0][1].counts() == report.counts()  # every count, in the first


def test_a_truncated_report_is_refused() -> None:
    report = TenantReport(1, 1, 1, keys={StorageKey(bytes(32))})
    [datagram] = d.encode_reports({TenantId("alpha"): report})
    with pytest.raises(ValueError):
        d.decode_report(datagram[:-1])


def test_a_tenant_namer_names_as_the_server_does_and_only_its_tenant() -> None:
    namer = BlockNamer(os.urandom(32), {TenantId("alpha"): 3})
    alpha = namer.tenant_namer(TenantId("alpha"))
    model, digests = ModelName("m"), [BlockDigest(os.urandom(32)) for _ in range(5)]
    assert alpha.storage_keys(model, digests) == namer.storage_keys(
        TenantId("alpha"), model, digests
    )
    assert alpha.storage_keys(model, digests) != namer.storage_keys(
        TenantId("beta"), model, digests
    )
