"""The request core without sockets: a real BlockStore in tmp_path, a real AccessPolicy,
and a table of requests (principal, verb, tenant, model, digests, sizes) with the result
or the KvshareError class each gets. Every refusal has a positive control in the table
(the same request, corrected, succeeds), so no row passes because nothing works."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cacheserver.blocks import BlockSource, BytesSource
from cacheserver.config import LimitsConfig, StorageConfig
from cacheserver.core.requests import RequestCore, Sources
from cacheserver.core.values import Verb
from cacheserver.events import TenantCounters
from cacheserver.store import BlockStore
from kvcommon.errors import (
    InvalidArgument,
    KvshareError,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from policy import AccessPolicy, Action, Principal
from policy.config import AccessConfig, TenantConfig
from policy.ratelimit import RequestRateLimiter
from policy.sealing import looks_sealed
from policy.types import TenantId

KiB = 1 << 10
ALPHA, BETA, SEALED = TenantId("alpha"), TenantId("beta"), TenantId("sealed")
MODEL = "core/model;fp16"
MAX_DIGESTS = 4
MAX_BLOCK_BYTES = 128 * KiB
BETA_QUOTA = 64 * KiB
RW = frozenset({Action.READ, Action.WRITE})

WRITER = Principal("writer", frozenset({ALPHA, SEALED}), RW)
READER = Principal("reader", frozenset({ALPHA}), frozenset({Action.READ}))
BETA_WRITER = Principal("beta-writer", frozenset({BETA}), RW)
ADMIN = Principal("admin", frozenset({ALPHA}), RW | {Action.ADMIN})
SLOW = Principal("slow", frozenset({ALPHA}), RW, requests_per_s=1)  # a burst of one


class FakeClock:
    now_s = 1000.0

    def __call__(self) -> float:
        return self.now_s


@pytest.fixture
def core(tmp_path: Path) -> Iterator[RequestCore]:
    tenants = (
        TenantConfig(ALPHA),
        TenantConfig(BETA, quota_bytes=BETA_QUOTA),
        TenantConfig(SEALED, require_sealed=True),
    )
    quotas = {t.id: t.quota_bytes for t in tenants if t.quota_bytes}
    limiter = RequestRateLimiter(0, burst_s=1, clock=FakeClock())  # 0: unlimited but SLOW
    policy = AccessPolicy.from_access(AccessConfig(tenants, ()), bytes(32), limiter=limiter)
    storage = StorageConfig(
        memory_budget_bytes=4 << 20, disk_budget_bytes=64 << 20, sync_interval_ms=0
    )
    counters = TenantCounters()
    store = BlockStore(
        tmp_path / "data", storage, quotas, {t.id: 0 for t in tenants}, events=counters
    )
    limits = LimitsConfig(max_digests_per_call=MAX_DIGESTS, max_block_bytes=MAX_BLOCK_BYTES)
    try:
        yield RequestCore(store, policy, limits, counters, receive_bytes=100 * KiB)
    finally:
        store.close()


def digests(count: int, length: int = 32) -> list[bytes]:
    return [os.urandom(length) for _ in range(count)]


def sources_of(payloads: Sequence[bytes]) -> Sources:
    def sources(sizes: Sequence[int]) -> list[BlockSource]:
        assert list(sizes) == [len(p) for p in payloads]
        return [BytesSource(p) for p in payloads]

    return sources


@dataclass(frozen=True)
class Row:
    name: str
    principal: Principal
    verb: Verb
    tenant: str
    expected: type[KvshareError] | object  # a result, or the error class
    model: str = MODEL
    count: int = 1
    digest_bytes: int = 32
    sizes: Sequence[int] = field(default_factory=lambda: [64])


def run(core: RequestCore, row: Row) -> object:
    """The row's request, as a transport would make it: `begin`, then the verb."""
    ds = digests(row.count, row.digest_bytes)
    begun = core.begin(row.principal, row.verb, row.tenant, len(ds))
    if row.verb is Verb.LOOKUP:
        return core.lookup(begun, row.model, ds)
    if row.verb is Verb.GET:
        with core.get(begun, row.model, ds) as reply:
            return [bytes(p) for batch in reply for p in batch.payloads]
    if row.verb is Verb.DELETE:
        return core.delete(begun, row.model, ds)
    payloads = [os.urandom(size) for size in row.sizes] * row.count
    sizes = [len(p) for p in payloads]
    return core.put_blocks(begun, row.model, ds, sizes, sources_of(payloads))


