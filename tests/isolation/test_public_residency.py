"""Published blocks stay in the memory tier, whatever anyone reads (docs/isolation.md,
"Public prefixes"; threat model C77).

Reads never bring a public block back into memory (what is hot must not depend on who
read what), so a block that left memory would be served from LMDB from then on, as
fast as the OS page cache happened to make it: a page-cache hit after someone read it
lately, a disk read otherwise, which another tenant can time. So the scope is pinned:
its blocks stay in memory when the put journal reclaims their records, come back at
a restart, and keep their share when other tenants fill the memory tier. Each test has
a control: a tenant's block put at the same moment leaves memory, so the test sees the
event that would have taken the published blocks with it.

And the scope's quota cannot exceed the disk budget (item 10 of the third review): a
publisher could otherwise fill the whole store.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cacheserver.config import StorageConfig, load_config
from kvcommon.errors import ConfigError
from policy.types import PUBLIC, BlockDigest, ModelName, TenantId
from tests.support.cluster import eventually
from tests.support.isolation import MODEL
from tests.support.repo import REPO
from tests.support.servers import Running, launch, write_public_config

KiB, MiB = 1 << 10, 1 << 20
PRINCIPALS = {
    "a": (["alpha"], ["read", "write"]),
    "b": (["beta"], ["read", "write"]),
    "publisher": ([], ["publish"]),
}
BLOCK = 64 * KiB


def in_memory(running: Running, tenant: str, digests: list[bytes]) -> list[bytes]:
    """The digests of `tenant` whose blocks the memory tier holds (a look at the
    store, not a read: nothing is touched or promoted)."""
    policy, model = running.policy, ModelName(MODEL)
    held = []
    for digest in digests:
        key = policy.storage_key(TenantId(tenant), model, BlockDigest(digest))
        found, _ = running.store.read_from_memory([key], 1 << 30)
        if found:
            held.append(digest)
    return held


def fresh(count: int, size: int = BLOCK) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(count)], [os.urandom(size) for _ in range(count)]


def test_published_blocks_stay_in_memory_when_the_journal_reclaims_their_records(
    tmp_path: Path,
) -> None:
    """A journaled put sits in memory as a view of its record; when the ring reuses
    the record's space (here after 3 rings' worth of other puts) the view must go.
    Beta's block goes with it (the control: the reclaim happened, and reads would
    bring it back); the published blocks are kept as copies."""
    tenancy = write_public_config(tmp_path, PRINCIPALS, quota_bytes=1 * MiB)
    storage = StorageConfig(
        memory_budget_bytes=256 * MiB, disk_budget_bytes=1024 * MiB, journal_bytes=16 * MiB
    )
    running = launch(tenancy, storage=storage)
    try:
        published, payloads = fresh(4)
        own, own_payloads = fresh(1)
        with (
            running.client("publisher", transport="grpc") as publisher,
            running.client("a", transport="grpc") as a,
            running.client("b", transport="grpc") as b,
        ):
            assert publisher.put(PUBLIC, MODEL, published, payloads) == [True] * 4
            assert b.put("beta", MODEL, own, own_payloads) == [True]
            assert in_memory(running, PUBLIC, published) == published
            assert in_memory(running, "beta", own) == own
            filler = 48  # 48 MiB of alpha's puts: three times the ring
            for _ in range(filler):
                digests, blocks = fresh(1, 1 * MiB)
                assert a.put("alpha", MODEL, digests, blocks) == [True]
            assert eventually(lambda: not in_memory(running, "beta", own), 60.0)  # reclaimed
            assert in_memory(running, PUBLIC, published) == published
            assert b.get(PUBLIC, MODEL, published) == payloads  # the same bytes
            assert b.get("beta", MODEL, own) == own_payloads
    finally:
        running.stop()


def test_published_blocks_are_back_in_memory_after_a_restart(tmp_path: Path) -> None:
    """After a restart the published blocks are in memory before any read; beta's
    block, put at the same moment, is not (control: the restart emptied memory)."""
    tenancy = write_public_config(tmp_path, PRINCIPALS, quota_bytes=1 * MiB)
    storage = StorageConfig(memory_budget_bytes=64 * MiB, disk_budget_bytes=256 * MiB)
    published, payloads = fresh(4)
    own, own_payloads = fresh(1)
    running = launch(tenancy, storage=storage)
    try:
        with (
            running.client("publisher", transport="grpc") as publisher,
            running.client("b", transport="grpc") as b,
        ):
            assert publisher.put(PUBLIC, MODEL, published, payloads) == [True] * 4
            assert b.put("beta", MODEL, own, own_payloads) == [True]
    finally:
        running.stop()
    again = launch(tenancy, storage=storage)
    try:
        assert in_memory(again, PUBLIC, published) == published
        assert in_memory(again, "beta", own) == []
        with again.client("b", transport="grpc") as b:
            assert b.get(PUBLIC, MODEL, published) == payloads
            assert b.get("beta", MODEL, own) == own_payloads  # stored, on disk only
    finally:
        again.stop()


def test_published_blocks_keep_their_share_when_tenants_fill_memory(tmp_path: Path) -> None:
    """Alpha and beta fill the memory tier within their quotas (each tenant's memory
    share is its disk quota scaled: half the tier each); a publication then still
    lands in memory, taking room from their hot copies (their blocks stay stored).
    Control: with the tier full, a tenant's further put takes room from its own hot
    blocks, never from the scope's."""
    quota = 1 * MiB
    tenancy = write_public_config(
        tmp_path,
        PRINCIPALS,
        quota_bytes=256 * KiB,
        quotas={"alpha": quota, "beta": quota},
    )
    storage = StorageConfig(memory_budget_bytes=1 * MiB, disk_budget_bytes=2 * quota)
    running = launch(tenancy, storage=storage)
    try:
        with (
            running.client("publisher", transport="grpc") as publisher,
            running.client("a", transport="grpc") as a,
            running.client("b", transport="grpc") as b,
        ):
            alpha, alpha_payloads = fresh(8)
            beta, beta_payloads = fresh(8)
            assert a.put("alpha", MODEL, alpha, alpha_payloads) == [True] * 8
            assert b.put("beta", MODEL, beta, beta_payloads) == [True] * 8
            held = in_memory(running, "alpha", alpha) + in_memory(running, "beta", beta)
            assert len(held) * BLOCK == 1 * MiB  # the tier is full of their blocks
            published, payloads = fresh(4)
            assert publisher.put(PUBLIC, MODEL, published, payloads) == [True] * 4
            assert in_memory(running, PUBLIC, published) == published
            assert a.get("alpha", MODEL, alpha) == alpha_payloads  # still stored
            assert b.get("beta", MODEL, beta) == beta_payloads
            # Control: a tenant's put, with the tier full, evicts its own hot block.
            before = in_memory(running, "alpha", alpha)
            more, more_payloads = fresh(1)
            assert a.put("alpha", MODEL, more, more_payloads) == [True]
            assert in_memory(running, "alpha", more) == more
            assert in_memory(running, "alpha", alpha) == before[1:]
            assert in_memory(running, PUBLIC, published) == published
    finally:
        running.stop()


def test_a_public_quota_past_the_disk_budget_is_refused(tmp_path: Path) -> None:
    """In the file: one error naming the file, the line and what to change. By flag
    (`--disk-budget-bytes` below the quota): one line, exit 2. Control: the same quota
    within the budget loads."""
    tenancy = write_public_config(tmp_path, PRINCIPALS, quota_bytes=2 * MiB)
    path = tenancy.path
    text = path.read_text()
    path.write_text(text + f"[storage]\ndisk_budget_bytes = {1 * MiB}\n")
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    message = str(refused.value)
    assert message.startswith(f"{path}:")
    assert "public.quota_bytes" in message and "disk_budget_bytes 1048576" in message
    assert "lower quota_bytes" in message
    path.write_text(text)
    assert load_config(path).access is not None  # control: within the default budget
    flags = ["--config", str(path), "--disk-budget-bytes", str(1 * MiB)]
    served = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "serve", *flags],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert served.returncode == 2
    lines = served.stderr.strip().splitlines()
    assert len(lines) == 1 and "[public] quota_bytes" in lines[0]
    assert "disk_budget_bytes 1048576" in lines[0]
