"""Quotas and fair eviction through the real server: a flooding tenant pays for itself."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from cacheserver.config import StorageConfig
from kvcommon.errors import ResourceExhausted
from policy.types import BlockDigest, ModelName, TenantId
from replica_agent.client import BlockClient
from tests.support.isolation import MODEL, Served, isolation_config, serve

KiB = 1 << 10
MiB = 1 << 20
BLOCK = 64 * KiB
QUOTA = 1 * MiB


def blocks(n: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(n)], [os.urandom(BLOCK) for _ in range(n)]


def tenant_bytes(client: BlockClient, tenant: str) -> int:
    return next(t.bytes for t in client.stats().tenants if t.tenant == tenant)


@pytest.fixture
def tight(tmp_path: object) -> Iterator[Served]:
    """Both tenants with a 1 MiB quota; the disk budget holds exactly both quotas."""
    tenancy = isolation_config(tmp_path, quotas={"alpha": QUOTA, "beta": QUOTA})  # type: ignore[arg-type]
    storage = StorageConfig(memory_budget_bytes=1 * MiB, disk_budget_bytes=2 * QUOTA)
    running = serve(tenancy, storage=storage)
    yield running
    running.stop()


def test_a_tenant_writing_5x_its_quota_leaves_the_other_tenant_whole(tight: Served) -> None:
    beta_digests, beta_payloads = blocks(6)  # 384 KiB: within beta's quota and memory share
    flood_digests, flood_payloads = blocks(5 * QUOTA // BLOCK)
    with tight.client("a") as a, tight.client("b") as b, tight.client("root") as root:
        b.put("beta", MODEL, beta_digests, beta_payloads)
        for i in range(0, len(flood_digests), 8):
            a.put("alpha", MODEL, flood_digests[i : i + 8], flood_payloads[i : i + 8])
            assert tenant_bytes(root, "alpha") <= QUOTA
            assert b.lookup("beta", MODEL, beta_digests) == len(beta_digests)
        assert b.get("beta", MODEL, beta_digests) == beta_payloads  # every byte of beta
        assert tenant_bytes(root, "alpha") == QUOTA  # exactly its quota, no more
        recent = QUOTA // BLOCK
        # Positive control: alpha's own recent blocks are cached; its oldest paid the bill.
        assert a.get("alpha", MODEL, flood_digests[-recent:]) == flood_payloads[-recent:]
        assert a.lookup("alpha", MODEL, flood_digests[: len(flood_digests) - recent]) == 0
    # The hot tier follows the same rule: beta's blocks are still in memory.
    model = ModelName(MODEL)
    keys = [tight.policy.storage_key(TenantId("beta"), model, BlockDigest(d)) for d in beta_digests]
    held, _ = tight.store.read_from_memory(keys, 1 << 30)
    assert len(held) == len(beta_digests)


def test_a_tenant_that_cannot_evict_its_own_blocks_gets_resource_exhausted(
    tmp_path: object,
) -> None:
    """Quotas overcommit the budget: beta fills it within its quota, alpha has nothing."""
    tenancy = isolation_config(tmp_path, quotas={"alpha": QUOTA, "beta": QUOTA})  # type: ignore[arg-type]
    running = serve(tenancy, storage=StorageConfig(disk_budget_bytes=QUOTA))
    beta_digests, beta_payloads = blocks(QUOTA // BLOCK)
    digest, payload = blocks(1)
    try:
        with running.client("a") as a, running.client("b") as b:
            b.put("beta", MODEL, beta_digests, beta_payloads)
            with pytest.raises(ResourceExhausted, match="quota_bytes"):
                a.put("alpha", MODEL, digest, payload)
            assert b.get("beta", MODEL, beta_digests) == beta_payloads  # untouched
            with pytest.raises(ResourceExhausted, match="exceeds the 1048576-byte limit"):
                a.put("alpha", MODEL, [os.urandom(32)], [os.urandom(QUOTA + 1)])
            b.delete("beta", MODEL, beta_digests[:1])
            assert a.put("alpha", MODEL, digest, payload) == [True]  # positive control
            assert a.get("alpha", MODEL, digest) == payload
    finally:
        running.stop()


def test_a_tenant_without_quota_is_evicted_before_one_within_its_quota(tmp_path: object) -> None:
    """alpha (no quota) shares the budget with beta (quota): alpha pays for the squeeze."""
    tenancy = isolation_config(tmp_path, quotas={"beta": QUOTA})  # type: ignore[arg-type]
    running = serve(tenancy, storage=StorageConfig(disk_budget_bytes=2 * QUOTA))
    beta_digests, beta_payloads = blocks(QUOTA // BLOCK)
    alpha_digests, alpha_payloads = blocks(5 * QUOTA // BLOCK)
    try:
        with running.client("a") as a, running.client("b") as b:
            b.put("beta", MODEL, beta_digests, beta_payloads)
            for i in range(0, len(alpha_digests), 8):
                a.put("alpha", MODEL, alpha_digests[i : i + 8], alpha_payloads[i : i + 8])
            assert b.get("beta", MODEL, beta_digests) == beta_payloads
            assert a.get("alpha", MODEL, alpha_digests[-8:]) == alpha_payloads[-8:]  # control
    finally:
        running.stop()
