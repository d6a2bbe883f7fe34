"""Live reload of the server's config (cacheserver.reload), end to end: real server,
real LMDB, real clients. Bad reloads are refused in one line with the old config
serving; what a reload removes or reduces is refused on every path within a second;
quotas, tenants and TLS certificates change without a restart."""

from __future__ import annotations

import hashlib
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from policy.audit import read_records
from tests.support.reload import MODEL, Grant, LiveConfig, digest, reload, seconds_until, start
from tests.support.scrape import Samples, parse, scrape_text, value
from tests.support.servers import Running

REVOCATION_WITHIN_S = 1.0  # the bound: refused on every path within a second
BLOCK = bytes(range(256)) * 64  # 16 KiB


def three_principals(directory: Path, extra: str = "") -> LiveConfig:
    return LiveConfig(
        directory,
        {"alpha": 0, "beta": 0},
        {
            "a": Grant(["alpha"], ["read", "write"]),
            "b": Grant(["beta"], ["read", "write"]),
            "root": Grant(["alpha", "beta"], ["read", "write", "admin"]),
        },
        extra,
    )


@pytest.fixture
def live(tmp_path: Path) -> LiveConfig:
    return three_principals(tmp_path)


def serves(running: Running, who: str, tenant: str, label: str, **client: object) -> bool:
    """`who` can put and read back a block in `tenant` (the positive control)."""
    with running.client(who, **client) as c:  # type: ignore[arg-type]
        c.put(tenant, MODEL, [digest(label, 0)], [BLOCK])
        return c.get(tenant, MODEL, [digest(label, 0)]) == [BLOCK]


def refused_with(running: Running, who: str, tenant: str, code: grpc.StatusCode) -> bool:
    with running.client(who, transport="grpc", timeout_s=5) as c:
        try:
            c.lookup(tenant, MODEL, [digest("probe", 0)])
        except grpc.RpcError as error:
            return error.code() == code
        except Exception as error:  # the client's own exception type carries the code
            return getattr(error, "code", lambda: None)() == code
    return False


# -- bad reloads: refused in one line, the old config serving ----------------------------


def _broken_toml(live: LiveConfig) -> tuple[str, str]:
    return live.text().replace(
        'id = "beta"', 'id = "beta'
    ), r"kvshare\.toml:\d+:\d+: not valid TOML"


def _unknown_key(live: LiveConfig) -> tuple[str, str]:
    return (
        live.text().replace("quota_bytes = 0\n", "quota_bytez = 0\n", 1),
        r"kvshare\.toml:\d+: tenants\[0\]\.quota_bytez: unknown key",
    )


def _out_of_range(live: LiveConfig) -> tuple[str, str]:
    return (
        live.text().replace("quota_bytes = 0\n", "quota_bytes = -5\n", 1),
        r"kvshare\.toml:\d+: tenants\[0\]\.quota_bytes: ",
    )


def _one_token_twice(live: LiveConfig) -> tuple[str, str]:
    a = live.principals["a"]
    live.principals["twin"] = Grant(["beta"], ["read"], token=a.token)
    return live.text(), r"kvshare\.toml:\d+: principals\[3\]\.token_sha256: two principals"


def _needs_restart(live: LiveConfig) -> tuple[str, str]:
    # The same edit also adds a principal: the refusal keeps it out too.
    live.principals["newcomer"] = Grant(["alpha"], ["read", "write"])
    text = live.text().replace(
        'listen = "127.0.0.1:0"', 'listen = "127.0.0.1:0"\n[storage]\ndisk_budget_bytes = 123456789'
    )
    return text, r"kvshare\.toml:\d+: storage\.disk_budget_bytes: changed; needs a restart"


@pytest.mark.parametrize(
    "make_bad",
    [_broken_toml, _unknown_key, _out_of_range, _one_token_twice, _needs_restart],
    ids=["broken-toml", "unknown-key", "out-of-range", "one-token-twice", "needs-restart"],
)
def test_a_bad_reload_is_refused_in_one_line_and_the_old_config_serves(
    running: Running, live: LiveConfig, make_bad: object
) -> None:
    assert serves(running, "a", "alpha", "before")
    text, expected = make_bad(live)  # type: ignore[operator]
    live.write(text)
    reply = reload(running, live)
    assert not reply.applied
    assert "\n" not in reply.message
    assert re.search(expected, reply.message), reply.message
    assert reply.generation == 1
    # The old config still serves everyone it served, and nothing of the new applies.
    assert serves(running, "a", "alpha", "after")
    assert serves(running, "b", "beta", "after")
    if "newcomer" in live.principals:
        running.tokens["newcomer"] = live.principals["newcomer"].token
        assert refused_with(running, "newcomer", "alpha", grpc.StatusCode.UNAUTHENTICATED)
    # Fixed, the same file reloads.
    if "twin" in live.principals:
        del live.principals["twin"]
    live.write()
    assert reload(running, live).applied


