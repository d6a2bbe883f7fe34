"""KVShareHiCacheStorage as SGLang builds and calls it, against a real kvshare server.

The backend comes from SGLang's own `StorageBackendFactory.create_backend("dynamic",
...)` with the extra config of docs/design.md §7, over real SGLang MHA host pools on the CPU;
page keys come from SGLang's own hashing; pages are read back with SGLang's own
`get_data_page`. Two host pools with two backends are two replicas of one deployment.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from kvcommon.errors import ConfigError
from replica_agent.adapters.sglang import KVShareHiCacheStorage
from replica_agent.client import BlockClient
from tests.support.repo import REPO
from tests.support.servers import ServerProcess, write_engine_files
from tests.support.sglang_hicache import (
    PAGE,
    Store,
    attach,
    fill_random,
    host_pool,
    kvshare_extra,
    page_bytes,
    page_keys,
    store_config,
)

PROMPT = list(range(1000, 1000 + 4 * PAGE))  # four pages of tokens


def slots(pool: Any, pages: int) -> torch.Tensor:
    """Host indices for `pages` pages, from SGLang's own host allocator."""
    indices = pool.alloc(pages * PAGE)
    assert indices is not None
    return indices  # type: ignore[no-any-return]


def firsts(indices: torch.Tensor) -> list[int]:
    return [int(i) for i in indices[::PAGE]]


def test_sglangs_factory_builds_the_backend_from_the_extra_config(store: Store) -> None:
    pool = host_pool()
    extra = kvshare_extra(store)
    backend = attach(pool, extra)
    assert type(backend) is KVShareHiCacheStorage
    assert extra["interface_v1"] == 1  # SGLang reads it after the factory returns
    assert backend.mem_pool_host is pool
    assert backend.tenant == "alpha"
    explicit = kvshare_extra(store) | {"interface_v1": 0}  # the deployer's choice is kept
    attach(host_pool(), explicit).close()
    assert explicit["interface_v1"] == 0
    backend.close()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"keyring": "k"}, "unknown key"),
        ({"tenant": "Not A Tenant"}, "tenant must match"),
        ({"tenant": "gamma"}, "no data key for tenant 'gamma'"),
        ({"target": None}, "`target` is required"),
    ],
)
def test_bad_extra_config_fails_attach_with_what_to_change(
    store: Store, change: dict[str, Any], message: str
) -> None:
    extra = {k: v for k, v in (kvshare_extra(store) | change).items() if v is not None}
    with pytest.raises(ConfigError, match=message):
        attach(host_pool(), extra)


def test_mla_and_unsupported_pools_are_refused_at_attach(store: Store) -> None:
    with pytest.raises(ConfigError, match="MLA models are not supported"):
        attach(host_pool(), kvshare_extra(store), is_mla_model=True)
    with pytest.raises(ConfigError, match="page_unified"):
        pool = host_pool()
        pool.layout = "page_unified"  # a layout kvshare does not read
        attach(pool, kvshare_extra(store))
    with pytest.raises(ConfigError, match="float KV pages only"):
        attach(host_pool(dtype=torch.float8_e4m3fn), kvshare_extra(store))
    backend = attach(host_pool(), kvshare_extra(store))
    with pytest.raises(ConfigError, match="besides its KV"):
        backend.register_mem_host_pool_v2(host_pool(), "mamba")
    backend.register_mem_host_pool_v2(backend.mem_pool_host, "kv")  # the KV pool itself: fine
    backend.close()


@pytest.mark.parametrize(
    ("layout", "dtype"),
    [
        ("page_first", torch.float32),
        ("layer_first", torch.float32),
        ("page_first_direct", torch.float32),
        ("page_head", torch.float32),
        ("page_first", torch.bfloat16),
    ],
)
def test_two_replicas_share_pages_byte_identical(store: Store, layout: str, dtype: Any) -> None:
    """Replica A (page_first) saves; replica B (each layout) loads the same bytes."""
    pool_a, pool_b = host_pool("page_first", dtype), host_pool(layout, dtype)
    fill_random(pool_a, seed=1)
    a, b = attach(pool_a, kvshare_extra(store)), attach(pool_b, kvshare_extra(store))
    keys = page_keys(PROMPT)
    source, target = slots(pool_a, 4), slots(pool_b, 4)
    assert b.batch_exists(keys) == 0
    assert a.batch_set_v1(keys, source) == [True] * 4
    assert b.batch_exists(keys) == 4
    assert b.batch_get_v1(keys, target) == [True] * 4
    for got, want in zip(firsts(target), firsts(source), strict=True):
        assert page_bytes(pool_b, got) == page_bytes(pool_a, want)
    assert b.stats.blocks_loaded == 4 and a.stats.blocks_saved == 4
    a.close()
    b.close()


