"""The agent's CUDA path end to end: a real server, real clients, and the simulated
asynchronous copy engine (tests/support/simcuda.py) in place of the GPU.

What a user depends on: concurrent loads of different tenants on one agent never see
each other's blocks; a block produced on a side stream is stored as produced; a slow
store never holds the engine's device memory; a shorter restore than asked releases the
rest; running out of device memory, or a CUDA graph capture, is a miss and never an
error; tensor-parallel ranks agree on a count; the saver thread never calls the device.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import pytest
import torch

from kvshare.gpucheck.scenarios import SMALL, blocks_of, judge
from replica_agent.agent import ReplicaAgent
from replica_agent.client import BlockClient
from replica_agent.codec import HEADER_BYTES, decode_block, encode_block, torch_dtype
from replica_agent.spec import ModelSpec
from tests.support.servers import Running, ServerProcess
from tests.support.simcuda import DEVICE, SimCuda

SAVER = "kvshare-saver"


@pytest.fixture
def sim() -> Iterator[SimCuda]:
    engine = SimCuda()
    yield engine
    engine.close()
    assert SAVER not in engine.callers  # the saver thread never touched the device
    assert not engine.violations


def gpu_agent(
    client: BlockClient, sim: SimCuda, *, save_buffer_bytes: int | None = None
) -> ReplicaAgent:
    return ReplicaAgent(
        client, SMALL, device="cuda", device_ops=sim, save_buffer_bytes=save_buffer_bytes
    )


def put_blocks(
    client: BlockClient, tenant: str, digests: list[bytes], blocks: list[torch.Tensor]
) -> None:
    payloads = [encode_block(SMALL, block) for block in blocks]
    client.put(tenant, SMALL.wire_model(), digests, payloads)


def stored(client: BlockClient, tenant: str, digests: list[bytes]) -> list[torch.Tensor]:
    return [decode_block(SMALL, p) for p in client.get(tenant, SMALL.wire_model(), digests)]


@pytest.fixture
def frequent_thread_switches() -> Iterator[None]:
    """Python switches threads every 5 ms by default; races need finer interleaving."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    yield
    sys.setswitchinterval(before)


