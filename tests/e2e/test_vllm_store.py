"""The vLLM connector's worker side against a real server, on synthetic paged caches.

Everything here is real except vLLM itself: the server (gRPC, LMDB, policy), the
client, sealing and the codec. The paged caches have the layout of vLLM's GPU backends
(`[blocks, heads, tokens, 2 * head_dim]`) with vLLM blocks of 16 tokens and store blocks
of 32, so each store block spans two vLLM blocks. The same code runs inside real vLLM
engines in tests/vllm/.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from policy.sealing import BlockSealer
from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.adapters.vllm_store import PagedCache
from replica_agent.client import BlockClient
from tests.support.servers import Running, free_port, launch, write_config
from tests.support.vllm_pages import (
    DIGESTS,
    LOADED_INTO,
    SPEC,
    paged_cache,
    pages,
    worker,
)

SAVED_FROM = (3, 4, 8, 9)  # vLLM blocks of store blocks 0 and 1 in the saving engine


@pytest.fixture
def store_server(tmp_path: Path) -> Iterator[Running]:
    tenancy = write_config(
        tmp_path,
        principals={"engine": (["alpha", "beta"], ["read", "write"]), "a": (["alpha"], ["read"])},
    )
    with launch(tenancy) as running:
        yield running


def save_from_engine_a(server: Running, sealer: BlockSealer | None) -> PagedCache:
    cache = paged_cache(fill=True)
    store = worker(server.client("engine"), sealer)
    store.save(cache, SavePlan("r1", "alpha", DIGESTS, SAVED_FROM))
    store.close(flush_timeout_s=30)  # a replica that exits still leaves its blocks
    assert store.stats.blocks_saved == 2
    return cache


def test_blocks_saved_by_one_engine_fill_another_engines_cache(
    store_server: Running, sealer: BlockSealer
) -> None:
    source = save_from_engine_a(store_server, sealer)
    target = paged_cache(fill=False)
    store = worker(store_server.client("engine"), sealer)
    failed = store.load(target, LoadPlan("r2", "alpha", DIGESTS, 0, LOADED_INTO))
    assert failed == [] and store.stats.blocks_loaded == 2
    for got, want in zip(pages(target, LOADED_INTO), pages(source, SAVED_FROM), strict=True):
        assert torch.equal(got, want)
    # Local hits cover the first vLLM block: only the ones after it are written.
    partial = paged_cache(fill=False)
    assert store.load(partial, LoadPlan("r3", "alpha", DIGESTS, 16, (1, 5, 6))) == []
    assert not pages(partial, (0,))[0].any()
    assert torch.equal(pages(partial, (1, 5, 6))[0], pages(source, SAVED_FROM[1:])[0])
    store.close(flush_timeout_s=1)
    served = {t.tenant: t for t in store_server.client("engine").stats().tenants}["alpha"]
    assert served.blocks_stored == 2 and served.blocks_served == 4


def test_a_tampered_block_is_reported_and_never_written(
    store_server: Running, sealer: BlockSealer
) -> None:
    save_from_engine_a(store_server, sealer)
    attacker = store_server.client("engine")  # write access to alpha, no data key
    model = SPEC.wire_model()
    sealed = bytearray(attacker.get("alpha", model, DIGESTS)[1])
    sealed[-20] ^= 0x01
    attacker.delete("alpha", model, DIGESTS[1:])
    attacker.put("alpha", model, DIGESTS[1:], [bytes(sealed)])
    target = paged_cache(fill=False)
    store = worker(store_server.client("engine"), sealer)
    failed = store.load(target, LoadPlan("r2", "alpha", DIGESTS, 0, LOADED_INTO))
    assert failed == [5, 6]  # vLLM recomputes store block 1's tokens
    assert store.stats.open_failures == 1 and store.stats.blocks_loaded == 1
    assert all(not layer.any() for layer in pages(target, (5, 6)))
    assert all(layer.any() for layer in pages(target, (0, 1)))  # positive control
    store.close(flush_timeout_s=1)


def test_tenant_b_never_loads_tenant_as_blocks(store_server: Running) -> None:
    save_from_engine_a(store_server, None)
    store = worker(store_server.client("engine"), None)
    as_beta = paged_cache(fill=False)
    failed = store.load(as_beta, LoadPlan("r2", "beta", DIGESTS, 0, LOADED_INTO))
    assert failed == list(LOADED_INTO) and not any(kv.any() for kv in as_beta.layers)
    as_alpha = paged_cache(fill=False)  # positive control: the owner's load fills the cache
    assert store.load(as_alpha, LoadPlan("r3", "alpha", DIGESTS, 0, LOADED_INTO)) == []
    assert all(layer.any() for layer in pages(as_alpha, LOADED_INTO))
    store.close(flush_timeout_s=1)
    # A principal not allowed beta is refused, a miss that leaves the breaker closed.
    only_alpha = worker(store_server.client("a"), None)
    assert only_alpha.load(paged_cache(False), LoadPlan("r4", "beta", DIGESTS, 0, (0, 1, 5, 6)))
    assert only_alpha.stats.refused_calls == 1 and only_alpha.stats.store_errors == 0
    assert only_alpha.gate.breaker.allow()
    only_alpha.close(flush_timeout_s=1)


def test_a_dead_store_fails_loads_and_drops_saves_without_raising() -> None:
    dead = f"127.0.0.1:{free_port()}"
    store = worker(BlockClient(dead, "token", timeout_s=1.0, bulk=False), None)
    cache = paged_cache(fill=True)
    for attempt in range(4):
        failed = store.load(cache, LoadPlan(f"r{attempt}", "alpha", DIGESTS, 0, LOADED_INTO))
        assert failed == list(LOADED_INTO)
    assert store.stats.store_errors == 2 and store.stats.skipped_breaker_open == 2  # breaker
    store.save(cache, SavePlan("r9", "alpha", DIGESTS, SAVED_FROM))
    store.close(flush_timeout_s=10)
    assert store.stats.blocks_dropped == 2 and store.stats.blocks_saved == 0


def test_saves_past_the_queue_bound_are_dropped_not_waited_for(store_server: Running) -> None:
    store = worker(store_server.client("engine"), None, queue_bytes=SPEC.block_payload_bytes)
    store.save(paged_cache(fill=True), SavePlan("r1", "alpha", DIGESTS, SAVED_FROM))
    assert store.stats.blocks_dropped == 2 and store.stats.blocks_queued == 0
    store.close(flush_timeout_s=1)