def test_batch_exists_counts_leading_hits_only(store: Store) -> None:
    pool = host_pool()
    fill_random(pool, seed=2)
    backend = attach(pool, kvshare_extra(store))
    keys = page_keys(PROMPT)
    indices = slots(pool, 4)
    stored = [0, 1, 3]  # page 2 is missing
    pages = torch.cat([indices[i * PAGE : (i + 1) * PAGE] for i in stored])
    assert backend.batch_set_v1([keys[i] for i in stored], pages) == [True] * 3
    assert backend.batch_exists(keys) == 2  # page 3 is stored, but after a miss
    assert backend.batch_exists(keys[2:]) == 0
    assert backend.batch_exists(keys[3:]) == 1
    assert backend.exists(keys[3]) and not backend.exists(keys[2])
    assert backend.batch_exists(page_keys(list(range(4 * PAGE)))) == 0  # another prompt
    backend.close()


def test_partial_hits_fill_the_leading_pages_and_leave_the_rest(store: Store) -> None:
    pool_a, pool_b = host_pool(), host_pool()
    fill_random(pool_a, seed=3)
    fill_random(pool_b, seed=4)  # B's slots hold other data: a miss must not touch it
    a, b = attach(pool_a, kvshare_extra(store)), attach(pool_b, kvshare_extra(store))
    keys = page_keys(PROMPT)
    source, target = slots(pool_a, 2), slots(pool_b, 4)
    a.batch_set_v1(keys[:2], source)
    before = [page_bytes(pool_b, i) for i in firsts(target)]
    assert b.batch_get_v1(keys, target) == [True, True, False, False]
    after = [page_bytes(pool_b, i) for i in firsts(target)]
    assert after[:2] == [page_bytes(pool_a, i) for i in firsts(source)]
    assert after[2:] == before[2:]
    # Keys nobody stored: all misses, nothing written, nothing raised.
    other = page_keys(list(range(2 * PAGE)))
    assert b.batch_get_v1(other, target[: 2 * PAGE]) == [False, False]
    assert [page_bytes(pool_b, i) for i in firsts(target)] == after
    assert b.batch_get_v1([], target[:0]) == [] and b.batch_exists([]) == 0
    a.close()
    b.close()


def test_repeated_sets_succeed_and_store_a_page_once(store: Store) -> None:
    pool = host_pool()
    fill_random(pool, seed=5)
    backend = attach(pool, kvshare_extra(store))
    keys, indices = page_keys(PROMPT), slots(pool, 4)
    assert backend.batch_set_v1(keys, indices) == [True] * 4
    assert backend.batch_set_v1(keys, indices) == [True] * 4  # already there: success
    assert backend.batch_set_v1(keys[:2], indices[: 2 * PAGE]) == [True] * 2
    with BlockClient(store.address, store.token_files["engine"].read_text()) as client:
        alpha = {t.tenant: t for t in client.stats().tenants}["alpha"]
    assert alpha.blocks_stored == 4
    backend.close()


def test_the_older_interface_moves_the_same_pages(store: Store) -> None:
    """get/batch_get/set/batch_set/exists as SGLang's generic page path calls them:
    flat pages from `get_data_page`, loads into `get_dummy_flat_data_page` buffers
    copied in with `set_from_flat_data_page`; interchangeable with the page interface."""
    pool_a, pool_b = host_pool(), host_pool()
    fill_random(pool_a, seed=6)
    a, b = attach(pool_a, kvshare_extra(store)), attach(pool_b, kvshare_extra(store))
    keys = page_keys(PROMPT)
    source, target = firsts(slots(pool_a, 4)), firsts(slots(pool_b, 4))
    assert a.set(keys[0], pool_a.get_data_page(source[0], flat=True))
    assert a.batch_set(keys[1:3], [pool_a.get_data_page(i, flat=True) for i in source[1:3]])
    assert a.batch_set_v1(keys[3:], torch.arange(source[3], source[3] + PAGE)) == [True]
    assert b.exists(keys[0]) and b.batch_exists(keys) == 4
    buffers = [pool_b.get_dummy_flat_data_page() for _ in keys]
    loaded = b.batch_get(keys, buffers)
    assert all(page is buffer for page, buffer in zip(loaded, buffers, strict=True))
    for index, page in zip(target, loaded, strict=True):
        pool_b.set_from_flat_data_page(index, page)
    for got, want in zip(target, source, strict=True):
        assert page_bytes(pool_b, got) == page_bytes(pool_a, want)
    single = b.get(keys[2], pool_b.get_dummy_flat_data_page())
    assert single is not None and torch.equal(single, pool_a.get_data_page(source[2], flat=True))
    assert b.get(page_keys(list(range(PAGE)))[0]) is None  # a miss
    assert b.batch_get(keys + page_keys(list(range(PAGE))))[-1] is None
    a.close()
    b.close()


def test_tenant_b_never_sees_or_loads_tenant_as_pages(store: Store) -> None:
    pool_a, pool_b = host_pool(), host_pool()
    fill_random(pool_a, seed=7)
    keys, source = page_keys(PROMPT), slots(pool_a, 4)
    attach(pool_a, kvshare_extra(store, tenant="alpha")).batch_set_v1(keys, source)
    beta = attach(pool_b, kvshare_extra(store, tenant="beta"))  # the same engine token
    target = slots(pool_b, 4)
    assert beta.batch_exists(keys) == 0
    assert beta.batch_get_v1(keys, target) == [False] * 4
    assert not any(pool_b.get_data_page(i, flat=True).any() for i in firsts(target))
    alpha = attach(host_pool(), kvshare_extra(store, tenant="alpha"))  # positive control
    assert alpha.batch_exists(keys) == 4
    # A deployment whose token does not list its tenant: refused, misses, no exception.
    stranger = attach(pool_b, kvshare_extra(store, tenant="beta", token="only-alpha"))
    assert stranger.batch_exists(keys) == 0
    assert stranger.batch_set_v1(keys, target) == [False] * 4
    assert stranger.stats.refused_calls == 2 and stranger.stats.store_errors == 0
    for backend in (beta, alpha, stranger):
        backend.close()