def test_a_reload_without_admin_is_denied(running: Running, live: LiveConfig) -> None:
    live.write()
    with pytest.raises(grpc.RpcError) as denied:
        reload(running, live, admin="a")
    assert denied.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert reload(running, live).generation == 2  # positive control: root may


# -- revocation: refused on every path within a second -----------------------------------


@pytest.mark.parametrize("transport", ["grpc", "bulk-tcp", "bulk-same-host"])
def test_a_removed_principal_is_refused_within_a_second(
    running: Running, live: LiveConfig, transport: str
) -> None:
    client = running.client("b", transport=transport, timeout_s=5)
    try:
        client.put("beta", MODEL, [digest("b", 0)], [BLOCK])  # its connection is open
        assert client.get("beta", MODEL, [digest("b", 0)]) == [BLOCK]
        bulk = running.server.server.bulk  # type: ignore[union-attr]
        assert bulk is not None
        assert bulk.connections_of("b") == (0 if transport == "grpc" else 1)
        del live.principals["b"]
        live.write()
        reply = reload(running, live)
        assert reply.applied, reply.message
        if transport != "grpc":
            # Its connection is closed by the server, not only refused at its next request.
            assert "bulk connections closed 1" in reply.message, reply.message
            assert seconds_until(lambda: bulk.connections_of("b") == 0) < REVOCATION_WITHIN_S

        def refused() -> bool:
            try:
                client.lookup("beta", MODEL, [digest("b", 0)])
            except Exception as error:
                code = getattr(error, "code", None)
                return (code() if callable(code) else code) == grpc.StatusCode.UNAUTHENTICATED
            return False

        assert seconds_until(refused, limit_s=5) < REVOCATION_WITHIN_S
    finally:
        client.close()
    assert serves(running, "a", "alpha", "stays")  # a principal that stays serves on


def test_a_put_stream_of_a_revoked_principal_ends_unauthenticated(
    running: Running, live: LiveConfig
) -> None:
    hold = threading.Event()

    def frames() -> Iterator[pb.PutFrame]:
        yield pb.PutFrame(header=pb.PutHeader(tenant="beta", model=MODEL))
        hold.wait(30)  # the stream stays open, as a slow client's does

    with grpc.insecure_channel(running.address) as channel:
        stub = pb_grpc.BlockStoreStub(channel)
        metadata = (("authorization", f"Bearer {running.tokens['b']}"),)
        call = stub.Put.future(frames(), metadata=metadata, timeout=30)
        seconds_until(lambda: "1 calls" in _open_calls(running), limit_s=10)
        del live.principals["b"]
        live.write()
        reply = reload(running, live)
        assert "calls ended 1" in reply.message, reply.message
        with pytest.raises(grpc.RpcError) as ended:
            call.result(timeout=REVOCATION_WITHIN_S)
        hold.set()
    assert ended.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _open_calls(running: Running) -> str:
    server = running.server.server
    assert server is not None
    return f"{len(server._interceptor.calls)} calls"


def test_a_replaced_token_is_refused_and_the_new_one_serves(
    running: Running, live: LiveConfig
) -> None:
    old = running.client("a", transport="bulk-tcp")
    try:
        old.put("alpha", MODEL, [digest("a", 0)], [BLOCK])
        live.principals["a"] = Grant(["alpha"], ["read", "write"])  # a new token
        live.write()
        assert reload(running, live).applied
        with pytest.raises(Exception) as refused:
            old.lookup("alpha", MODEL, [digest("a", 0)])
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED  # type: ignore[attr-defined]
    finally:
        old.close()
    assert serves(running, "a", "alpha", "new-token")


