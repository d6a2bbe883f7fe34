"""The cluster's trust boundary (threat model C60-C64): what a Redis operator sees and
what their changes achieve.

They see key names, sizes and access patterns: no digest, tenant id, model name or
secret (scanned here, every key and value). They can change bytes: a corrupted block
is a miss (its checksum), a block moved to another tenant's key is a miss (its header's
tenant tag), and a block forged with a consistent header is served — and the agent's
AEAD refuses it, while the untouched block opens (positive control).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from cacheserver.tiers.cluster.layout import HEADER_BYTES, pack_header, unpack_header
from kvshare.bench.redis_cluster import LocalRedisCluster
from policy.sealing import BlockSealer, Keyring, SealError, TenantKeys
from policy.types import BlockDigest, ModelName, StorageKey, TenantId
from tests.cluster.conftest import MODEL, Servers, blocks, cluster_contents, direct, tier_of

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


def test_altered_blocks_are_misses_and_the_agent_aead_refuses_a_forged_one(
    cluster: LocalRedisCluster, start_servers: Callable[..., Servers]
) -> None:
    servers = start_servers(cluster)
    tier = tier_of(servers[0])
    digests, plaintexts = blocks(5)
    sealed = [SEALER.seal("alpha", MODEL, d, p) for d, p in zip(digests, plaintexts, strict=True)]
    servers[0].client("a", transport="grpc").put("alpha", MODEL, digests, sealed)
    servers.settle()
    names = [tier.keys.block(_key(servers, "alpha", d)) for d in digests]
    operator = direct(cluster)
    values = [_bytes(operator.get(n)) for n in names]
    # 0: one payload bit flipped (a bad disk, or a careless operator): a miss.
    corrupt = bytearray(values[0])
    corrupt[HEADER_BYTES + 5] ^= 1
    operator.set(names[0], bytes(corrupt))
    # 1: alpha's block copied under beta's key for the same digest: a miss (header tag).
    beta_name = tier.keys.block(_key(servers, "beta", digests[1]))
    operator.set(beta_name, values[1])
    # 2: forged with a consistent header (what a Redis operator can do): served...
    header = unpack_header(values[2])
    assert header is not None
    forged = bytearray(values[2][HEADER_BYTES:])
    forged[-1] ^= 1
    rewritten = pack_header(header.tenant_tag, header.epoch, header.model_tag, forged)
    operator.set(names[2], rewritten + bytes(forged))
    reader = servers[1]  # holds no local copy: reads the cluster
    alpha = reader.client("a", transport="grpc")
    assert alpha.get("alpha", MODEL, digests[:1]) == []
    assert reader.client("b", transport="grpc").get("beta", MODEL, digests[1:2]) == []
    assert tier_of(reader).counts()["integrity_failures"] == 2
    got = alpha.get("alpha", MODEL, digests[2:4])
    assert got[0] == bytes(forged)
    with pytest.raises(SealError):  # ...and the agent's AEAD refuses it
        SEALER.open("alpha", MODEL, digests[2], got[0])
    assert SEALER.open("alpha", MODEL, digests[3], got[1]) == plaintexts[3]  # control
    # 3: alpha's block 3 placed under alpha's key for block 4: served, refused the same.
    operator.set(names[4], values[3])
    moved = alpha.get("alpha", MODEL, digests[4:])
    assert moved == [sealed[3]]
    with pytest.raises(SealError):
        SEALER.open("alpha", MODEL, digests[4], moved[0])
