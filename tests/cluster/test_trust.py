"""The cluster's trust boundary (threat model C60-C64): what a Redis operator sees and
what their changes achieve.

They see key names, sizes and access patterns: no digest, tenant id, model name or
secret (scanned here, every key and value). They can delete values but not make one a
server serves: a value moved to another key, re-headed to another tenant or forged
fails its keyed MAC (policy.shared_values) and is a miss, never kept locally, while
the untouched blocks are served (positive control).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import xxhash

from cacheserver.tiers.cluster.layout import HEADER_BYTES
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.sealing import BlockSealer, Keyring, SealError, TenantKeys
from policy.types import BlockDigest, ModelName, StorageKey, TenantId
from tests.support.cluster import MODEL, Servers, blocks, cluster_contents, direct, tier_of

pytestmark = pytest.mark.slow  # every test here takes seconds

SEALER = BlockSealer(Keyring({"alpha": TenantKeys({1: os.urandom(32)})}))


def _key(servers: Servers, tenant: str, digest: bytes) -> StorageKey:
    return servers[0].policy.storage_key(TenantId(tenant), ModelName(MODEL), BlockDigest(digest))


def _bytes(value: object) -> bytes:
    assert isinstance(value, bytes)
    return value


def _raw(value: object) -> bytes:
    """Every byte string in a value Redis returned, joined (members, fields, entries)."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, dict):
        return b"\n".join(_raw(k) + b"\n" + _raw(v) for k, v in value.items())
    if isinstance(value, list | set | tuple):
        return b"\n".join(_raw(v) for v in value)
    return repr(value).encode()


def test_the_cluster_holds_no_digest_tenant_id_model_or_secret(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster, quotas={"alpha": 1 << 20})
    digests, payloads = blocks(6)
    client = servers[0].client("a", transport="grpc")
    client.put("alpha", MODEL, digests, payloads)
    servers.settle()
    assert servers[1].client("a", transport="grpc").lookup("alpha", MODEL, digests) == 6
    client.delete("alpha", MODEL, digests[:1])  # a delete stream entry too
    servers.settle()
    contents = cluster_contents(cluster)
    names = list(contents)
    assert sum(tier_of(servers[0]).keys.is_block(n) for n in names) == 5  # positive control
    secret = servers[0].config.secret_path.read_bytes()
    forbidden = [*digests, *(d.hex().encode() for d in digests), secret, secret.hex().encode()]
    forbidden += [b"alpha", b"beta", MODEL.encode()]
    everything = b"\n".join([*names, *(_raw(v) for v in contents.values())])
    for needle in forbidden:
        assert needle not in everything, needle
    # The payload bytes are there, of course: a tenant that must hide them seals them.
    assert any(payloads[1] in v for v in contents.values() if isinstance(v, bytes))


def _forge(value: bytes, payload: bytes, tenant_tag: bytes | None = None) -> bytes:
    """What someone who can write to Redis but holds no server secret can make: the
    header kept (its tenant tag replaced, if given), the payload theirs, and the header's
    last 16 bytes an unkeyed checksum of it (xxh3-128: what the first format checked)."""
    head = bytearray(value[:HEADER_BYTES])
    if tenant_tag is not None:
        head[4:20] = tenant_tag
    head[HEADER_BYTES - 16 :] = xxhash.xxh3_128_digest(payload)
    return bytes(head) + payload


def test_values_moved_re_headed_or_forged_in_redis_are_misses_never_served_or_kept(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    """Plaintext blocks (alpha has no keyring, the default): whoever can write to Redis
    moves a block within alpha, re-heads one to beta, forges one; each is a miss,
    counted, and the reading server keeps none of them in its local tiers."""
    servers = start_servers(cluster)
    tier = tier_of(servers[0])
    digests, payloads = blocks(5)
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    servers.settle()
    names = [tier.keys.block(_key(servers, "alpha", d)) for d in digests]
    operator = direct(cluster)
    values = [_bytes(operator.get(n)) for n in names]
    operator.set(names[0], values[1])  # 1 moved onto 0, within alpha
    beta_tag = tier.tenants[TenantId("beta")].tag
    beta_name = tier.keys.block(_key(servers, "beta", digests[1]))
    operator.set(beta_name, _forge(values[1], payloads[1], beta_tag))  # re-headed to beta
    operator.set(names[2], _forge(values[2], b"attacker's bytes" * 4096))  # forged
    reader = servers[1]  # holds no local copy: reads the cluster
    alpha = reader.client("a", transport="grpc")
    assert alpha.get("alpha", MODEL, digests[:1]) == []
    assert reader.client("b", transport="grpc").get("beta", MODEL, digests[1:2]) == []
    assert alpha.get("alpha", MODEL, digests[2:3]) == []
    assert tier_of(reader).counts()["integrity_failures"] == 3
    assert alpha.get("alpha", MODEL, digests[3:]) == payloads[3:]  # positive control
    servers.settle()
    assert reader.store.tenant_usage(TenantId("beta")) == (0, 0)
    assert reader.store.tenant_usage(TenantId("alpha"))[0] == 2  # only the two real ones
    assert operator.exists(names[0], names[2], beta_name) == 0  # deleted: a put rewrites


def test_a_sealed_block_the_cluster_serves_opens_at_the_agent(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    """Sealing still binds tenant, model and digest end to end (C11, C12): the agent
    opens what the cluster served, and refuses it under another digest."""
    servers = start_servers(cluster)
    digests, plaintexts = blocks(2)
    sealed = [SEALER.seal("alpha", MODEL, d, p) for d, p in zip(digests, plaintexts, strict=True)]
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, sealed)
    servers.settle()
    got = servers[1].client("a", transport="grpc").get("alpha", MODEL, digests)
    assert [SEALER.open("alpha", MODEL, d, g) for d, g in zip(digests, got, strict=True)] == (
        plaintexts
    )
    with pytest.raises(SealError):
        SEALER.open("alpha", MODEL, digests[1], got[0])


def test_a_value_of_the_first_format_is_a_plain_miss_and_a_put_writes_it_again(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    """Values an older server wrote (magic KVC1, unkeyed checksum) are misses, not
    integrity failures, and are deleted so that SET NX can write the block again."""
    servers = start_servers(cluster)
    tier = tier_of(servers[0])
    digests, payloads = blocks(1)
    name = tier.keys.block(_key(servers, "alpha", digests[0]))
    operator = direct(cluster)
    operator.set(name, b"KVC1" + bytes(60) + payloads[0])
    reader = servers[1].client("a", transport="grpc")
    assert reader.get("alpha", MODEL, digests) == []
    assert tier_of(servers[1]).counts()["integrity_failures"] == 0
    assert operator.exists(name) == 0
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, payloads)
    servers.settle()
    assert reader.get("alpha", MODEL, digests) == payloads  # written again, served
    operator.close()
