"""SGLang host pages through a real server, without SGLang (tests/sglang runs the same
code inside SGLang's HiCache backend interface with SGLang's real pools).

Real: the server (gRPC, bulk channel, LMDB, policy), the client, sealing, the codec.
The host buffers have the shapes SGLang allocates
(tests/unit/replica_agent/adapters/test_sglang_pages.py).
"""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from kvcommon.errors import ConfigError
from policy.sealing import BlockSealer
from replica_agent.adapters.sglang_pages import HostPages, PageStore, parse_put_bytes
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry
from tests.support.datafiles import read_allocated
from tests.support.servers import Running
from tests.support.sglang_pages import (
    DIGESTS,
    DIM,
    HEADS,
    LAYERS,
    PAGE,
    SPEC,
    TOKENS,
    pool,
    replica,
)

SPEC_BYTES = SPEC.block_payload_bytes


def test_pages_saved_by_one_replica_fill_another_replicas_pool(
    server: Running, sealer: BlockSealer
) -> None:
    source, target = pool(fill=True), pool(fill=False)
    a = replica(server.client("engine"), sealer=sealer)
    assert a.save(DIGESTS[:3], [source.page(i * PAGE) for i in (1, 4, 6)]) == [True] * 3
    assert a.save(DIGESTS[:1], [source.page(PAGE)]) == [True]  # already there: still True
    b = replica(server.client("engine"), sealer=sealer)
    assert b.leading(DIGESTS) == 3
    assert b.load(DIGESTS[:3], [target.page(i * PAGE) for i in (0, 2, 7)]) == [True] * 3
    for got, want in zip((0, 2, 7), (1, 4, 6), strict=True):
        assert torch.equal(target.page(got * PAGE), source.page(want * PAGE))
    assert not target.page(PAGE).any()  # nothing else was written
    # A miss after the hits: the hits are filled, the miss reported, nothing raised.
    assert b.load(DIGESTS, [target.page(i * PAGE) for i in range(4)]) == [True] * 3 + [False]
    assert b.stats.blocks_loaded == 6 and b.stats.blocks_failed == 1


def test_a_save_larger_than_put_bytes_goes_in_several_puts(server: Running) -> None:
    source, target = pool(fill=True), pool(fill=False)
    gate = StoreGate(CircuitBreaker(), AgentTelemetry(), StoreStats())
    client = server.client("engine")
    puts: list[int] = []
    real_put = client.put

    def counted_put(*args: Any) -> list[bool]:  # the real Put, counted
        puts.append(len(args[2]))
        return real_put(*args)

    client.put = counted_put  # type: ignore[method-assign,assignment]
    small = PageStore(client, SPEC, "alpha", sealer=None, gate=gate, put_bytes=2 * SPEC_BYTES)
    assert small.save(DIGESTS[:3], [source.page(i * PAGE) for i in range(3)]) == [True] * 3
    assert puts == [2, 1]  # two pages per Put
    assert small.stats.blocks_saved == 3
    assert small.load(DIGESTS[:3], [target.page(i * PAGE) for i in range(3)]) == [True] * 3
    assert torch.equal(target.kv_buffer[:, : 3 * PAGE], source.kv_buffer[:, : 3 * PAGE])
    assert parse_put_bytes({}, source="x") == 64 << 20
    with pytest.raises(ConfigError, match="put_bytes must be"):
        parse_put_bytes({"put_bytes": 0}, source="x")


def test_leading_counts_only_the_pages_before_the_first_miss(server: Running) -> None:
    source = pool(fill=True)
    store = replica(server.client("engine"))
    store.save([DIGESTS[0], DIGESTS[2]], [source.page(0), source.page(PAGE)])
    assert store.leading(DIGESTS[:3]) == 1  # page 2 is stored, but after a miss
    assert store.leading(DIGESTS[1:]) == 0
    assert store.leading([]) == 0


def test_a_tampered_page_is_refused_and_never_written(server: Running, sealer: BlockSealer) -> None:
    source = pool(fill=True)
    replica(server.client("engine"), sealer=sealer).save(
        DIGESTS[:2], [source.page(0), source.page(PAGE)]
    )
    attacker = server.client("engine")  # write access to alpha, no data key
    model = SPEC.wire_model()
    sealed = bytearray(attacker.get("alpha", model, DIGESTS[:2])[1])
    sealed[-20] ^= 0x01
    attacker.delete("alpha", model, DIGESTS[1:2])
    attacker.put("alpha", model, DIGESTS[1:2], [bytes(sealed)])
    target = pool(fill=False)
    store = replica(server.client("engine"), sealer=sealer)
    assert store.load(DIGESTS[:2], [target.page(0), target.page(PAGE)]) == [True, False]
    assert store.stats.open_failures == 1
    assert torch.equal(target.page(0), source.page(0))  # positive control
    assert not target.page(PAGE).any()  # the tampered page never reached the pool


