"""The replica side's one saver against real servers: its bounds, the breaker, and a
close that gives up on a stopped store within its time limit. Jobs here are plain
bytes (the saver is engine-neutral); the engines' own saves run in
tests/e2e/test_gate_parity.py, test_agent_*.py, test_vllm_store.py and
test_sglang_page_store.py."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.client import BlockClient
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.saver import JOIN_AFTER_CLOSE_S, SaveJob, Saver
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry
from tests.support.servers import Running, ServerProcess, free_port

MODEL = ModelSpec("saver/m", "r1", 1, 1, 8, "float32", 4).wire_model()
BLOCK_BYTES = 1024


def job(count: int) -> SaveJob:
    blocks = [os.urandom(BLOCK_BYTES) for _ in range(count)]
    digests = tuple(os.urandom(32) for _ in range(count))
    return SaveJob("dev", MODEL, digests, blocks.__getitem__, count * BLOCK_BYTES)


def saver(client: BlockClient, **bounds: int) -> Saver:
    gate = StoreGate(CircuitBreaker(failure_threshold=1), AgentTelemetry(), StoreStats())
    return Saver(client, gate, None, **bounds)


def test_saves_past_the_byte_bound_are_dropped_and_the_rest_stored(dev_server: Running) -> None:
    s = saver(dev_server.client(), max_bytes=3 * BLOCK_BYTES)
    first, second, third = job(2), job(1), job(1)
    assert s.reserve(first.blocks, first.nbytes) and s.reserve(second.blocks, second.nbytes)
    assert not s.reserve(third.blocks, third.nbytes)  # over the bound: never waited for
    s.submit(first)
    s.submit(second)
    assert s.flush(timeout_s=30)
    stats = s.gate.stats
    assert (stats.saves_queued, stats.blocks_queued, stats.blocks_saved) == (2, 3, 3)
    assert (stats.saves_dropped, stats.blocks_dropped) == (1, 1)
    assert dev_server.client().lookup("dev", MODEL, first.digests + second.digests) == 3
    assert s.reserve(third.blocks, third.nbytes)  # room again once stored
    s.cancel(third.blocks, third.nbytes, "error")
    s.close(timeout_s=1)


def test_saves_past_the_job_bound_are_dropped(dev_server: Running) -> None:
    s = saver(dev_server.client(), max_jobs=1)
    assert s.reserve(1, BLOCK_BYTES) and not s.reserve(1, BLOCK_BYTES)
    s.cancel(1, BLOCK_BYTES, "error")
    assert s.jobs == 0 and s.gate.stats.saves_dropped == 2
    s.close(timeout_s=1)


def test_a_dead_store_drops_saves_and_the_open_breaker_skips_the_call() -> None:
    s = saver(BlockClient(f"127.0.0.1:{free_port()}", "token", timeout_s=2.0, bulk=False))
    assert s.store(job(2)) == 0  # UNAVAILABLE: the breaker opens (threshold 1)
    assert s.gate.breaker.state is BreakerState.OPEN
    assert s.store(job(3)) == 0  # no call at all
    stats = s.gate.stats
    assert (stats.store_errors, stats.skipped_breaker_open) == (1, 1)
    assert (stats.saves_dropped, stats.blocks_dropped, stats.blocks_saved) == (2, 5, 0)
    s.close()


@pytest.mark.slow
def test_close_gives_up_on_a_stopped_store_within_its_time_limit(tmp_path: Path) -> None:
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"))
    token = (tmp_path / "data" / "dev.token").read_text().strip()
    client = BlockClient(server.address, token, timeout_s=60, bulk=False)
    s = saver(client)
    warm = job(1)
    assert s.reserve(warm.blocks, warm.nbytes)
    s.submit(warm)
    assert s.flush(timeout_s=30) and s.gate.stats.blocks_saved == 1  # it answers
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        for queued in (job(2), job(3)):
            assert s.reserve(queued.blocks, queued.nbytes)
            s.submit(queued)
        started = time.monotonic()
        s.close(timeout_s=0.5)
        assert time.monotonic() - started < 0.5 + JOIN_AFTER_CLOSE_S + 1.0
        assert s.gate.stats.blocks_unflushed == 5  # one job in its Put, one queued
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    client.close()
    server.terminate()
