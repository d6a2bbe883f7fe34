"""The restorer's CUDA branch, run on the CPU against a simulated asynchronous copy engine.

The harness is tested first: copies run late and read their source when they run, a
stream waits for an event, and (the negative control) a restorer with a wait removed
gives wrong bytes under it, so a pass below is not the harness seeing nothing.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest
import torch

from kvshare.gpucheck.scenarios import (
    SMALL,
    WaitsDropped,
    blocks_of,
    concurrent_restores,
    reused_buffer,
    side_stream_snapshot,
    stalled_restore,
)
from replica_agent.codec import HEADER_BYTES, encode_block, torch_dtype
from replica_agent.device import BlockRestorer, Placement
from replica_agent.device_snapshot import HostPool, Snapshotter
from replica_agent.spec import ModelSpec
from tests.support.simcuda import DEVICE, SimCuda

BF16 = ModelSpec(
    model_id="t/m",
    revision="r",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    dtype="bfloat16",
    block_tokens=8,
)


@pytest.fixture
def sim() -> Iterator[SimCuda]:
    engine = SimCuda()
    yield engine
    engine.close()


def block_bytes(spec: ModelSpec) -> int:
    return spec.block_payload_bytes


# -- the harness ----------------------------------------------------------------------------


def test_a_queued_copy_reads_its_source_when_it_runs_not_when_queued(sim: SimCuda) -> None:
    stream = sim.new_stream(DEVICE)
    source, target = torch.zeros(4), sim.device_tensor((4,), torch.float32)
    sim.stall(stream, 0.02)
    sim.copy(target, source, stream)
    source.fill_(7)  # after queueing, before the engine runs the copy
    assert torch.equal(sim.read(target, stream), torch.full((4,), 7.0))


def test_a_stream_waits_for_an_event_and_others_do_not(sim: SimCuda) -> None:
    slow, fast, waiting = (sim.new_stream(DEVICE) for _ in range(3))
    target = sim.device_tensor((1,), torch.float32)
    sim.stall(slow, 0.05)
    sim.launch(slow, lambda: target.fill_(1))
    sim.wait(waiting, sim.record(slow))
    assert torch.equal(sim.read(target, waiting), torch.ones(1))
    early = sim.device_tensor((1,), torch.float32)
    sim.stall(slow, 0.05)
    sim.launch(slow, lambda: early.fill_(1))
    assert not torch.equal(sim.read(early, fast), torch.ones(1))  # fast did not wait


def test_negative_control_the_harness_sees_a_removed_staging_wait(sim: SimCuda) -> None:
    unsafe = BlockRestorer(SMALL, "cuda", ops=WaitsDropped(sim, "synchronize"))
    outcome = stalled_restore(sim, unsafe, count=8)
    assert outcome.blocks == 8 and outcome.wrong >= 4  # buffers rewritten under queued copies


def test_negative_control_the_harness_sees_a_removed_stream_wait() -> None:
    sim = SimCuda(copy_lag_s=0.02)  # the last copies are still queued when the read is
    try:
        unsafe = BlockRestorer(SMALL, "cuda", ops=WaitsDropped(sim, "wait"))
        outcome = stalled_restore(sim, unsafe, count=8, stall_s=0)
    finally:
        sim.close()
    assert outcome.blocks == 8 and outcome.wrong >= 1  # the consumer read before the copies


# -- restores -------------------------------------------------------------------------------


@pytest.mark.parametrize("stall_s", [0.0, 0.02], ids=["idle", "stalled"])
@pytest.mark.parametrize("spec", [SMALL, BF16], ids=["fp32", "bf16"])
def test_a_restore_under_a_stalled_stream_from_a_reused_buffer_is_exact(
    sim: SimCuda, spec: ModelSpec, stall_s: float
) -> None:
    restorer = BlockRestorer(spec, "cuda", ops=sim)
    for seed in range(3):  # the staging is reused across calls
        outcome = stalled_restore(sim, restorer, count=8, seed=seed, stall_s=stall_s)
        assert outcome.as_dict() == {"blocks": 8, "wrong": 0, "foreign": 0}
    assert restorer.staging is not None and restorer.staging.rings_made == 1
    # one ring: two pinned buffers (the codec header and a block each), reused
    assert sim.host_bytes == 2 * (HEADER_BYTES + block_bytes(spec))


@pytest.mark.parametrize("threads", [2, 4])
def test_concurrent_restores_on_one_restorer_never_mix_callers_blocks(
    sim: SimCuda, threads: int
) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    for _ in range(3):
        outcomes = concurrent_restores(sim, restorer, threads=threads, count=8)
        assert [o.as_dict() for o in outcomes] == [
            {"blocks": 8, "wrong": 0, "foreign": 0}
        ] * threads


def test_more_callers_than_rings_wait_for_a_ring(sim: SimCuda) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim, max_concurrent=2)
    outcomes = concurrent_restores(sim, restorer, threads=4, count=6)
    assert all(o.wrong == 0 and o.blocks == 6 for o in outcomes)
    assert restorer.staging is not None and restorer.staging.rings_made == 2


def test_a_partial_restore_keeps_only_the_blocks_it_holds(sim: SimCuda) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    want = blocks_of(SMALL, 5, seed=3)
    consumer = sim.current_stream(DEVICE)
    sim.stall(consumer, 0.02)
    out, restored = restorer.restore(reused_buffer([encode_block(SMALL, b) for b in want]), 8)
    sim.drain()  # the copy out of the 8-block buffer holds it until it has run
    gc.collect()
    assert restored.blocks == 5 and out.shape[0] == 5
    assert sim.device_bytes() == 5 * block_bytes(SMALL)  # the 8-block buffer is gone
    assert all(torch.equal(g, w) for g, w in zip(sim.read(out, consumer), want, strict=True))


def test_a_miss_allocates_and_queues_nothing_on_the_device(sim: SimCuda) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    out, restored = restorer.restore(iter(()), 8)
    sim.drain()
    assert restored.blocks == 0 and out.shape[0] == 0
    assert sim.peak_device_bytes == 0  # not even for a moment


def test_running_out_of_device_memory_is_a_miss(sim: SimCuda) -> None:
    sim.device_bytes_limit = 4 * block_bytes(SMALL)
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    payloads = [encode_block(SMALL, b) for b in blocks_of(SMALL, 8, seed=4)]
    out, restored = restorer.restore(iter(payloads), 8)
    assert (restored.blocks, restored.stopped_by, out.shape[0]) == (0, "out_of_memory", 0)
    _, restored = restorer.restore(iter(payloads[:3]), 3)  # a restore that fits works
    assert restored.blocks == 3 and restored.stopped_by is None


def test_a_bad_block_ends_the_restore_and_keeps_the_good_ones(sim: SimCuda) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    want = blocks_of(SMALL, 3, seed=5)
    payloads = [encode_block(SMALL, b) for b in want]
    payloads[2] = payloads[2][:-1]  # truncated
    out, restored = restorer.restore(iter(payloads), 3)
    assert (restored.blocks, restored.stopped_by) == (2, "format_error")
    got = sim.read(out, sim.current_stream(DEVICE))
    assert all(torch.equal(g, w) for g, w in zip(got, want[:2], strict=True))


def test_no_copies_are_queued_while_the_caller_captures_a_graph(sim: SimCuda) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    payloads = [encode_block(SMALL, b) for b in blocks_of(SMALL, 2, seed=6)]
    with sim.capture():
        _, restored = restorer.restore(iter(payloads), 2)
    assert (restored.blocks, restored.stopped_by) == (0, "capturing")
    assert restorer.staging is not None and restorer.staging.rings_made == 0


def test_restore_into_places_block_parts_into_a_layer_major_layout(sim: SimCuda) -> None:
    """The engine-adapter primitive: each layer's K and V of block i go to tokens
    [i*T, (i+1)*T) of that layer's own tensor (the transformers cache layout)."""
    spec, count = SMALL, 4
    restorer = BlockRestorer(spec, "cuda", ops=sim)
    want = blocks_of(spec, count, seed=8)
    shape = (spec.num_kv_heads, count * spec.block_tokens, spec.head_dim)
    keys = [sim.device_tensor(shape, torch.float32) for _ in range(spec.num_layers)]
    values = [sim.device_tensor(shape, torch.float32) for _ in range(spec.num_layers)]

    def targets(i: int) -> list[Placement]:
        tokens = slice(i * spec.block_tokens, (i + 1) * spec.block_tokens)
        return [
            part
            for layer in range(spec.num_layers)
            for part in (
                (keys[layer][:, tokens], (layer, 0)),
                (values[layer][:, tokens], (layer, 1)),
            )
        ]

    consumer = sim.current_stream(DEVICE)
    sim.stall(consumer, 0.02)
    restored = restorer.restore_into(
        reused_buffer([encode_block(spec, b) for b in want]), targets, count
    )
    assert restored.blocks == count
    for layer in range(spec.num_layers):
        expected_k = torch.cat([b[layer, 0] for b in want], dim=1)
        expected_v = torch.cat([b[layer, 1] for b in want], dim=1)
        assert torch.equal(sim.read(keys[layer], consumer), expected_k)
        assert torch.equal(sim.read(values[layer], consumer), expected_v)


