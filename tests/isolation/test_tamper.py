"""Tamper trials: every altered, moved, truncated or replayed sealed block is rejected
before a tensor is built.

12,000 seeded trials run against `policy.sealing` and `replica_agent.codec` directly
(the path the agent takes: open, then decode); a few more go through the real server
and the real agent, including an attacker who rewrites a block on disk *and* fixes
the server's checksum. Each trial counts `decode_block` calls: a rejected block must
never reach it. Positive controls are interleaved: untampered blocks open and decode.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterator
from pathlib import Path

import lmdb
import pytest
import torch

from cacheserver.tiers import PendingWrite
from cacheserver.tiers.lmdb.records import checksum, pack_meta, unpack_meta
from policy.sealing import BlockSealer, SealError
from policy.types import BlockDigest, ModelName, TenantId
from replica_agent import codec, device
from replica_agent.agent import ReplicaAgent
from tests.support.isolation import Served
from tests.support.sealed_blocks import (
    CURRENT,
    KEYS,
    MODEL,
    SPEC,
    Sealed,
    keyring,
    make_blocks,
)

TRIALS_PER_KIND = 1500


RETIRED_V1 = keyring(alpha={2: KEYS["alpha2"]}, beta={1: KEYS["beta1"]})  # v1 retired
SAME_KEY_BYTES = keyring(alpha={2: KEYS["alpha2"]}, beta={2: KEYS["alpha2"]})  # misconfigured


class DecodeCounter:
    """Wraps `decode_block` to count calls (a call is the only way to a tensor)."""

    def __init__(self) -> None:
        self.calls = 0
        self._real = codec.decode_block

    def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
        self.calls += 1
        return self._real(*args, **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def decodes(monkeypatch: pytest.MonkeyPatch) -> DecodeCounter:
    counter = DecodeCounter()
    monkeypatch.setattr(codec, "decode_block", counter)
    monkeypatch.setattr(device, "decode_block", counter)
    return counter


def open_and_decode(
    sealer: BlockSealer, tenant: str, model: str, digest: bytes, data: bytes
) -> torch.Tensor:
    """The agent's order: open (AEAD), and only then decode."""
    plaintext = sealer.open(tenant, model, digest, data)
    return codec.decode_block(SPEC, plaintext)


# One trial kind: (rng, blocks) -> (sealer, tenant, model, digest, data) to open.
Trial = tuple[BlockSealer, str, str, bytes, bytes]


