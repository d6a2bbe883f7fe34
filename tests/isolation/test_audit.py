"""The audit log: authn failures, denials, admin actions and integrity failures as JSON
lines, with names and counts only — never tokens, digests or payloads."""

from __future__ import annotations

import base64
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from kvcommon.errors import PermissionDenied, Unauthenticated
from kvcommon.v1 import kvshare_pb2 as pb
from policy.audit import AuditLog, read_records
from replica_agent.client import BlockClient
from tests.support.datafiles import flip_stored_byte
from tests.support.isolation import MODEL, Served, isolation_config, serve
from tests.support.repo import REPO
from tests.support.rpc import METHODS, bearer, invoke

LOOKUP = next(m for m in METHODS if m.name == "Lookup")


def _leaks(text: str, secrets: list[bytes]) -> list[str]:
    forms = [f for s in secrets for f in (s.hex(), base64.b64encode(s).decode())]
    return [f for f in forms if f in text]


def test_security_events_are_recorded_without_secrets(served: Served) -> None:
    digests = [os.urandom(32) for _ in range(3)]
    payload = os.urandom(2048)
    tokens = served.tokens
    with grpc.insecure_channel(served.address) as channel:
        request = pb.LookupRequest(tenant="alpha", model=MODEL, digests=digests)
        for metadata in (bearer(None), bearer("wrong-" + tokens["a"]), (("authorization", "x"),)):
            with pytest.raises(grpc.RpcError):
                invoke(channel, LOOKUP, request, metadata)
        assert invoke(channel, LOOKUP, request, bearer(tokens["a"])).present == 0  # control
    get = next(m for m in METHODS if m.name == "Get")
    with served.client("a") as a, served.client("root") as root:
        a.put("alpha", MODEL, digests, [payload] * 3)
        with grpc.insecure_channel(served.address) as channel, pytest.raises(grpc.RpcError):
            invoke(channel, get, pb.GetRequest(tenant="alpha", model=MODEL, digests=digests),
                   bearer(tokens["b"]))  # fmt: skip
        with pytest.raises(PermissionDenied):
            a.delete_tenant("alpha")  # a has no admin action
        assert root.delete_tenant("alpha") == 3
    records = read_records(served.config.audit_log_path)
    events = [(r["event"], r.get("credential") or r.get("action")) for r in records]
    assert events == [
        ("authn_failure", "none"),
        ("authn_failure", "token"),
        ("authn_failure", "malformed"),
        ("denied", "read"),
        ("denied", "admin"),
        ("admin", "delete_tenant"),
    ]
    denied, admin = records[3], records[5]
    assert denied["principal"] == "b" and denied["tenant"] == "alpha"
    assert denied["method"] == "/kvshare.v1.BlockStore/Get"
    assert str(denied["peer"]).startswith("ipv4:127.0.0.1:")
    assert admin["principal"] == "root" and admin["blocks"] == 3 and admin["tenant"] == "alpha"
    assert all({"ts", "event"} <= set(r) for r in records)
    assert all("principal" not in r for r in records[:3])  # unknown caller: no name guessed
    text = served.config.audit_log_path.read_text()
    assert not _leaks(text, [*digests, payload[:32]])
    assert not any(t in text for t in tokens.values())


def test_integrity_failures_are_audited(tmp_path: Path) -> None:
    tenancy = isolation_config(tmp_path)
    digests = [os.urandom(32) for _ in range(2)]
    payloads = [os.urandom(64 << 10) for _ in digests]
    running = serve(tenancy)
    with running.client("a") as a:
        a.put("alpha", MODEL, digests, payloads)
    running.stop()
    flip_stored_byte(tmp_path / "data" / "lmdb" / "data.mdb", payloads[1][:4096], 100)
    running = serve(tenancy)
    try:
        with running.client("a") as a:
            assert a.get("alpha", MODEL, digests) == payloads[:1]  # control: the good block
    finally:
        running.stop()
    failures = [r for r in read_records(running.config.audit_log_path)
                if r["event"] == "integrity_failure"]  # fmt: skip
    assert [(r["tenant"], r["blocks"]) for r in failures] == [("alpha", 1)]
    assert not _leaks(running.config.audit_log_path.read_text(), digests)


def test_admin_cli_actions_are_audited_without_the_secret(tmp_path: Path) -> None:
    log = tmp_path / "admin-audit.log"
    result = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "admin", "--audit-log", str(log),
         "token", "--name", "replica-z", "--tenant", "alpha", "--actions", "read"],
        capture_output=True, text=True, cwd=REPO, timeout=60, check=True,
    )  # fmt: skip
    token = result.stderr.strip().splitlines()[-1]
    records = read_records(log)
    assert records[0]["action"] == "issue_token" and records[0]["name"] == "replica-z"
    assert token not in log.read_text() and len(token) >= 40


def test_the_audit_log_refuses_raw_bytes(tmp_path: Path) -> None:
    audit = AuditLog(tmp_path / "a.log")
    with pytest.raises(TypeError, match="no raw bytes"):
        audit.record("denied", digest=b"\x00" * 32)  # type: ignore[arg-type]
    audit.record("denied", principal="p")  # control
    audit.close()
    assert read_records(tmp_path / "a.log")[0]["principal"] == "p"
    assert oct((tmp_path / "a.log").stat().st_mode & 0o777) == "0o600"


def test_a_configured_audit_log_path_is_used(tmp_path: Path) -> None:
    path = tmp_path / "elsewhere.jsonl"
    running = serve(isolation_config(tmp_path, extra=f'audit_log = "{path}"'))
    try:
        with BlockClient(running.address, "nope") as c, pytest.raises(Unauthenticated):
            c.lookup("alpha", MODEL, [os.urandom(32)])
    finally:
        running.stop()
    assert [r["event"] for r in read_records(path)] == ["authn_failure"]
    assert not (tmp_path / "data" / "audit.log").exists()
