"""Every engine treats each store outcome the same way (replica_agent/gate.py's table).

The same outcomes from a real server, in the three replica-side stacks: the transformers
agent (`ReplicaAgent`), the vLLM connector's store layer (`vllm_store.WorkerStore`, with
the Lookup its scheduler makes through the same gate) and the SGLang backend's store
layer (`sglang_pages.PageStore`). Each scenario runs all three and asserts that they saw
the same thing: what the engine got (blocks matched, loaded, saved), the breaker's state
after, and the counters. The expected values come from the gate's table, so a row that
changes changes every engine or fails here.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import pytest
import torch

from policy.sealing import BlockSealer
from replica_agent.adapters.sglang_pages import HostPages, PageStore
from replica_agent.adapters.vllm_layout import ConcatLastDim
from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.adapters.vllm_store import PagedCache, WorkerStore
from replica_agent.agent import PrefixMatch, ReplicaAgent
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.client import BlockClient
from replica_agent.codec import encode_block
from replica_agent.gate import OUTCOMES, BreakerEffect, Outcome, StoreGate, StoreStats
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry
from tests.support.servers import Running, ServerProcess, free_port

LAYERS, HEADS, DIM, BLOCK_TOKENS, CACHE_BLOCKS = 2, 2, 8, 16, 4
SPEC = ModelSpec("parity/m", "r1", LAYERS, HEADS, DIM, "float32", BLOCK_TOKENS)
COUNTED = (
    "store_errors",
    "refused_calls",
    "skipped_breaker_open",
    "open_failures",
    "format_errors",
    "lookups_failed",
    "blocks_dropped",
)
COOLDOWN_S = 30.0


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Engine(Protocol):
    """One engine's store layer, seen from the engine: blocks it gets, blocks it saves."""

    gate: StoreGate
    model: str

    def lookup(self, tenant: str, digests: list[bytes]) -> int: ...

    def load(self, tenant: str, digests: list[bytes]) -> int: ...

    def save(self, tenant: str, digests: list[bytes]) -> int: ...

    def close(self) -> None: ...


class Transformers:
    def __init__(self, client: BlockClient, sealer: BlockSealer | None, breaker: CircuitBreaker):
        self.agent = ReplicaAgent(client, SPEC, sealer=sealer, breaker=breaker)
        self.gate, self.model = self.agent.gate, self.agent.model

    def lookup(self, tenant: str, digests: list[bytes]) -> int:
        return self.agent.match(tenant, digests).blocks

    def load(self, tenant: str, digests: list[bytes]) -> int:
        match = PrefixMatch(tenant, tuple(digests), len(digests), BLOCK_TOKENS)
        return int(self.agent.load(match).shape[0])

    def save(self, tenant: str, digests: list[bytes]) -> int:
        before = self.gate.stats.blocks_saved
        self.agent.save(tenant, digests, [torch.randn(SPEC.block_shape) for _ in digests])
        self.agent.flush()
        return self.gate.stats.blocks_saved - before

    def close(self) -> None:
        self.agent.close(flush_timeout_s=1)


class Vllm:
    """The worker's store layer; `lookup` is the call the connector's scheduler makes
    (`KVShareConnector._lookup`: the gate's `leading`, on the same gate)."""

    def __init__(self, client: BlockClient, sealer: BlockSealer | None, breaker: CircuitBreaker):
        self.gate = StoreGate(breaker, AgentTelemetry(), StoreStats())
        self.store = WorkerStore(
            client, SPEC, sealer=sealer, gate=self.gate, save_queue_bytes=1 << 30
        )
        self.model = self.store.model

    @staticmethod
    def _cache(fill: bool) -> PagedCache:
        make = torch.randn if fill else torch.zeros
        layers = tuple(make(CACHE_BLOCKS, HEADS, BLOCK_TOKENS, 2 * DIM) for _ in range(LAYERS))
        return PagedCache(layers, ConcatLastDim(BLOCK_TOKENS, HEADS, DIM), BLOCK_TOKENS)

    def lookup(self, tenant: str, digests: list[bytes]) -> int:
        return self.gate.leading(self.store.client, tenant, self.model, digests)

    def load(self, tenant: str, digests: list[bytes]) -> int:
        ids = tuple(range(len(digests)))
        failed = self.store.load(self._cache(False), LoadPlan("r", tenant, tuple(digests), 0, ids))
        return len(digests) - len(failed)

    def save(self, tenant: str, digests: list[bytes]) -> int:
        before = self.gate.stats.blocks_saved
        ids = tuple(range(len(digests)))
        self.store.save(self._cache(True), SavePlan("r", tenant, tuple(digests), ids))
        assert self.store.flush(timeout_s=30)
        return self.gate.stats.blocks_saved - before

    def close(self) -> None:
        self.store.close(flush_timeout_s=1)


