"""A tenant's bytes in Redis stay within the documented bound (docs/scale-out.md,
"Quotas") when two servers write it far past its quota at once.

Each server lists a block only after its bytes are in Redis, so an eviction — by this
server's next admission or the other server's — always finds the bytes it deletes; a
block evicted before it was written would stay in Redis unlisted, out of every quota.
The tenant's values are counted by scanning Redis with redis-py's own client and
reading each header, not by asking kvshare's accounting.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from cacheserver.tiers.cluster.accounting import QuotaListing
from cacheserver.tiers.cluster.layout import HEADER_BYTES, unpack_header
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.types import StorageKey, TenantId
from tests.support.cluster import MODEL, KiB, Servers, blocks, direct, primaries, tier_of

pytestmark = pytest.mark.slow  # every test here takes seconds

ALPHA = TenantId("alpha")
BLOCK_BYTES = 64 * KiB
QUOTA_BYTES = 16 * BLOCK_BYTES


def _tenant_bytes(cluster: LocalRedisCluster, tag: bytes) -> tuple[int, int]:
    """(values, payload bytes) of the tenant's blocks in Redis, from their headers."""
    count = total = 0
    for client in primaries(cluster):
        for name in client.scan_iter(match=b"kvshare:b:*", count=1000):
            head = client.getrange(name, 0, HEADER_BYTES - 1)
            assert isinstance(head, bytes)
            header = unpack_header(head)
            if header is not None and header.tenant_tag == tag:
                count += 1
                total += int(client.strlen(name)) - HEADER_BYTES
        client.close()
    return count, total


def test_two_servers_writing_ten_times_the_quota_leave_at_most_the_quota_in_redis(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster, quotas={"alpha": QUOTA_BYTES, "beta": QUOTA_BYTES})
    clients = [servers[i].client("a", transport="grpc") for i in (0, 1)]
    digests, payloads = blocks(2 * 10 * 16, BLOCK_BYTES)  # 10x the quota from each
    for start in range(0, len(digests), 8):  # round robin, batches of 8, no waiting
        clients[(start // 8) % 2].put(
            "alpha", MODEL, digests[start : start + 8], payloads[start : start + 8]
        )
    servers.settle()
    tag = tier_of(servers[0]).tenants[ALPHA].tag
    count, total = _tenant_bytes(cluster, tag)
    assert 0 < total <= QUOTA_BYTES, (count, total)
    # The accounting agrees with what is there (positive control: writes did land).
    listed = tier_of(servers[0]).accounting.usage(tier_of(servers[0]).tenants[ALPHA])
    assert listed == (count, total)


def test_a_block_written_and_never_admitted_is_swept(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    """A server that stops between writing a block and admitting it: the block is in
    the tenant's writing set, and the sweep deletes it; an admitted one stays."""
    servers = start_servers(cluster, count=1, quotas={"alpha": QUOTA_BYTES})
    tier = tier_of(servers[0])
    alpha = tier.tenants[ALPHA]
    orphan, admitted = StorageKey(os.urandom(32)), StorageKey(os.urandom(32))
    tier.accounting.mark_writing([(alpha, orphan), (alpha, admitted)])
    operator = direct(cluster)
    for key in (orphan, admitted):
        operator.set(tier.keys.block(key), b"v" * 100)
    assert tier.accounting.admit([(alpha, admitted, 100)])[0] == QuotaListing(True, False)
    assert tier.accounting.sweep(alpha) == []  # too recent: its writer may be slow
    assert tier.accounting.sweep(alpha, age_s=0) == [orphan]  # the caller deletes it
    assert tier.accounting.sweep(alpha, age_s=0) == []  # once
    operator.close()