def test_a_page_of_another_layout_is_refused(server: Running) -> None:
    """A writer with another shape under this namespace (a bug, or a hostile writer
    without a keyring in force) is caught by the codec header before any element."""
    wide = ModelSpec(SPEC.model_id, SPEC.revision, LAYERS, HEADS, DIM, "float32", 2 * PAGE)
    source = HostPages(torch.randn(2, TOKENS, LAYERS, HEADS, DIM), "page_first", wide)
    writer = replica(server.client("engine"), spec=wide)
    writer.model = SPEC.wire_model()  # the same name as this replica's pages
    assert writer.save(DIGESTS[:1], [source.page(0)]) == [True]
    target = pool(fill=False)
    store = replica(server.client("engine"))
    assert store.leading(DIGESTS[:1]) == 1
    assert store.load(DIGESTS[:1], [target.page(0)]) == [False]
    assert store.stats.format_errors == 1
    assert not target.kv_buffer.any()


def test_tenant_b_never_sees_or_loads_tenant_as_pages(server: Running, sealer: BlockSealer) -> None:
    source = pool(fill=True)
    replica(server.client("engine"), sealer=sealer).save(DIGESTS[:2], [source.page(0)] * 2)
    beta = replica(server.client("engine"), "beta", sealer)
    target = pool(fill=False)
    assert beta.leading(DIGESTS[:2]) == 0
    assert beta.load(DIGESTS[:2], [target.page(0), target.page(PAGE)]) == [False, False]
    assert not target.page(0).any()
    alpha = replica(server.client("engine"), "alpha", sealer)  # positive control
    assert alpha.leading(DIGESTS[:2]) == 2
    assert alpha.load(DIGESTS[:1], [target.page(0)]) == [True]
    # A deployment configured with a tenant its token does not list: refused, a miss,
    # and the breaker stays closed (the store is fine).
    stranger = replica(server.client("only-alpha"), "beta")
    assert stranger.leading(DIGESTS[:2]) == 0
    assert stranger.save(DIGESTS[2:3], [source.page(0)]) == [False]
    assert stranger.load(DIGESTS[:1], [target.page(PAGE)]) == [False]
    assert stranger.stats.refused_calls == 3 and stranger.stats.store_errors == 0
    assert stranger.gate.breaker.state is BreakerState.CLOSED


def test_sglang_page_keys_never_reach_the_servers_disk(
    server: Running, sealer: BlockSealer
) -> None:
    """SGLang's page keys hash only tokens (no tenant, no model): stored raw they would
    let anyone with the disk test a guessed prompt. The server keeps keyed names."""
    source = pool(fill=True)
    keys = [hashlib.sha256(f"page {i}".encode()).hexdigest() for i in range(4)]
    store = replica(server.client("engine"), sealer=sealer)
    assert store.save(DIGESTS, [source.page(i * PAGE) for i in range(4)]) == [True] * 4
    sealed = server.client("engine").get("alpha", SPEC.wire_model(), DIGESTS[:1])[0]
    server.stop()
    written = b"".join(
        read_allocated(path) for path in sorted(server.data_dir.rglob("*")) if path.is_file()
    )
    assert sealed[-64:] in written  # positive control: the pages are on this disk
    for key, digest in zip(keys, DIGESTS, strict=True):
        assert digest not in written and key.encode() not in written


def test_the_store_down_gives_misses_and_dropped_saves_never_an_exception(
    server: Running,
) -> None:
    source, target = pool(fill=True), pool(fill=False)
    store = replica(server.client("engine", timeout_s=2.0))
    assert store.save(DIGESTS[:1], [source.page(0)]) == [True]
    server.stop()
    assert store.leading(DIGESTS[:1]) == 0
    assert store.load(DIGESTS[:1], [target.page(0)]) == [False]
    assert store.gate.breaker.state is BreakerState.OPEN  # two failures
    assert store.save(DIGESTS[1:2], [source.page(PAGE)]) == [False]  # skipped, no copies
    assert store.load(DIGESTS[:1], [target.page(0)]) == [False]
    assert store.stats.store_errors == 2 and store.stats.skipped_breaker_open == 2
    assert store.stats.blocks_dropped == 1 and store.stats.lookups_failed == 1
    assert not target.page(0).any()