@pytest.mark.parametrize("dropped", [(), ("wait",)], ids=["ordered", "negative-control"])
def test_copies_land_after_the_callers_earlier_work_on_the_destination(
    sim: SimCuda, dropped: tuple[str, ...]
) -> None:
    """Memory the caller's stream still uses (an allocator hands it out again as soon as
    the caller frees it) is written by the restore only after that work."""
    restorer = BlockRestorer(SMALL, "cuda", ops=WaitsDropped(sim, *dropped))
    want = blocks_of(SMALL, 3, seed=11)
    destination = sim.device_tensor((3, *SMALL.block_shape), torch.float32)
    consumer = sim.current_stream(DEVICE)
    sim.stall(consumer, 0.02)
    sim.launch(consumer, lambda: destination.zero_())  # the memory's previous user
    restored = restorer.restore_into(
        iter([encode_block(SMALL, b) for b in want]), lambda i: [(destination[i], ())], 3
    )
    got = sim.read(destination, consumer)
    exact = restored.blocks == 3 and all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert exact is (not dropped)


def test_destinations_on_another_device_are_refused(sim: SimCuda) -> None:
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    host = torch.empty(SMALL.block_shape)
    payloads = [encode_block(SMALL, b) for b in blocks_of(SMALL, 1, seed=9)]
    with pytest.raises(ValueError, match="use a restorer per device"):
        restorer.restore_into(iter(payloads), lambda i: [(host, ())], 1)