ROWS: Sequence[Row] = (
    Row("a get of the writer's tenant", WRITER, Verb.GET, ALPHA, []),
    Row("another tenant's get", WRITER, Verb.GET, BETA, PermissionDenied),
    Row("another tenant's lookup", WRITER, Verb.LOOKUP, BETA, PermissionDenied),
    Row("a lookup of its own tenant", WRITER, Verb.LOOKUP, ALPHA, 0),
    Row("a malformed tenant id", WRITER, Verb.GET, "Alpha!", InvalidArgument),
    Row("a reader's get", READER, Verb.GET, ALPHA, []),
    Row("a reader's put", READER, Verb.PUT, ALPHA, PermissionDenied),
    Row("a reader's delete", READER, Verb.DELETE, ALPHA, PermissionDenied),
    Row("a writer's put", WRITER, Verb.PUT, ALPHA, [True]),
    Row("a writer's delete", WRITER, Verb.DELETE, ALPHA, 0),
    Row("too many digests", WRITER, Verb.GET, ALPHA, InvalidArgument, count=MAX_DIGESTS + 1),
    Row("as many digests as allowed", WRITER, Verb.GET, ALPHA, [], count=MAX_DIGESTS),
    Row("too many digests on a tenant not granted: tenant first", WRITER, Verb.GET, BETA,
        PermissionDenied, count=MAX_DIGESTS + 1),
    Row("a put of too many blocks without write: action first", READER, Verb.PUT, ALPHA,
        PermissionDenied, count=MAX_DIGESTS + 1),
    Row("a put of too many blocks", WRITER, Verb.PUT, ALPHA, InvalidArgument,
        count=MAX_DIGESTS + 1),
    Row("a 31-byte digest", WRITER, Verb.LOOKUP, ALPHA, InvalidArgument, digest_bytes=31),
    Row("a 33-byte digest", WRITER, Verb.GET, ALPHA, InvalidArgument, digest_bytes=33),
    Row("an empty model", WRITER, Verb.GET, ALPHA, InvalidArgument, model=""),
    Row("a model over 512 characters", WRITER, Verb.PUT, ALPHA, InvalidArgument,
        model="m" * 513),
    Row("a model of 512 characters", WRITER, Verb.PUT, ALPHA, [True], model="m" * 512),
    Row("a block over max_block_bytes", WRITER, Verb.PUT, ALPHA, InvalidArgument,
        sizes=[MAX_BLOCK_BYTES + 1]),
    Row("a block of max_block_bytes", WRITER, Verb.PUT, ALPHA, [True],
        sizes=[MAX_BLOCK_BYTES]),
    Row("an empty block", WRITER, Verb.PUT, ALPHA, InvalidArgument, sizes=[0]),
    Row("a block over the tenant's quota", BETA_WRITER, Verb.PUT, BETA, ResourceExhausted,
        sizes=[BETA_QUOTA + 1]),
    Row("a block the size of the quota", BETA_WRITER, Verb.PUT, BETA, [True],
        sizes=[BETA_QUOTA]),
    Row("a plaintext block where sealed blocks are required", WRITER, Verb.PUT, SEALED,
        InvalidArgument),
)  # fmt: skip


@pytest.mark.parametrize("row", ROWS, ids=[r.name for r in ROWS])
def test_each_request_gets_its_result_or_its_error(core: RequestCore, row: Row) -> None:
    if isinstance(row.expected, type) and issubclass(row.expected, KvshareError):
        with pytest.raises(row.expected) as info:
            run(core, row)
        assert type(info.value) is row.expected
    else:
        assert run(core, row) == row.expected


def test_the_rate_is_checked_first_once_per_request(core: RequestCore) -> None:
    assert run(core, Row("", SLOW, Verb.LOOKUP, ALPHA, 0)) == 0  # its burst of one
    for tenant in (ALPHA, BETA):  # over its rate: refused before the tenant is looked at
        with pytest.raises(ResourceExhausted, match="requests/s"):
            core.begin(SLOW, Verb.GET, tenant, 1)
    with pytest.raises(ResourceExhausted):
        core.stats(SLOW)
    assert core.begin(WRITER, Verb.GET, ALPHA, 1).tenant == ALPHA  # control: per principal


