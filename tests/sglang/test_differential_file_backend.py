"""Differential: kvshare's backend against SGLang's own file backend (HiCacheFile).

The same random prompts (sharing prefixes, so chains share keys) hashed by SGLang into
page keys, the same random pages, the same saves in the same order: every chain must
get the same hit count from both backends, and the pages each loads must be the same
bytes. The file backend is driven as SGLang's generic page path drives it (flat pages,
`batch_set` / `batch_get` / `set_from_flat_data_page`); kvshare as its page path with
`interface_v1` (`batch_set_v1` / `batch_get_v1` straight into host slots).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from tests.support.sglang_hicache import (
    PAGE,
    Store,
    attach,
    fill_random,
    host_pool,
    kvshare_extra,
    page_bytes,
    page_keys,
    storage_config,
)

PROMPTS = 6
VOCAB = 50_000


def random_prompts(rng: random.Random) -> list[list[int]]:
    """Prompts that share 0-3 pages of a common prefix, then 1-4 pages of their own;
    one prompt repeats another, so whole chains coincide too."""
    base = [rng.randrange(VOCAB) for _ in range(3 * PAGE)]
    prompts = []
    for _ in range(PROMPTS - 1):
        shared = rng.randrange(4) * PAGE
        tail = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 5) * PAGE)]
        prompts.append(base[:shared] + tail)
    prompts.append(list(prompts[0]))
    return prompts


def file_backend(tmp_path: Path, pool: Any) -> Any:
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    extra = {"file_storage_path": str(tmp_path / "hicache-file")}
    backend = StorageBackendFactory.create_backend("file", storage_config(extra), pool)
    backend.register_mem_pool_host(pool)
    return backend


def firsts(indices: Any) -> list[int]:
    return [int(i) for i in indices[::PAGE]]


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
@pytest.mark.parametrize("seed", [11, 12, 13])
def test_same_hits_and_same_bytes_as_sglangs_file_backend(
    store: Store, tmp_path: Path, layout: str, seed: int
) -> None:
    rng = random.Random(seed)
    chains = [page_keys(prompt) for prompt in random_prompts(rng)]
    source = host_pool(layout)
    fill_random(source, seed)
    hicache_file = file_backend(tmp_path, source)
    kvshare = attach(source, kvshare_extra(store))

    # Saves: for each chain a random subset of its pages (holes included), from slots of
    # random data; the same calls, in the same order, to both backends.
    for keys in chains:
        chosen = sorted(rng.sample(range(len(keys)), rng.randrange(len(keys) + 1)))
        if not chosen:
            continue
        slots = source.alloc(len(chosen) * PAGE)
        subset = [keys[i] for i in chosen]
        flat_pages = [source.get_data_page(i, flat=True) for i in firsts(slots)]
        assert hicache_file.batch_set(subset, flat_pages)
        assert kvshare.batch_set_v1(subset, slots) == [True] * len(subset)

    # Loads: each chain into a fresh pool per backend.
    hits_seen = []
    for keys in chains:
        hits = hicache_file.batch_exists(keys)
        assert kvshare.batch_exists(keys) == hits
        hits_seen.append(hits)
        from_file, from_kvshare = host_pool(layout), host_pool(layout)
        file_slots = firsts(from_file.alloc(len(keys) * PAGE))
        loaded = hicache_file.batch_get(keys, [from_file.get_dummy_flat_data_page() for _ in keys])
        leading = next((i for i, page in enumerate(loaded) if page is None), len(keys))
        assert leading == hits
        for index, page in zip(file_slots, loaded[:hits], strict=False):
            from_file.set_from_flat_data_page(index, page)
        reader = attach(from_kvshare, kvshare_extra(store))
        kv_slots = from_kvshare.alloc(len(keys) * PAGE)
        assert reader.batch_get_v1(keys, kv_slots) == [i < hits for i in range(len(keys))]
        for file_index, kv_index in zip(file_slots[:hits], firsts(kv_slots), strict=False):
            assert page_bytes(from_kvshare, kv_index) == page_bytes(from_file, file_index)
        reader.close()
    # The draw exercised what it is for: some chains hit fully, some partly or not at all.
    assert any(h > 0 for h in hits_seen) and any(
        h < len(k) for h, k in zip(hits_seen, chains, strict=True)
    )
    kvshare.close()
