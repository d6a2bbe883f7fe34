"""The shared read-only namespace for public prefixes (policy/access.py).

Tenant `public` is `shared = true`; `alpha` opts in with `read_shared`, `beta` does not.
Only a principal with `publish` writes it; `write` alone is not enough.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcommon.errors import PermissionDenied
from tests.conftest import write_config
from tests.isolation.conftest import MODEL, Served, serve

SHARED = '[[tenants]]\nid = "public"\nshared = true\n'


@pytest.fixture
def shared_server(tmp_path: Path) -> Iterator[Served]:
    tenancy = write_config(
        tmp_path,
        extra=SHARED,
        principals={
            "a": (["alpha"], ["read", "write"]),
            "b": (["beta"], ["read", "write"]),
            "publisher": (["public"], ["read", "publish"]),
            "writer": (["public", "alpha"], ["read", "write"]),  # write, but no publish
        },
    )
    text = tenancy.path.read_text()
    tenancy.path.write_text(text.replace('id = "alpha"', 'id = "alpha"\nread_shared = ["public"]'))
    running = serve(tenancy)
    yield running
    running.stop()


def _denied(call: object) -> str:
    with pytest.raises(PermissionDenied) as info:
        call()  # type: ignore[operator]
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED  # type: ignore[attr-defined]
    return info.value.details()  # type: ignore[attr-defined,no-any-return]


def test_an_opted_in_tenant_reads_what_a_publisher_wrote(shared_server: Served) -> None:
    system_prompt = [os.urandom(32) for _ in range(4)]
    blocks = [os.urandom(1024) for _ in system_prompt]
    with shared_server.client("publisher") as publisher, shared_server.client("a") as a:
        assert publisher.put("public", MODEL, system_prompt, blocks) == [True] * 4
        assert a.lookup("public", MODEL, system_prompt) == 4
        assert a.get("public", MODEL, system_prompt) == blocks
        # The tenant's own namespace is separate: the same digests miss there.
        assert a.lookup("alpha", MODEL, system_prompt) == 0


def test_only_publishers_write_the_shared_namespace(shared_server: Served) -> None:
    digest = os.urandom(32)
    with (
        shared_server.client("a") as a,
        shared_server.client("writer") as writer,
        shared_server.client("publisher") as publisher,
    ):
        _denied(lambda: a.put("public", MODEL, [digest], [b"poison"]))
        _denied(lambda: writer.put("public", MODEL, [digest], [b"poison"]))
        _denied(lambda: writer.delete("public", MODEL, [digest]))
        assert writer.put("alpha", MODEL, [digest], [b"own"]) == [True]  # write still works
        assert publisher.lookup("public", MODEL, [digest]) == 0  # nothing was poisoned
        assert publisher.put("public", MODEL, [digest], [b"published"]) == [True]  # control
        assert writer.get("public", MODEL, [digest]) == [b"published"]  # it lists public


def test_a_tenant_that_did_not_opt_in_cannot_read_it(shared_server: Served) -> None:
    digest = os.urandom(32)
    with shared_server.client("publisher") as publisher, shared_server.client("b") as b:
        publisher.put("public", MODEL, [digest], [b"prompt"])
        refused_shared = _denied(lambda: b.lookup("public", MODEL, [digest]))
        refused_unknown = _denied(lambda: b.lookup("no-such-tenant", MODEL, [digest]))
        assert refused_shared == refused_unknown  # no oracle for which namespaces exist
        assert publisher.get("public", MODEL, [digest]) == [b"prompt"]  # control


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "grpc"])
def test_a_tenant_requiring_sealed_blocks_refuses_plaintext(tmp_path: Path, bulk: bool) -> None:
    from kvcommon.errors import InvalidArgument
    from policy.sealing import BlockSealer, Keyring, new_key_entry
    from tests.conftest import launch

    tenancy = write_config(tmp_path)
    text = tenancy.path.read_text().replace(
        'id = "alpha"', 'id = "alpha"\nrequire_sealed = true', 1
    )
    tenancy.path.write_text(text)
    sealer = BlockSealer(Keyring.parse_toml(new_key_entry("alpha", 1), "test"))
    digest = b"q" * 32
    sealed = sealer.seal("alpha", "m", digest, b"kv bytes" * 100)
    with (
        launch(tenancy) as running,
        running.client("a", bulk=bulk) as a,
        running.client("b", bulk=bulk) as b,
    ):
        with pytest.raises(InvalidArgument, match="requires sealed blocks"):
            a.put("alpha", "m", [digest], [b"kv bytes" * 100])
        assert a.lookup("alpha", "m", [digest]) == 0  # nothing of it was stored
        assert a.put("alpha", "m", [digest], [sealed]) == [True]  # positive control
        assert a.get("alpha", "m", [digest]) == [sealed]
        assert b.put("beta", "m", [digest], [b"plain"]) == [True]  # beta does not require it