def test_put_then_get_lookup_and_delete(core: RequestCore) -> None:
    ds, payloads = digests(3), [os.urandom(100 + i) for i in range(3)]
    sizes = [len(p) for p in payloads]
    put = core.begin(WRITER, Verb.PUT, ALPHA, 3)
    assert core.put_blocks(put, MODEL, ds, sizes, sources_of(payloads)) == [True] * 3
    put = core.begin(WRITER, Verb.PUT, ALPHA, 3)
    assert core.put_blocks(put, MODEL, ds, sizes, sources_of(payloads)) == [False] * 3
    assert core.lookup(core.begin(READER, Verb.LOOKUP, ALPHA, 3), MODEL, ds) == 3
    with core.get(core.begin(READER, Verb.GET, ALPHA, 3), MODEL, ds) as reply:
        batches = list(reply)
    assert [b.first_index for b in batches] == [0]
    assert [bytes(p) for b in batches for p in b.payloads] == payloads and batches[-1].final
    # Another model names other blocks; another tenant cannot see these at all.
    assert core.lookup(core.begin(READER, Verb.LOOKUP, ALPHA, 3), MODEL + "x", ds) == 0
    assert core.delete(core.begin(WRITER, Verb.DELETE, ALPHA, 1), MODEL, ds[1:2]) == 1
    assert core.lookup(core.begin(READER, Verb.LOOKUP, ALPHA, 3), MODEL, ds) == 1


def test_the_first_block_a_transport_does_not_accept_ends_the_reply(core: RequestCore) -> None:
    ds, payloads = digests(3), [b"a" * 64, b"b" * 64, b"c" * 64]
    put = core.begin(WRITER, Verb.PUT, ALPHA, 3)
    core.put_blocks(put, MODEL, ds, [64] * 3, sources_of(payloads))
    begun = core.begin(WRITER, Verb.GET, ALPHA, 3)
    with core.get(begun, MODEL, ds, accept=lambda p: bytes(p[:1]) != b"b") as reply:
        batches = list(reply)
    assert [(b.first_index, [bytes(p) for p in b.payloads], b.final) for b in batches] == [
        (0, [b"a" * 64], True)
    ]
    begun = core.begin(WRITER, Verb.GET, ALPHA, 3)
    with core.get(begun, MODEL, ds, accept=looks_sealed) as reply:  # the sealed channel's
        assert [list(b.payloads) for b in reply] == [[]]


def test_a_held_block_takes_the_receive_budget_until_it_is_stored(core: RequestCore) -> None:
    """A transport that keeps a block's bytes while they arrive (gRPC) holds them
    against the receive budget (100 KiB here; one tenant's share: half)."""
    with core.put(core.begin(WRITER, Verb.PUT, ALPHA, 0), MODEL) as stream:
        first = stream.announce(os.urandom(32), 60 * KiB, hold=True)
        with pytest.raises(ResourceExhausted, match="max_pending_write_bytes"):
            stream.announce(os.urandom(32), 60 * KiB, hold=True)
        assert stream.store(first, BytesSource(os.urandom(60 * KiB))).result(timeout=30)
        second = stream.announce(os.urandom(32), 60 * KiB, hold=True)  # room again
    # The stream ended with `second` never stored: its bytes left the budget.
    with core.put(core.begin(WRITER, Verb.PUT, ALPHA, 0), MODEL) as stream:
        stream.announce(os.urandom(32), 60 * KiB, hold=True)
    assert second.index == 1


def test_delete_namespace_needs_admin_and_stats_show_the_tenants(core: RequestCore) -> None:
    put = core.begin(ADMIN, Verb.PUT, ALPHA, 2)
    core.put_blocks(put, MODEL, digests(2), [10, 10], sources_of([b"x" * 10, b"y" * 10]))
    with pytest.raises(PermissionDenied):
        core.begin(WRITER, Verb.DELETE_NAMESPACE, ALPHA, 0)
    stats = core.stats(ADMIN)
    assert [(v.tenant, v.blocks) for v in stats.tenants] == [(ALPHA, 2)]
    assert "memory" in stats.tiers
    assert core.stats(WRITER).tiers == {}  # tiers are for admins
    begun = core.begin(ADMIN, Verb.DELETE_NAMESPACE, ALPHA, 0)
    assert core.delete_namespace(begun, "") == 2
    assert core.stats(ADMIN).tenants[0].blocks == 0


def test_open_bulk_without_a_listener_is_unavailable(core: RequestCore) -> None:
    with pytest.raises(Unavailable):
        core.open_bulk(WRITER, ALPHA)
