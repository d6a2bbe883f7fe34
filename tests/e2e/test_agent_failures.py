"""The agent turns a dead or slow store into misses, and never blocks inference."""

from __future__ import annotations

import time

import torch

from replica_agent.agent import ReplicaAgent
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.spec import ModelSpec
from tests.support.servers import Running, free_port

SPEC = ModelSpec(
    model_id="t/m",
    revision="r",
    num_layers=2,
    num_kv_heads=2,
    head_dim=8,
    dtype="float32",
    block_tokens=4,
)


def blocks(n: int) -> list[torch.Tensor]:
    return [torch.randn(SPEC.block_shape) for _ in range(n)]


def test_dead_store_gives_fast_misses_and_opens_the_breaker() -> None:
    agent = ReplicaAgent.connect(
        f"127.0.0.1:{free_port()}",
        "t",
        SPEC,
        timeout_s=1.0,
        breaker=CircuitBreaker(failure_threshold=2, cooldown_s=60),
    )
    digests = agent.digests(list(range(12)))
    started = time.monotonic()
    for _ in range(5):
        assert agent.match("dev", digests).blocks == 0
    assert time.monotonic() - started < 5
    assert agent.breaker.state is BreakerState.OPEN
    assert agent.stats.store_errors == 2 and agent.stats.skipped_breaker_open == 3
    assert agent.save("dev", digests, blocks(3))
    agent.flush()
    assert agent.stats.saves_dropped == 1 and agent.stats.blocks_saved == 0
    agent.close()


def test_save_queue_drops_instead_of_blocking(dev_server: Running) -> None:
    agent = ReplicaAgent(dev_server.client(), SPEC, save_queue_jobs=1)
    digests = agent.digests(list(range(400)))
    started = time.monotonic()
    results = [agent.save("dev", digests[i : i + 1], blocks(1)) for i in range(50)]
    assert time.monotonic() - started < 2  # never waits for the store
    agent.flush()
    assert results.count(False) == agent.stats.saves_dropped > 0
    assert agent.stats.blocks_saved == results.count(True)
    agent.close()


def test_round_trip_through_the_store_and_recovery(dev_server: Running) -> None:
    agent = ReplicaAgent(dev_server.client(), SPEC)
    tokens = list(range(20))
    digests = agent.digests(tokens)
    kv = blocks(len(digests))
    assert agent.save("dev", digests, kv)
    agent.flush()
    match = agent.match("dev", digests)
    assert match.blocks == 5 and match.tokens == 20
    restored = agent.load(match, first_block=2)
    assert restored.shape == (3, *SPEC.block_shape)
    assert all(torch.equal(a, b) for a, b in zip(restored, kv[2:], strict=True))
    assert agent.match("dev", digests, first_block=5).blocks == 5  # nothing more to ask
    agent.close()
