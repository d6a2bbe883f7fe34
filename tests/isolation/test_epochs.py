"""Crypto-shredding: bumping a tenant's epoch makes all of its blocks unreachable at
once, and the next start reclaims their space. The other tenant is the control."""

from __future__ import annotations

import os
from pathlib import Path

from policy.audit import read_records
from tests.support.isolation import MODEL, isolation_config, serve

BLOCK = 32 << 10


def test_an_epoch_bump_shreds_one_tenant_and_reclaims_its_bytes(tmp_path: Path) -> None:
    tenancy = isolation_config(tmp_path)
    digests = [os.urandom(32) for _ in range(16)]
    alpha_payloads = [os.urandom(BLOCK) for _ in digests]
    beta_payloads = [os.urandom(BLOCK) for _ in digests]
    running = serve(tenancy)
    try:
        with running.client("a") as a, running.client("b") as b, running.client("root") as root:
            a.put("alpha", MODEL, digests, alpha_payloads)
            b.put("beta", MODEL, digests, beta_payloads)
            assert a.lookup("alpha", MODEL, digests) == 16  # positive control before
            disk_before = {t.name: t.bytes for t in root.stats().tiers}["lmdb"]
    finally:
        running.stop()
    assert disk_before == 2 * 16 * BLOCK
    text = tenancy.path.read_text()
    tenancy.path.write_text(text.replace('id = "alpha"', 'id = "alpha"\nepoch = 1', 1))
    running = serve(tenancy)
    try:
        with running.client("a") as a, running.client("b") as b, running.client("root") as root:
            assert a.lookup("alpha", MODEL, digests) == 0  # every alpha block, at once
            assert a.get("alpha", MODEL, digests) == []
            assert b.get("beta", MODEL, digests) == beta_payloads  # control: beta untouched
            tiers = {t.name: t.bytes for t in root.stats().tiers}
            assert tiers["lmdb"] == 16 * BLOCK  # alpha's bytes were reclaimed
            alpha_stats = next(t for t in root.stats().tenants if t.tenant == "alpha")
            assert alpha_stats.blocks == 0
            # The tenant lives on under its new epoch: the same digests store afresh.
            assert a.put("alpha", MODEL, digests[:2], alpha_payloads[:2]) == [True, True]
            assert a.get("alpha", MODEL, digests[:2]) == alpha_payloads[:2]
    finally:
        running.stop()
    reclaimed = [
        r for r in read_records(running.config.audit_log_path)
        if r.get("action") == "reclaim_retired_epochs"
    ]  # fmt: skip
    assert [r["blocks"] for r in reclaimed] == [16]


def test_removing_a_tenant_from_the_config_reclaims_its_blocks(tmp_path: Path) -> None:
    tenancy = isolation_config(tmp_path)
    digests = [os.urandom(32) for _ in range(4)]
    running = serve(tenancy)
    try:
        with running.client("root") as root:
            root.put("alpha", MODEL, digests, [b"a"] * 4)
            root.put("beta", MODEL, digests, [b"b"] * 4)
    finally:
        running.stop()
    text = tenancy.path.read_text()
    start = text.index('[[tenants]]\nid = "beta"')
    end = text.index("[[principals]]")
    text = text[:start] + text[end:]
    text = text.replace('tenants = ["beta"]', "tenants = []").replace(
        'tenants = ["alpha", "beta"]', 'tenants = ["alpha"]'
    )
    tenancy.path.write_text(text)
    running = serve(tenancy)
    try:
        with running.client("root") as root:
            assert root.get("alpha", MODEL, digests) == [b"a"] * 4  # control
            assert {t.name: t.blocks for t in root.stats().tiers}["lmdb"] == 4
    finally:
        running.stop()