# -- save snapshots ---------------------------------------------------------------------------


def test_a_snapshot_waits_for_the_producers_side_stream(sim: SimCuda) -> None:
    outcome = side_stream_snapshot(sim, sim, DEVICE, count=4)
    assert outcome.as_dict() == {"blocks": 4, "wrong": 0, "foreign": 0}


def test_negative_control_a_snapshot_without_the_producer_wait_reads_poison(
    sim: SimCuda,
) -> None:
    outcome = side_stream_snapshot(sim, WaitsDropped(sim, "wait"), DEVICE, count=4)
    assert outcome.wrong == 4


def test_the_host_pool_is_bounded_in_bytes_and_all_or_nothing(sim: SimCuda) -> None:
    pool = HostPool(SMALL, sim, DEVICE, max_bytes=3 * (64 + block_bytes(SMALL)))
    first = pool.take(2)
    assert first is not None and pool.take(2) is None  # 2 + 2 > 3: nothing taken
    second = pool.take(1)
    assert second is not None and pool.take(1) is None
    pool.give_back(first)
    assert pool.take(2) is not None and pool.bytes_made == 3 * pool.block_bytes
    with pytest.raises(ValueError, match="smaller than one encoded block"):
        HostPool(SMALL, sim, DEVICE, max_bytes=100)


def test_snapshot_buffers_are_encoded_blocks(sim: SimCuda) -> None:
    snapshots = Snapshotter(SMALL, sim, HostPool(SMALL, sim, DEVICE, 1 << 20))
    block = blocks_of(SMALL, 1, seed=10)[0]
    device_block = sim.device_tensor(SMALL.block_shape, torch_dtype(SMALL))
    sim.copy(device_block, block, sim.current_stream(DEVICE))
    snapshot = snapshots.take([device_block, block])  # one on the device, one on the host
    assert not isinstance(snapshot, str)
    snapshots.wait(snapshot)
    assert [bytes(e) for e in snapshot.encoded()] == [encode_block(SMALL, block)] * 2


def test_a_snapshot_during_a_capture_is_refused_without_device_calls(sim: SimCuda) -> None:
    snapshots = Snapshotter(SMALL, sim, HostPool(SMALL, sim, DEVICE, 1 << 20))
    block = sim.device_tensor(SMALL.block_shape, torch_dtype(SMALL))
    with sim.capture():
        assert snapshots.take([block]) == "capturing"
    assert snapshots.pool.bytes_made == 0


def test_a_thread_calling_the_device_during_another_threads_capture_is_caught(
    sim: SimCuda,
) -> None:
    """The harness check the saver tests rely on."""
    started, release = threading.Event(), threading.Event()

    def capture() -> None:
        with sim.capture():
            started.set()
            release.wait(10)

    capturer = threading.Thread(target=capture)
    capturer.start()
    started.wait(10)
    with pytest.raises(RuntimeError, match="capturing"):
        sim.record(sim.current_stream(DEVICE))
    release.set()
    capturer.join()
    assert sim.violations


def test_every_staging_reuse_overwrites_the_whole_buffer(sim: SimCuda) -> None:
    """LeftoverLocals: after tenant B's restore, no byte of tenant A's block is left in
    the pinned staging B's restore used (decode writes all of a buffer, or nothing)."""
    restorer = BlockRestorer(SMALL, "cuda", ops=sim)
    alpha, beta = blocks_of(SMALL, 2, seed=12), blocks_of(SMALL, 2, seed=13)
    restorer.restore(iter([encode_block(SMALL, b) for b in alpha]), 2)
    restorer.restore(iter([encode_block(SMALL, b) for b in beta]), 2)
    sim.drain()
    assert restorer.staging is not None and restorer.staging.rings_made == 1
    staged = [slot.buffer for slot in restorer.staging._free[0].slots]
    assert all(any(torch.equal(s, b) for b in beta) for s in staged)
