"""The public scope `@public` (policy/access.py, docs/isolation.md "Public prefixes").

Tenants `alpha` and `beta` read it (`read_public = true`), `gamma` does not. Principal
`publisher` has only the `publish` action and no tenant; `writer` has read, write and
admin on alpha but not publish. Every refusal is paired with a positive control: the
same call by a principal that may make it succeeds and finds the data.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcommon.errors import InvalidArgument, PermissionDenied
from policy.sealing import BlockSealer, Keyring, new_key_entry
from policy.types import PUBLIC
from tests.support.isolation import MODEL, Served, serve
from tests.support.servers import TRANSPORTS, launch, write_config, write_public_config

KiB = 1024
PUBLIC_QUOTA = 64 * KiB
PRINCIPALS = {
    "a": (["alpha"], ["read", "write"]),
    "b": (["beta"], ["read", "write"]),
    "g": (["gamma"], ["read", "write"]),
    "publisher": ([], ["publish"]),
    "writer": (["alpha"], ["read", "write", "admin"]),
    "root": (["alpha", "beta", "gamma"], ["read", "write", "admin"]),
}


def public_config(tmp_path: Path, *, beta_quota: int = 0) -> Served:
    tenancy = write_public_config(
        tmp_path, PRINCIPALS, quota_bytes=PUBLIC_QUOTA, quotas={"beta": beta_quota}
    )
    tenancy.path.write_text(tenancy.path.read_text() + '[[tenants]]\nid = "gamma"\n')
    return serve(tenancy)


@pytest.fixture
def public_server(tmp_path: Path) -> Iterator[Served]:
    running = public_config(tmp_path)
    yield running
    running.stop()


def _denied(call: object) -> str:
    with pytest.raises(PermissionDenied) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    return info.value.details()  # type: ignore[attr-defined,no-any-return]


def _lmdb_blocks(served: Served) -> int:
    with served.client("root") as root:
        return next(t.blocks for t in root.stats().tiers if t.name == "lmdb")


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_two_tenants_read_one_published_prefix_stored_once(
    public_server: Served, transport: str
) -> None:
    prefix = [os.urandom(32) for _ in range(4)]
    blocks = [os.urandom(2 * KiB) for _ in prefix]
    before = _lmdb_blocks(public_server)
    with (
        public_server.client("publisher", transport=transport) as publisher,
        public_server.client("a", transport=transport) as a,
        public_server.client("b", transport=transport) as b,
    ):
        assert publisher.put(PUBLIC, MODEL, prefix, blocks) == [True] * 4
        assert a.get(PUBLIC, MODEL, prefix) == blocks
        assert b.get(PUBLIC, MODEL, prefix) == blocks
        assert a.lookup(PUBLIC, MODEL, prefix) == b.lookup(PUBLIC, MODEL, prefix) == 4
        assert _lmdb_blocks(public_server) - before == 4  # one copy, read by both
        # Each tenant's continuation after the prefix is its own: keyed to the tenant.
        after_a, after_b = [os.urandom(32) for _ in range(2)], [os.urandom(32) for _ in range(2)]
        assert a.put("alpha", MODEL, after_a, [b"alpha's"] * 2) == [True, True]
        assert b.put("beta", MODEL, after_b, [b"beta's"] * 2) == [True, True]
        assert a.get("alpha", MODEL, after_a) == [b"alpha's"] * 2  # positive control
        assert b.lookup("beta", MODEL, after_a) == 0  # the same digests: nothing in beta
        assert b.lookup(PUBLIC, MODEL, after_a) == 0  # and nothing went public
        _denied(lambda: b.get("alpha", MODEL, after_a))
        # The public digests are nobody's private blocks either.
        assert a.lookup("alpha", MODEL, prefix) == 0


def test_only_publishers_write_the_public_scope(public_server: Served) -> None:
    digest, poison = os.urandom(32), os.urandom(KiB)
    with (
        public_server.client("a") as a,
        public_server.client("writer") as writer,
        public_server.client("root") as root,
        public_server.client("publisher") as publisher,
    ):
        for principal in (a, writer, root):
            _denied(lambda p=principal: p.put(PUBLIC, MODEL, [digest], [poison]))
            _denied(lambda p=principal: p.delete(PUBLIC, MODEL, [digest]))
            _denied(lambda p=principal: p.delete_tenant(PUBLIC))
        assert writer.put("alpha", MODEL, [digest], [b"own"]) == [True]  # write still works
        assert publisher.lookup(PUBLIC, MODEL, [digest]) == 0  # nothing was poisoned
        assert publisher.put(PUBLIC, MODEL, [digest], [b"published"]) == [True]  # control
        assert a.get(PUBLIC, MODEL, [digest]) == [b"published"]
        _denied(lambda: writer.delete(PUBLIC, MODEL, [digest]))
        assert publisher.delete(PUBLIC, MODEL, [digest]) == 1  # a publisher retracts
        assert a.lookup(PUBLIC, MODEL, [digest]) == 0
        # The publisher has no tenant: it reaches nothing else.
        _denied(lambda: publisher.get("alpha", MODEL, [digest]))
        _denied(lambda: publisher.put("alpha", MODEL, [os.urandom(32)], [b"x"]))


def test_a_tenant_without_read_public_cannot_read_it(public_server: Served) -> None:
    digest = os.urandom(32)
    with (
        public_server.client("publisher") as publisher,
        public_server.client("g") as g,
        public_server.client("a") as a,
    ):
        assert publisher.put(PUBLIC, MODEL, [digest], [b"prompt"]) == [True]
        refused_public = _denied(lambda: g.lookup(PUBLIC, MODEL, [digest]))
        _denied(lambda: g.get(PUBLIC, MODEL, [digest]))
        # The one fixed denial: the same words as for a tenant that does not exist.
        refused_missing = _denied(lambda: g.lookup("no-such-tenant", MODEL, [digest]))
        assert refused_public.replace(PUBLIC, "") == refused_missing.replace(PUBLIC, "")
        assert a.get(PUBLIC, MODEL, [digest]) == [b"prompt"]  # positive control
    with public_server.client("g", bulk=True, same_host=False) as g:
        _denied(lambda: g.get(PUBLIC, MODEL, [digest]))  # no bulk ticket either


def test_reads_do_not_change_which_public_blocks_stay(tmp_path: Path) -> None:
    """Eviction under the public quota follows put order alone, so what stays cannot
    tell anyone which published block a tenant read. Control: a tenant with a quota of
    the same size keeps the block it read (LRU), so the test would see a read if one
    counted."""
    served = public_config(tmp_path, beta_quota=PUBLIC_QUOTA)
    block = os.urandom(PUBLIC_QUOTA * 2 // 5)  # two fit in the quota, three do not
    first, second, third = (os.urandom(32) for _ in range(3))
    try:
        with served.client("publisher") as publisher, served.client("b") as b:
            assert publisher.put(PUBLIC, MODEL, [first, second], [block, block]) == [True] * 2
            assert b.put("beta", MODEL, [first, second], [block, block]) == [True] * 2
            for _ in range(5):  # a tenant keeps reading the oldest block of each
                assert b.get(PUBLIC, MODEL, [first]) == [block]
                assert b.get("beta", MODEL, [first]) == [block]
            assert publisher.put(PUBLIC, MODEL, [third], [block]) == [True]  # one must go
            assert b.put("beta", MODEL, [third], [block]) == [True]
            assert b.lookup(PUBLIC, MODEL, [first]) == 0  # put first, gone first
            assert b.lookup(PUBLIC, MODEL, [second]) == 1
            assert b.lookup("beta", MODEL, [first]) == 1  # control: the read kept it
            assert b.lookup("beta", MODEL, [second]) == 0
    finally:
        served.stop()


def test_public_reads_show_in_no_tenant_stats(public_server: Served) -> None:
    digest = os.urandom(32)
    with (
        public_server.client("publisher") as publisher,
        public_server.client("a") as a,
        public_server.client("b") as b,
    ):
        assert publisher.put(PUBLIC, MODEL, [digest], [b"prompt"]) == [True]

        def seen_by_a() -> list[tuple[str, int, int]]:
            return [(t.tenant, t.lookups, t.blocks_served) for t in a.stats().tenants]

        before = seen_by_a()
        for _ in range(3):
            assert b.get(PUBLIC, MODEL, [digest]) == [b"prompt"]
        assert seen_by_a() == before
        assert [t.tenant for t in b.stats().tenants] == ["beta"]
        # Control: a's own reads do show in a's stats (a bulk worker's, once it reports:
        # every REPORT_INTERVAL_S).
        a.put("alpha", MODEL, [digest], [b"own"])
        a.get("alpha", MODEL, [digest])
        deadline = time.monotonic() + 5
        while seen_by_a() == before and time.monotonic() < deadline:
            time.sleep(0.05)
        assert seen_by_a() != before


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_a_tenant_requiring_sealed_blocks_refuses_plaintext(tmp_path: Path, bulk: bool) -> None:
    """`require_sealed` (a tenant's, or the public scope's in [public])."""
    tenancy = write_config(
        tmp_path,
        principals=PRINCIPALS,
        extra=f"[public]\nquota_bytes = {PUBLIC_QUOTA}\nrequire_sealed = true\n",
    )
    text = tenancy.path.read_text().replace(
        'id = "alpha"', 'id = "alpha"\nrequire_sealed = true', 1
    )
    tenancy.path.write_text(text + '[[tenants]]\nid = "gamma"\n')
    keys = new_key_entry("alpha", 1) + new_key_entry(PUBLIC, 1)
    sealer = BlockSealer(Keyring.parse_toml(keys, "test"))
    digest, plain = b"q" * 32, b"kv bytes" * 100
    with (
        launch(tenancy) as running,
        running.client("a", bulk=bulk) as a,
        running.client("b", bulk=bulk) as b,
        running.client("publisher", bulk=bulk) as publisher,
    ):
        for client, scope in ((a, "alpha"), (publisher, PUBLIC)):
            with pytest.raises(InvalidArgument, match="requires sealed blocks"):
                client.put(scope, "m", [digest], [plain])
            assert client.lookup(scope, "m", [digest]) == 0  # nothing of it was stored
            sealed = sealer.seal(scope, "m", digest, plain)
            assert client.put(scope, "m", [digest], [sealed]) == [True]  # positive control
            assert client.get(scope, "m", [digest]) == [sealed]
        assert b.put("beta", "m", [digest], [b"plain"]) == [True]  # beta does not require it