def test_a_tampered_page_is_refused_and_never_reaches_the_pool(store: Store) -> None:
    pool_a, pool_b = host_pool(), host_pool()
    fill_random(pool_a, seed=8)
    a = attach(pool_a, kvshare_extra(store))
    keys, source = page_keys(PROMPT), slots(pool_a, 4)
    a.batch_set_v1(keys, source)
    namespace = a.namespace  # the store's name for this deployment's pages
    assert namespace == "kvshare-test/tiny@sglang:mha:pp0/1:cp0/1;fp32;L3;H2;D8;B16;tp0/1"
    digests = [bytes.fromhex(k) for k in keys]
    with BlockClient(store.address, store.token_files["engine"].read_text()) as attacker:
        sealed = bytearray(attacker.get("alpha", namespace, digests[1:2])[0])
        sealed[-30] ^= 0x01  # write access to alpha, but no data key
        attacker.delete("alpha", namespace, digests[1:2])
        attacker.put("alpha", namespace, digests[1:2], [bytes(sealed)])
    b = attach(pool_b, kvshare_extra(store))
    target = slots(pool_b, 4)
    assert b.batch_exists(keys) == 4  # the store holds bytes under that name ...
    assert b.batch_get_v1(keys, target) == [True, False, False, False]  # ... not accepted
    assert b.stats.open_failures == 1
    assert page_bytes(pool_b, firsts(target)[0]) == page_bytes(pool_a, firsts(source)[0])
    assert not pool_b.get_data_page(firsts(target)[1], flat=True).any()
    unsealed = attach(host_pool(), kvshare_extra(store, sealed=False))
    assert unsealed.batch_get_v1(keys[:1], slots(unsealed.mem_pool_host, 1)) == [False]
    a.close()
    b.close()
    unsealed.close()


def test_the_store_down_gives_misses_and_dropped_saves_never_an_exception(
    tmp_path: Path,
) -> None:
    """A real `kvshare serve` process, killed with -9 while SGLang's backend uses it."""
    tenancy = store_config(tmp_path)
    token_files, keyring = write_engine_files(tmp_path, tenancy.tokens)
    server = ServerProcess("--config", str(tenancy.path))
    store = Store(server.address, token_files, keyring, server.kill9)
    pool = host_pool()
    fill_random(pool, seed=9)
    backend = attach(pool, kvshare_extra(store))
    keys, indices = page_keys(PROMPT), slots(pool, 4)
    assert backend.batch_set_v1(keys[:2], indices[: 2 * PAGE]) == [True] * 2
    server.kill9()
    assert backend.batch_exists(keys) == 0
    assert backend.batch_get_v1(keys[:2], indices[: 2 * PAGE]) == [False] * 2
    assert backend.batch_set_v1(keys[2:], indices[2 * PAGE :]) == [False] * 2
    assert backend.get(keys[0]) is None and not backend.exists(keys[0])
    assert not backend.set(keys[3], pool.get_data_page(int(indices[3 * PAGE]), flat=True))
    assert not backend.batch_set(keys[:1], [pool.get_data_page(int(indices[0]), flat=True)])
    assert backend.stats.store_errors >= 3 and backend.stats.skipped_breaker_open >= 1
    backend.close()
    # A store that is not up when SGLang starts: the backend attaches, and misses.
    late = attach(host_pool(), kvshare_extra(store) | {"timeout_s": 0.5})
    assert late.batch_exists(keys) == 0
    late.close()


def test_nothing_but_the_backend_imports_sglang() -> None:
    """Importing every other module of kvshare (where its own dependencies are here)
    leaves SGLang unimported: SGLang loads only when it loads the backend."""
    script = """
import importlib, pkgutil, sys
skipped = []
for package in ("kvcommon", "policy", "cacheserver", "replica_agent", "kvshare"):
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name == "replica_agent.adapters.sglang" or info.name.endswith("__main__"):
            continue
        try:
            importlib.import_module(info.name)
        except ImportError as error:  # vLLM, matplotlib...: not in this venv
            assert "sglang" not in str(error), (info.name, error)
            skipped.append(info.name)
assert "sglang" not in sys.modules, [m for m in sys.modules if m.startswith("sglang")][:5]
assert "replica_agent.adapters.sglang_pages" in sys.modules  # the walk reached the adapters
importlib.import_module("replica_agent.adapters.sglang")
assert "sglang" in sys.modules  # positive control: the check sees an import of SGLang
"""
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert result.returncode == 0, result.stderr[-2000:]
