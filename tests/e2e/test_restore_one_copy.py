"""The agent's sealed restore opens each block straight into where it goes, and its saver
seals each block straight into a buffer it keeps (issue 37).

Through the real server: each sealed block is read as a view of the connection's
buffers and opened by `BlockSealer.open_into` into the restore's own memory (the
destination itself on the CPU, the pinned staging slot on CUDA, here the simulated copy
engine), where the codec header and the values are checked: one host copy per byte
after the socket, no plaintext `bytes` in between (`BlockSealer.open` is never called).

What must not change: a block whose seal is broken, or whose plaintext is not finite,
ends the restore there (that block and the ones after it are a miss, counted), and
leaves nothing of its plaintext in the destination, while the block before it, whose
last bytes the in-place opening borrowed for the codec header, stays intact. Positive
controls: the same blocks restore in full once they are whole.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest
import torch

from policy.sealing import BlockSealer
from replica_agent import codec
from replica_agent.agent import ReplicaAgent
from replica_agent.device import Placement
from replica_agent.spec import ModelSpec
from tests.support.servers import Running
from tests.support.simcuda import SimCuda

SPEC = ModelSpec(
    "e2e/restore-one-copy",
    "r1",
    num_layers=2,
    num_kv_heads=2,
    head_dim=32,
    dtype="bfloat16",
    block_tokens=16,
)
MODEL = SPEC.wire_model()
SENTINEL = 7.0  # what the destination held before the restore


class Openings:
    """Wraps a sealer's `open_into` to record where each block was opened, and its
    `open` to refuse: a plaintext in fresh `bytes` is the copy that must be gone."""

    def __init__(self, sealer: BlockSealer, monkeypatch: pytest.MonkeyPatch) -> None:
        self.into: list[int] = []  # the address of each buffer a block was opened into
        real = sealer.open_into

        def open_into(
            tenant: str, model: str, digest: bytes, sealed: bytes | memoryview, out: memoryview
        ) -> memoryview:
            target = memoryview(out).cast("B")
            self.into.append(torch.frombuffer(target, dtype=torch.uint8).data_ptr())
            return real(tenant, model, digest, sealed, out)

        def fresh_plaintext(*args: object) -> bytes:
            raise AssertionError("a block was opened into fresh bytes: a second host copy")

        monkeypatch.setattr(sealer, "open_into", open_into)
        monkeypatch.setattr(sealer, "open", fresh_plaintext)


@pytest.fixture
def agent(tenant_server: Running, sealer: BlockSealer) -> Iterator[ReplicaAgent]:
    replica = ReplicaAgent(tenant_server.client("a"), SPEC, sealer=sealer)
    yield replica
    replica.close()


def blocks(count: int) -> list[torch.Tensor]:
    return [torch.randn(SPEC.block_shape).to(codec.torch_dtype(SPEC)) for _ in range(count)]


def store(agent: ReplicaAgent, sealer: BlockSealer, digests: list[bytes], kvs: list[bytes]) -> None:
    sealed = [sealer.seal("alpha", MODEL, d, p) for d, p in zip(digests, kvs, strict=True)]
    agent.client.delete("alpha", MODEL, digests)
    assert agent.client.put("alpha", MODEL, digests, sealed) == [True] * len(digests)


def whole_blocks(out: torch.Tensor) -> Callable[[int], list[Placement]]:
    return lambda index: [(out[index], ())]


def layer_parts(out: torch.Tensor) -> Callable[[int], list[Placement]]:
    """Each block's layers in their own places, as an engine's per-layer caches."""
    return lambda index: [(out[index, layer], (layer,)) for layer in range(SPEC.num_layers)]


def test_a_sealed_restore_opens_each_block_into_its_destination_once(
    tenant_server: Running, sealer: BlockSealer, transport: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    replica = ReplicaAgent(tenant_server.client("a", transport=transport), SPEC, sealer=sealer)
    try:
        digests = [os.urandom(32) for _ in range(4)]
        saved = blocks(len(digests))
        store(replica, sealer, digests, [codec.encode_block(SPEC, kv) for kv in saved])
        openings = Openings(sealer, monkeypatch)
        restored = replica.load(replica.match("alpha", digests))
        assert restored.shape[0] == 4
        assert all(torch.equal(r, s) for r, s in zip(restored, saved, strict=True))
        # Each block was opened once, its codec header into the HEADER_BYTES just
        # before its place in the returned tensor and its values into that place.
        assert openings.into == [r.data_ptr() - codec.HEADER_BYTES for r in restored]

        out = torch.full((4, *SPEC.block_shape), SENTINEL, dtype=codec.torch_dtype(SPEC))
        openings.into.clear()
        assert replica.load_into(replica.match("alpha", digests), whole_blocks(out)) == 4
        assert all(torch.equal(r, s) for r, s in zip(out, saved, strict=True))
        # The engine's first block opens into a scratch (the bytes before it are not
        # the restore's to borrow); each later one into the caller's tensor itself.
        assert len(openings.into) == 4
        assert openings.into[1:] == [o.data_ptr() - codec.HEADER_BYTES for o in out[1:]]
    finally:
        replica.close()


@pytest.mark.parametrize("targets", [whole_blocks, layer_parts])
def test_a_broken_seal_ends_the_restore_and_leaves_none_of_its_plaintext(
    agent: ReplicaAgent,
    sealer: BlockSealer,
    targets: Callable[[torch.Tensor], Callable[[int], list[Placement]]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    digests = [os.urandom(32) for _ in range(4)]
    saved = blocks(len(digests))
    payloads = [codec.encode_block(SPEC, kv) for kv in saved]
    store(agent, sealer, digests, payloads)
    openings = Openings(sealer, monkeypatch)
    out = torch.full((4, *SPEC.block_shape), SENTINEL, dtype=codec.torch_dtype(SPEC))
    # Positive control: every block restores, each opened once.
    assert agent.load_into(agent.match("alpha", digests), targets(out)) == 4
    assert all(torch.equal(r, s) for r, s in zip(out, saved, strict=True))
    assert len(openings.into) == 4 and agent.stats.open_failures == 0

    broken = bytearray(sealer.seal("alpha", MODEL, digests[2], payloads[2]))
    broken[len(broken) // 2] ^= 0x01  # one ciphertext bit: AES-GCM writes, then refuses
    agent.client.delete("alpha", MODEL, digests[2:3])
    agent.client.put("alpha", MODEL, digests[2:3], [bytes(broken)])
    out.fill_(SENTINEL)
    assert agent.load_into(agent.match("alpha", digests), targets(out)) == 2
    assert agent.stats.open_failures == 1
    assert torch.equal(out[0], saved[0]) and torch.equal(out[1], saved[1])  # intact
    assert not torch.eq(out[2], saved[2]).any()  # no element of the broken block
    assert torch.equal(out[3], torch.full_like(out[3], SENTINEL))  # never reached


@pytest.mark.parametrize("targets", [whole_blocks, layer_parts])
@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_sealed_block_that_is_not_finite_leaves_none_of_its_plaintext(
    agent: ReplicaAgent,
    sealer: BlockSealer,
    targets: Callable[[torch.Tensor], Callable[[int], list[Placement]]],
    poison: float,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    digests = [os.urandom(32) for _ in range(3)]
    saved = blocks(len(digests))
    bad = saved[1].clone()
    bad.view(-1)[-3] = poison  # authentic (sealed by the tenant's key), but unusable
    store(
        agent, sealer, digests, [codec.encode_block(SPEC, kv) for kv in (saved[0], bad, saved[2])]
    )
    Openings(sealer, monkeypatch)
    out = torch.full((3, *SPEC.block_shape), SENTINEL, dtype=codec.torch_dtype(SPEC))
    assert agent.load_into(agent.match("alpha", digests), targets(out)) == 1
    assert agent.stats.format_errors == 1 and agent.stats.open_failures == 0
    assert torch.equal(out[0], saved[0])  # its last bytes held block 1's header: put back
    assert not torch.eq(out[1], bad).any()
    assert torch.equal(out[2], torch.full_like(out[2], SENTINEL))
    # Positive control: the finite block restores.
    store(agent, sealer, digests[1:2], [codec.encode_block(SPEC, saved[1])])
    assert agent.load_into(agent.match("alpha", digests), targets(out)) == 3
    assert all(torch.equal(r, s) for r, s in zip(out, saved, strict=True))


def test_on_cuda_each_block_opens_into_its_staging_slot_and_a_broken_one_is_not_copied(
    tenant_server: Running, sealer: BlockSealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sim = SimCuda()
    replica = ReplicaAgent(
        tenant_server.client("a"), SPEC, sealer=sealer, device="cuda", device_ops=sim
    )
    try:
        digests = [os.urandom(32) for _ in range(4)]
        saved = blocks(len(digests))
        payloads = [codec.encode_block(SPEC, kv) for kv in saved]
        store(replica, sealer, digests, payloads)
        openings = Openings(sealer, monkeypatch)
        out = sim.device_tensor((4, *SPEC.block_shape), codec.torch_dtype(SPEC))
        consumer = sim.default_stream()
        assert replica.load_into(replica.match("alpha", digests), whole_blocks(out)) == 4
        assert all(torch.equal(sim.read(o, consumer), s) for o, s in zip(out, saved, strict=True))
        staging = replica._restorer.staging
        assert staging is not None
        with staging.ring() as ring:  # the one ring the restore used, given back
            slots = {slot.raw.data_ptr() for slot in ring.slots}
        assert len(openings.into) == 4 and set(openings.into) <= slots

        broken = bytearray(sealer.seal("alpha", MODEL, digests[1], payloads[1]))
        broken[-40] ^= 0x01
        replica.client.delete("alpha", MODEL, digests[1:2])
        replica.client.put("alpha", MODEL, digests[1:2], [bytes(broken)])
        fresh = sim.device_tensor((4, *SPEC.block_shape), codec.torch_dtype(SPEC))
        assert replica.load_into(replica.match("alpha", digests), whole_blocks(fresh)) == 1
        assert replica.stats.open_failures == 1
        assert torch.equal(sim.read(fresh[0], consumer), saved[0])
        assert not torch.eq(sim.read(fresh[1], consumer), saved[1]).any()  # never copied
        with staging.ring() as ring:  # nor left in the slot it was opened into
            [slot] = [s for s in ring.slots if s.raw.data_ptr() == openings.into[-1]]
            assert not torch.eq(slot.buffer, saved[1]).any()
    finally:
        replica.close()
        sim.close()


def test_the_saver_seals_each_block_into_a_kept_buffer(
    agent: ReplicaAgent, sealer: BlockSealer, monkeypatch: pytest.MonkeyPatch
) -> None:
    sealed_into: list[int] = []
    real = sealer.seal_into

    def seal_into(
        tenant: str, model: str, digest: bytes, plaintext: memoryview, out: memoryview
    ) -> memoryview:
        sealed_into.append(torch.frombuffer(out, dtype=torch.uint8).data_ptr())
        return real(tenant, model, digest, plaintext, out)

    def fresh_ciphertext(*args: object, **kwargs: object) -> bytes:
        raise AssertionError("a block was sealed into fresh bytes, then copied after a header")

    monkeypatch.setattr(sealer, "seal_into", seal_into)
    monkeypatch.setattr(sealer, "seal", fresh_ciphertext)
    digests = [os.urandom(32) for _ in range(4)]
    saved = blocks(len(digests))
    for pair in (slice(0, 2), slice(2, 4)):  # two saves, one Put each
        assert agent.save("alpha", digests[pair], saved[pair])
        assert agent.flush(timeout_s=60)
    assert agent.stats.blocks_saved == 4 and agent.stats.blocks_dropped == 0
    assert len(sealed_into) == 4
    assert sealed_into[2:] == sealed_into[:2]  # the second Put sealed into the same buffer
    restored = agent.load(agent.match("alpha", digests))  # they open as they were saved
    assert restored.shape[0] == 4
    assert all(torch.equal(r, s) for r, s in zip(restored, saved, strict=True))