def flip_bits(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b = rng.choice(blocks)
    data = bytearray(b.sealed)
    for _ in range(rng.randint(1, 3)):
        position = rng.randrange(len(data) * 8)
        data[position // 8] ^= 1 << (position % 8)
    return BlockSealer(CURRENT), "alpha", MODEL, b.digest, bytes(data)


def truncate(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b = rng.choice(blocks)
    return BlockSealer(CURRENT), "alpha", MODEL, b.digest, b.sealed[: rng.randrange(len(b.sealed))]


def extend(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b = rng.choice(blocks)
    return BlockSealer(CURRENT), "alpha", MODEL, b.digest, b.sealed + os.urandom(rng.randint(1, 64))


def swap_names(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b, other = rng.sample(blocks, 2)
    return BlockSealer(CURRENT), "alpha", MODEL, other.digest, b.sealed


def swap_tenants(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b = rng.choice(blocks)
    ring = rng.choice([CURRENT, SAME_KEY_BYTES])  # even with the same key bytes: AAD binds
    return BlockSealer(ring), "beta", MODEL, b.digest, b.sealed


def swap_models(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b = rng.choice(blocks)
    other = rng.choice([MODEL.replace("fp32", "bf16"), MODEL.replace("L2", "L3"), MODEL + " "])
    return BlockSealer(CURRENT), "alpha", other, b.digest, b.sealed


def replay_retired(rng: random.Random, blocks: list[Sealed]) -> Trial:
    b = rng.choice(blocks)
    return BlockSealer(RETIRED_V1), "alpha", MODEL, b.digest, b.sealed_v1


def splice(rng: random.Random, blocks: list[Sealed]) -> Trial:
    """The key version (and part of the nonce) of another sealing with this body."""
    b, other = rng.sample(blocks, 2)
    cut = rng.randint(9, 33)  # past magic and format: the version field differs (v1, v2)
    donor = other.sealed_v1 if rng.random() < 0.5 else b.sealed_v1
    data = donor[:cut] + b.sealed[cut:]
    assert data != b.sealed
    return BlockSealer(CURRENT), "alpha", MODEL, b.digest, data


KINDS: dict[str, Callable[[random.Random, list[Sealed]], Trial]] = {
    "flip_bits": flip_bits,
    "truncate": truncate,
    "extend": extend,
    "swap_names": swap_names,
    "swap_tenants": swap_tenants,
    "swap_models": swap_models,
    "replay_retired_key": replay_retired,
    "splice_headers": splice,
}


def test_12000_tamper_trials_are_all_rejected_before_a_tensor(decodes: DecodeCounter) -> None:
    rng = random.Random(20260101)
    blocks = make_blocks(16, seed=1)
    rejected = {kind: 0 for kind in KINDS}
    controls = 0
    for round_ in range(TRIALS_PER_KIND):
        for kind, make in KINDS.items():
            sealer, tenant, model, digest, data = make(rng, blocks)
            with pytest.raises(SealError):
                open_and_decode(sealer, tenant, model, digest, data)
            rejected[kind] += 1
        if round_ % 50 == 0:  # positive control: untampered blocks still open and decode
            b = rng.choice(blocks)
            before = decodes.calls
            tensor = open_and_decode(BlockSealer(CURRENT), "alpha", MODEL, b.digest, b.sealed)
            assert torch.equal(tensor, b.tensor) and decodes.calls == before + 1
            controls += 1
    assert sum(rejected.values()) >= 10_000
    assert all(n == TRIALS_PER_KIND for n in rejected.values())
    assert decodes.calls == controls  # only the controls ever reached the decoder


# -- through the real server and the real agent ------------------------------------------


@pytest.fixture
def agent(served: Served) -> Iterator[ReplicaAgent]:
    replica = ReplicaAgent.connect(
        served.address, served.tokens["a"], SPEC, sealer=BlockSealer(CURRENT)
    )
    yield replica
    replica.close()


def _load(agent: ReplicaAgent, tenant: str, digests: list[bytes]) -> torch.Tensor:
    return agent.load(agent.match(tenant, digests))


def test_tampered_blocks_in_the_store_are_misses_for_the_agent(
    served: Served, agent: ReplicaAgent, decodes: DecodeCounter
) -> None:
    good, moved, flipped, retired, cross = make_blocks(5, seed=2)
    bad_bits = bytearray(flipped.sealed)
    bad_bits[len(bad_bits) // 2] ^= 0x10
    fresh = os.urandom(32)  # a name under which another block's bytes are put
    with served.client("root") as root:
        root.put(
            "alpha",
            MODEL,
            [good.digest, flipped.digest, retired.digest, fresh],
            [good.sealed, bytes(bad_bits), retired.sealed_v1, moved.sealed],
        )
        root.put("beta", MODEL, [cross.digest], [cross.sealed])  # alpha's block in beta
    # Positive control: the untampered block loads, exactly.
    loaded = _load(agent, "alpha", [good.digest])
    assert loaded.shape[0] == 1 and torch.equal(loaded[0], good.tensor)
    assert decodes.calls == 1
    retiring = ReplicaAgent.connect(
        served.address, served.tokens["root"], SPEC, sealer=BlockSealer(RETIRED_V1)
    )
    try:
        for replica, tenant, digest in (
            (agent, "alpha", fresh),  # swapped between names
            (agent, "alpha", flipped.digest),  # bit flip in the stored payload
            (retiring, "alpha", retired.digest),  # replay under a retired key version
            (retiring, "beta", cross.digest),  # moved between tenants
        ):
            assert replica.match(tenant, [digest]).blocks == 1  # the store has bytes there
            assert _load(replica, tenant, [digest]).shape[0] == 0
        assert agent.stats.open_failures == 2 and retiring.stats.open_failures == 2
    finally:
        retiring.close()
    assert decodes.calls == 1  # only the positive control was decoded


def test_a_block_rewritten_on_disk_with_a_fixed_checksum_is_still_rejected(
    tmp_path: Path, decodes: DecodeCounter
) -> None:
    """An attacker who can write the data dir rewrites a block *and* its checksum: the
    server serves it, the agent's AEAD refuses it."""
    from tests.support.isolation import isolation_config, serve

    tenancy = isolation_config(tmp_path)
    victim, control = make_blocks(2, seed=3)
    running = serve(tenancy)
    with running.client("a") as a:
        a.put("alpha", MODEL, [victim.digest, control.digest], [victim.sealed, control.sealed])
    key = running.policy.storage_key(
        TenantId("alpha"), ModelName(MODEL), BlockDigest(victim.digest)
    )
    running.stop()
    _rewrite_with_valid_checksum(tmp_path / "data" / "lmdb", key)
    running = serve(tenancy)
    replica = ReplicaAgent.connect(
        running.address, tenancy.tokens["a"], SPEC, sealer=BlockSealer(CURRENT)
    )
    try:
        with running.client("a") as a:
            served_bytes = a.get("alpha", MODEL, [victim.digest])
            assert served_bytes and served_bytes[0] != victim.sealed  # the server served it
        assert _load(replica, "alpha", [victim.digest]).shape[0] == 0
        assert replica.stats.open_failures == 1
        assert torch.equal(_load(replica, "alpha", [control.digest])[0], control.tensor)
    finally:
        replica.close()
        running.stop()
    assert decodes.calls == 1


def _rewrite_with_valid_checksum(lmdb_dir: Path, key: bytes) -> None:
    env = lmdb.open(str(lmdb_dir), max_dbs=4)
    blocks_db, meta_db = env.open_db(b"blocks"), env.open_db(b"meta")
    with env.begin(write=True) as txn:
        raw, raw_meta = txn.get(key, db=blocks_db), txn.get(key, db=meta_db)
        assert raw is not None and raw_meta is not None
        payload = bytearray(raw)
        payload[100] ^= 0xFF
        _, meta = unpack_meta(key, raw_meta)
        write = PendingWrite(
            meta.key, meta.tenant, meta.epoch, meta.clock, bytes(payload), meta.model_tag
        )
        txn.put(key, bytes(payload), db=blocks_db)
        txn.put(key, pack_meta(write, checksum(bytes(payload))), db=meta_db)
    env.close()