class Sglang:
    """The HiCache backend's store layer: one PageStore per tenant, one gate."""

    def __init__(self, client: BlockClient, sealer: BlockSealer | None, breaker: CircuitBreaker):
        self.client, self.sealer = client, sealer
        self.gate = StoreGate(breaker, AgentTelemetry(), StoreStats())
        self.model = SPEC.wire_model()
        self._stores: dict[str, PageStore] = {}

    def _store(self, tenant: str) -> PageStore:
        if tenant not in self._stores:
            self._stores[tenant] = PageStore(
                self.client, SPEC, tenant, sealer=self.sealer, gate=self.gate
            )
        return self._stores[tenant]

    @staticmethod
    def _pages(fill: bool, count: int) -> list[torch.Tensor]:
        make = torch.randn if fill else torch.zeros
        pool = HostPages(
            make(2, CACHE_BLOCKS * BLOCK_TOKENS, LAYERS, HEADS, DIM), "page_first", SPEC
        )
        return [pool.page(i * BLOCK_TOKENS) for i in range(count)]

    def lookup(self, tenant: str, digests: list[bytes]) -> int:
        return self._store(tenant).leading(digests)

    def load(self, tenant: str, digests: list[bytes]) -> int:
        return sum(self._store(tenant).load(digests, self._pages(False, len(digests))))

    def save(self, tenant: str, digests: list[bytes]) -> int:
        return sum(self._store(tenant).save(digests, self._pages(True, len(digests))))

    def close(self) -> None:
        for store in self._stores.values():
            store.close()
        self.client.close()


ENGINES: dict[str, Callable[[BlockClient, BlockSealer | None, CircuitBreaker], Engine]] = {
    "transformers": Transformers,
    "vllm": Vllm,
    "sglang": Sglang,
}


@dataclass(frozen=True)
class Seen:
    matched: int
    loaded: int
    saved: int
    breaker: BreakerState
    counts: tuple[tuple[str, int], ...]


def seen(engine: Engine, matched: int, loaded: int, saved: int) -> Seen:
    counts = tuple((name, getattr(engine.gate.stats, name)) for name in COUNTED)
    return Seen(matched, loaded, saved, engine.gate.breaker.state, counts)


def expect(matched: int, loaded: int, saved: int, outcome: Outcome, **counts: int) -> Seen:
    """What the table says an engine sees; counters not named are 0."""
    state = (
        BreakerState.CLOSED
        if OUTCOMES[outcome].breaker is BreakerEffect.ANSWERED
        else BreakerState.OPEN
    )
    for name in counts:
        assert name in COUNTED
    return Seen(matched, loaded, saved, state, tuple((n, counts.get(n, 0)) for n in COUNTED))


def lookup_load_save(engine: Engine, tenant: str, count: int = 2) -> Seen:
    """Ask for blocks nobody stored, load them, save them: in that order, so a failing
    store opens the breaker (threshold 1) on the lookup and the rest are skipped."""
    digests = [os.urandom(32) for _ in range(count)]
    matched = engine.lookup(tenant, digests)
    loaded = engine.load(tenant, digests)
    saved = engine.save(tenant, digests)
    return seen(engine, matched, loaded, saved)


def each_engine(
    client: Callable[[], BlockClient],
    sealer: BlockSealer | None,
    scenario: Callable[[Engine], Seen],
    breaker: Callable[[], CircuitBreaker] = lambda: CircuitBreaker(failure_threshold=1),
) -> dict[str, Seen]:
    results = {}
    for name, make in ENGINES.items():
        engine = make(client(), sealer, breaker())
        try:
            results[name] = scenario(engine)
        finally:
            engine.close()
    return results


def test_hits_and_misses_are_answers(server: Running, sealer: BlockSealer) -> None:
    """Positive control: a saved prefix is matched and loaded, the block after it is a
    miss, and nothing counts against the store."""

    def scenario(engine: Engine) -> Seen:
        digests = [os.urandom(32) for _ in range(3)]
        saved = engine.save("alpha", digests[:2])
        return seen(engine, engine.lookup("alpha", digests), engine.load("alpha", digests), saved)

    got = each_engine(lambda: server.client("engine"), sealer, scenario)
    assert got == dict.fromkeys(ENGINES, expect(2, 2, 2, Outcome.MISS))


def test_a_refusal_is_a_miss_that_never_opens_the_breaker(server: Running) -> None:
    """A tenant the token does not list: PERMISSION_DENIED on every call. With a breaker
    that opens on one failure, it stays closed: a request naming a foreign tenant must
    not switch the cache off for the replica's other tenants."""
    got = each_engine(
        lambda: server.client("only-alpha"), None, lambda e: lookup_load_save(e, "beta")
    )
    want = expect(0, 0, 0, Outcome.REFUSED, refused_calls=3, lookups_failed=1, blocks_dropped=2)
    assert got == dict.fromkeys(ENGINES, want)
    # Positive control: the same principal is served for its own tenant.
    own = each_engine(lambda: server.client("only-alpha"), None, lambda e: own_tenant(e))
    assert own == dict.fromkeys(ENGINES, expect(2, 2, 2, Outcome.SUCCESS))