def test_a_reduced_principal_loses_only_what_was_taken(running: Running, live: LiveConfig) -> None:
    live.principals["both"] = Grant(["alpha", "beta"], ["read", "write"])
    live.write()
    assert reload(running, live).applied
    assert serves(running, "both", "beta", "before")
    live.principals["both"].tenants = ["alpha"]
    live.write()
    reply = reload(running, live)
    assert "principals cut off: both" in reply.message
    assert refused_with(running, "both", "beta", grpc.StatusCode.PERMISSION_DENIED)
    assert serves(running, "both", "alpha", "kept")  # positive control


# -- tenants and quotas ------------------------------------------------------------------


def test_a_lowered_quota_evicts_that_tenant_at_once_and_no_other(
    running: Running, live: LiveConfig
) -> None:
    with running.client("root", transport="grpc") as c:
        c.put("alpha", MODEL, [digest("alpha", i) for i in range(12)], [BLOCK] * 12)
        c.put("beta", MODEL, [digest("beta", i) for i in range(12)], [BLOCK] * 12)
    store = running.store
    beta_before = store.tenant_usage("beta")  # type: ignore[arg-type]
    live.tenants["alpha"] = 4 * len(BLOCK)
    live.write()
    assert reload(running, live).applied
    alpha_blocks, alpha_bytes = store.tenant_usage("alpha")  # type: ignore[arg-type]
    assert alpha_bytes <= 4 * len(BLOCK) and alpha_blocks == 4
    assert store.tenant_usage("beta") == beta_before  # type: ignore[arg-type]
    with running.client("a", transport="grpc") as c:
        # The most recent blocks are the ones kept, and the quota holds for new puts.
        assert c.lookup("alpha", MODEL, [digest("alpha", i) for i in range(8, 12)]) == 4
        c.put("alpha", MODEL, [digest("alpha", 100)], [BLOCK])
    assert store.tenant_usage("alpha")[1] <= 4 * len(BLOCK)  # type: ignore[arg-type]


def test_a_removed_tenant_is_reclaimed_and_an_added_one_serves(
    running: Running, live: LiveConfig
) -> None:
    with running.client("b", transport="grpc") as c:
        c.put("beta", MODEL, [digest("beta", i) for i in range(3)], [BLOCK] * 3)
    del live.tenants["beta"]
    del live.principals["b"]
    live.principals["root"].tenants = ["alpha", "gamma"]
    live.tenants["gamma"] = 0
    live.principals["g"] = Grant(["gamma"], ["read", "write"])
    live.write()
    reply = reload(running, live)
    assert "tenants added: gamma" in reply.message and "tenants removed: beta" in reply.message
    # Reclaimed behind the reload (a delete waits on the disk writer).
    seconds_until(lambda: running.store.tenant_usage("beta") == (0, 0))  # type: ignore[arg-type]
    assert serves(running, "g", "gamma", "new-tenant")
    assert serves(running, "a", "alpha", "stays")


# -- what a reload leaves for the operator: audit records and metrics --------------------


def test_the_audit_log_and_metrics_record_each_reload_by_name_only(tmp_path: Path) -> None:
    live = three_principals(tmp_path, '[telemetry]\nmetrics_listen = "127.0.0.1:0"\n')
    with start(live) as running:
        server = running.server.server
        assert server is not None

        def scrape() -> Samples:
            return parse(scrape_text(server.metrics_address))

        assert value(scrape(), "kvshare_config_generation") == 1
        del live.principals["b"]
        live.write()
        assert reload(running, live).applied
        live.write(live.text() + "[[tenants]\n")
        assert not reload(running, live).applied
        samples = scrape()
        assert value(samples, "kvshare_config_generation") == 2
        assert value(samples, "kvshare_config_last_reload_success") == 0
        assert value(samples, "kvshare_config_last_reload_timestamp_seconds") > 0
        audit_path = server.config.audit_log_path
    records = read_records(audit_path)
    reloads = [r for r in records if r["event"] == "reload"]
    assert [(r["principal"], r["applied"], r["generation"]) for r in reloads] == [
        ("root", True, 2),
        ("root", False, 2),
    ]
    assert [(r["principal"], r["reason"]) for r in records if r["event"] == "revoked"] == [
        ("b", "removed")
    ]
    text = audit_path.read_text()
    for grant in live.principals.values():  # names only: no token, no token hash
        assert grant.token not in text
        assert hashlib.sha256(grant.token.encode()).hexdigest() not in text