@pytest.mark.usefixtures("frequent_thread_switches")
@pytest.mark.parametrize("threads", [2, 4])
def test_threads_of_different_tenants_on_one_agent_get_only_their_own_blocks(
    tenant_server: Running, sim: SimCuda, threads: int
) -> None:
    count = 8
    agent = gpu_agent(tenant_server.client("root"), sim)
    tenants = [("alpha", "beta")[t % 2] for t in range(threads)]
    prompts = [[t * 100_000 + i for i in range(count * SMALL.block_tokens)] for t in range(threads)]
    digests = [agent.digests(p) for p in prompts]
    wants = [blocks_of(SMALL, count, seed=200 + t) for t in range(threads)]
    for t in range(threads):
        put_blocks(agent.client, tenants[t], digests[t], wants[t])
    start = threading.Barrier(threads)
    outcomes: dict[int, list[dict[str, int]]] = {}
    failures: list[BaseException] = []

    def request(t: int) -> None:
        try:
            stream = sim.new_stream(DEVICE)
            with sim.use_stream(stream):
                start.wait()
                for _ in range(3):
                    sim.stall(stream, 0.005)  # the engine's stream is busy
                    match = agent.match(tenants[t], digests[t])
                    got = list(sim.read(agent.load(match), stream))
                    others = [b for u in range(threads) if u != t for b in wants[u]]
                    outcomes[t] = [*outcomes.get(t, []), judge(got, wants[t], others).as_dict()]
        except BaseException as error:
            failures.append(error)

    workers = [threading.Thread(target=request, args=(t,)) for t in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert not failures, failures
    # Positive control: every request restored all of its blocks, and none is foreign.
    expected = [{"blocks": count, "wrong": 0, "foreign": 0}] * 3
    assert [outcomes[t] for t in range(threads)] == [expected] * threads
    assert agent.stats.blocks_restored == 3 * threads * count
    agent.close()


def test_a_block_produced_on_a_side_stream_is_saved_as_produced(
    dev_server: Running, sim: SimCuda
) -> None:
    agent = gpu_agent(dev_server.client(), sim)
    digests = agent.digests(list(range(4 * SMALL.block_tokens)))
    produced = blocks_of(SMALL, 4, seed=300)
    producer = sim.new_stream(DEVICE)
    with sim.use_stream(producer):
        sim.stall(producer, 0.03)  # the forward pass that writes the KV is still running
        blocks = [sim.device_tensor(SMALL.block_shape, torch_dtype(SMALL)) for _ in produced]
        for block, values in zip(blocks, produced, strict=True):
            sim.launch(producer, partial(block.copy_, values))
        assert agent.save("dev", digests, blocks)
    del blocks  # the engine frees its tensors at once
    agent.flush()
    assert agent.stats.blocks_saved == 4
    got = stored(agent.client, "dev", digests)
    assert all(torch.equal(g, w) for g, w in zip(got, produced, strict=True))
    agent.close()


@pytest.mark.slow
def test_a_slow_store_keeps_device_memory_held_by_saves_under_its_bound(
    tmp_path: Path, sim: SimCuda
) -> None:
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"))
    token = (tmp_path / "data" / "dev.token").read_text().strip()
    pool_blocks = 4
    agent = gpu_agent(
        BlockClient(server.address, token, timeout_s=60),
        sim,
        save_buffer_bytes=pool_blocks * (HEADER_BYTES + SMALL.block_payload_bytes),
    )
    digests = agent.digests(list(range(17 * SMALL.block_tokens)))
    produced = blocks_of(SMALL, 17, seed=400)
    assert agent.save("dev", digests[16:], produced[16:])  # connected, buffers warm
    agent.flush()
    assert agent.stats.blocks_saved == 1
    digests, produced = digests[:16], produced[:16]
    held: list[int] = []
    accepted: list[int] = []
    engine = sim.current_stream(DEVICE)
    os.kill(server.proc.pid, signal.SIGSTOP)  # the store stops answering
    try:
        for i, values in enumerate(produced):
            block = sim.device_tensor(SMALL.block_shape, torch_dtype(SMALL))
            sim.launch(engine, partial(block.copy_, values))  # the forward pass writes it
            if agent.save("dev", digests[i : i + 1], [block]):
                accepted.append(i)
            del block
            # The engine's own kernel, which holds the block until it has run, is done:
            # whatever device memory is held now, the saves hold.
            sim.synchronize(sim.record(engine))
            gc.collect()
            held.append(sim.device_bytes())
        sim.drain()  # every queued snapshot copy has run; the store is still stopped
        gc.collect()
        held_while_stopped = sim.device_bytes()
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    agent.flush()
    bound = pool_blocks * SMALL.block_payload_bytes
    assert max(held) <= bound and held_while_stopped == 0
    assert agent._snapshots.pool.bytes_made <= pool_blocks * (
        HEADER_BYTES + SMALL.block_payload_bytes
    )
    assert len(accepted) <= pool_blocks and agent.stats.saves_dropped == 16 - len(accepted)
    assert agent.stats.blocks_saved == 1 + len(accepted)  # everything accepted was stored
    got = stored(agent.client, "dev", [digests[i] for i in accepted])
    assert all(torch.equal(g, produced[i]) for g, i in zip(got, accepted, strict=True))
    agent.close()
    server.terminate()


def test_a_partial_restore_returns_what_the_store_still_has_and_frees_the_rest(
    dev_server: Running, sim: SimCuda
) -> None:
    agent = gpu_agent(dev_server.client(), sim)
    digests = agent.digests(list(range(8 * SMALL.block_tokens)))
    want = blocks_of(SMALL, 8, seed=500)
    put_blocks(agent.client, "dev", digests, want)
    match = agent.match("dev", digests)
    assert match.blocks == 8
    agent.client.delete("dev", agent.model, digests[5:])  # evicted between match and load
    restored = agent.load(match)
    got = sim.read(restored, sim.current_stream(DEVICE))
    sim.drain()
    gc.collect()
    assert restored.shape[0] == 5 and all(
        torch.equal(g, w) for g, w in zip(got, want, strict=False)
    )
    assert sim.device_bytes() == 5 * SMALL.block_payload_bytes
    agent.close()


def test_running_out_of_device_memory_is_a_miss_not_an_error(
    dev_server: Running, sim: SimCuda
) -> None:
    agent = gpu_agent(dev_server.client(), sim)
    digests = agent.digests(list(range(8 * SMALL.block_tokens)))
    put_blocks(agent.client, "dev", digests, blocks_of(SMALL, 8, seed=600))
    sim.device_bytes_limit = 2 * SMALL.block_payload_bytes
    restored = agent.load(agent.match("dev", digests))
    assert restored.shape[0] == 0 and agent.stats.oom_misses == 1
    sim.device_bytes_limit = None  # positive control: with memory, the same load restores
    assert agent.load(agent.match("dev", digests)).shape[0] == 8
    agent.close()


def test_during_a_graph_capture_loads_miss_saves_drop_and_the_saver_stays_off_the_device(
    dev_server: Running, sim: SimCuda
) -> None:
    agent = gpu_agent(dev_server.client(), sim)
    digests = agent.digests(list(range(4 * SMALL.block_tokens)))
    produced = blocks_of(SMALL, 4, seed=700)
    blocks = [sim.device_tensor(SMALL.block_shape, torch_dtype(SMALL)) for _ in produced]
    for block, values in zip(blocks, produced, strict=True):
        sim.copy(block, values, sim.current_stream(DEVICE))
    assert agent.save("dev", digests[:2], blocks[:2])
    with sim.capture():  # right after a save: the saver must not touch the device now
        stop = threading.Event()
        stop.wait(0.3)
        assert agent.load(agent.match("dev", digests)).shape[0] == 0
        assert not agent.save("dev", digests[2:], blocks[2:])
    assert agent.stats.capture_skips == 2 and agent.stats.saves_dropped == 1
    assert not sim.violations
    agent.flush()
    assert agent.stats.blocks_saved == 2  # positive control: the save went through after
    assert agent.load(agent.match("dev", digests)).shape[0] == 2
    agent.close()


class TwoRanks:
    """A tp_agree for two ranks in threads: each returns the smaller count."""

    def __init__(self) -> None:
        self._barrier = threading.Barrier(2, timeout=30)
        self._counts: dict[int, int] = {}

    def agree_for(self, rank: int) -> Callable[[int], int]:
        def agree(count: int) -> int:
            self._counts[rank] = count
            self._barrier.wait()
            smallest = min(self._counts.values())
            self._barrier.wait()
            return smallest

        return agree


def test_tensor_parallel_ranks_agree_on_how_many_blocks_they_use(
    dev_server: Running, sim: SimCuda
) -> None:
    specs = [
        ModelSpec("t/m", "r", 2, 1, 8, "float32", 4, tp_rank=rank, tp_size=2) for rank in (0, 1)
    ]
    with pytest.raises(ValueError, match="tp_agree"):
        ReplicaAgent(dev_server.client(), specs[0])
    ranks = TwoRanks()
    agents = [
        ReplicaAgent(dev_server.client(), spec, tp_agree=ranks.agree_for(rank))
        for rank, spec in enumerate(specs)
    ]
    tokens = list(range(4 * 4))
    for agent, held in zip(agents, (4, 2), strict=True):  # rank 1 lost two blocks
        digests = agent.digests(tokens)[:held]
        payloads = [encode_block(agent.spec, torch.randn(agent.spec.block_shape)) for _ in digests]
        agent.client.put("dev", agent.model, digests, payloads)
    results: dict[int, tuple[int, int]] = {}

    def rank_main(rank: int) -> None:
        agent = agents[rank]
        match = agent.match("dev", agent.digests(tokens))
        results[rank] = (match.blocks, agent.load(match).shape[0])

    workers = [threading.Thread(target=rank_main, args=(rank,)) for rank in (0, 1)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert results == {0: (2, 2), 1: (2, 2)}
    for agent in agents:
        agent.close()