def own_tenant(engine: Engine) -> Seen:
    digests = [os.urandom(32) for _ in range(2)]
    saved = engine.save("alpha", digests)
    return seen(engine, engine.lookup("alpha", digests), engine.load("alpha", digests), saved)


def test_an_unreachable_store_opens_the_breaker_and_serves_misses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    dead = f"127.0.0.1:{free_port()}"
    with caplog.at_level(logging.WARNING, logger="replica_agent.gate"):
        got = each_engine(
            lambda: BlockClient(dead, "token", timeout_s=2.0, bulk=False),
            None,
            lambda e: lookup_load_save(e, "alpha"),
        )
    assert_failed_alike(got, caplog, Outcome.UNAVAILABLE, "UNAVAILABLE")


def assert_failed_alike(
    got: dict[str, Seen], caplog: pytest.LogCaptureFixture, outcome: Outcome, status: str
) -> None:
    """Every engine: the lookup failed into a miss, opened the breaker (one store error),
    so the load and the save were skipped, and one warning named the status."""
    want = expect(
        0,
        0,
        0,
        outcome,
        store_errors=1,
        skipped_breaker_open=2,
        lookups_failed=1,
        blocks_dropped=2,
    )
    assert got == dict.fromkeys(ENGINES, want)
    assert [r.getMessage().split(";")[0] for r in caplog.records] == [
        f"store lookup: {status}"
    ] * len(ENGINES)


@pytest.mark.slow
def test_a_store_that_stops_answering_times_out_into_misses(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(tmp_path / "data"))
    token = (tmp_path / "data" / "dev.token").read_text().strip()
    clients = []

    def client() -> BlockClient:
        clients.append(BlockClient(server.address, token, timeout_s=0.5, bulk=False))
        assert clients[-1].lookup("dev", SPEC.wire_model(), [os.urandom(32)]) == 0  # it answers
        return clients[-1]

    def stopped(engine: Engine) -> Seen:
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            return lookup_load_save(engine, "dev")
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)

    with caplog.at_level(logging.WARNING, logger="replica_agent.gate"):
        got = each_engine(client, None, stopped)
    assert_failed_alike(got, caplog, Outcome.TIMEOUT, "DEADLINE_EXCEEDED")
    server.terminate()


def test_a_tampered_block_is_a_miss_from_it_on_and_an_answer_to_the_breaker(
    server: Running, sealer: BlockSealer
) -> None:
    """A writer with write access but no data key replaces block 1. The load stops
    before it in every engine; the read was answered, so the half-open breaker's trial
    closes it (a bad block must not keep the cache off)."""
    clock = Clock()

    def scenario(engine: Engine) -> Seen:
        digests = [os.urandom(32) for _ in range(3)]
        saved = engine.save("alpha", digests)
        attacker = server.client("engine")
        sealed = bytearray(attacker.get("alpha", engine.model, digests[1:2])[0])
        sealed[-20] ^= 0x01
        attacker.delete("alpha", engine.model, digests[1:2])
        attacker.put("alpha", engine.model, digests[1:2], [bytes(sealed)])
        half_open(engine.gate.breaker, clock)
        return seen(engine, 0, engine.load("alpha", digests), saved)  # 0: not asked

    got = each_engine(lambda: server.client("engine"), sealer, scenario, breaker(clock))
    assert got == dict.fromkeys(ENGINES, expect(0, 1, 3, Outcome.TAMPERED, open_failures=1))


def test_a_block_of_another_layout_is_a_miss_and_an_answer_to_the_breaker(
    server: Running,
) -> None:
    """A block under this namespace whose codec header is another layout's (a writer
    with another shape, no keyring in force) never reaches the engine's cache."""
    clock = Clock()
    wide = ModelSpec("parity/m", "r1", LAYERS + 1, HEADS, DIM, "float32", BLOCK_TOKENS)

    def scenario(engine: Engine) -> Seen:
        digests = [os.urandom(32) for _ in range(2)]
        saved = engine.save("alpha", digests[:1])
        other = encode_block(wide, torch.randn(wide.block_shape))
        server.client("engine").put("alpha", engine.model, digests[1:], [other])
        half_open(engine.gate.breaker, clock)
        return seen(engine, 0, engine.load("alpha", digests), saved)  # 0: not asked

    got = each_engine(lambda: server.client("engine"), None, scenario, breaker(clock))
    assert got == dict.fromkeys(ENGINES, expect(0, 1, 1, Outcome.MALFORMED, format_errors=1))


def breaker(clock: Clock) -> Callable[[], CircuitBreaker]:
    return lambda: CircuitBreaker(failure_threshold=1, cooldown_s=COOLDOWN_S, clock=clock)


def half_open(breaker: CircuitBreaker, clock: Clock) -> None:
    """Open `breaker` as failures would, then let its cooldown pass: one trial is next."""
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN
    clock.now += COOLDOWN_S
    assert breaker.state is BreakerState.HALF_OPEN
