"""SGLang's real pieces for the SGLang suite: its MHA device and host KV pools (on the
CPU), its storage backend factory and page keys, and a kvshare server's handle (`Store`)
with the backend's extra config. Imported only where SGLang is (tests/sglang/conftest.py
collects nothing elsewhere)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str

from tests.support.servers import write_config

LAYERS, HEADS, DIM, PAGE = 3, 2, 8, 16
DEVICE_TOKENS = 256  # the host pool holds twice that (host_to_device_ratio 2)
MODEL_NAME = "kvshare-test/tiny"


@dataclass(frozen=True)
class Store:
    """A real kvshare server: tenants alpha and beta; principal `engine` reads and
    writes both, `only-alpha` only alpha. Token files are 0600, as the backend needs."""

    address: str
    token_files: dict[str, Path]
    keyring_file: Path
    stop: Any = field(repr=False)


def store_config(directory: Path) -> Any:
    return write_config(
        directory,
        principals={
            "engine": (["alpha", "beta"], ["read", "write"]),
            "only-alpha": (["alpha"], ["read", "write"]),
        },
    )


def host_pool(layout: str = "page_first", dtype: Any = None) -> MHATokenToKVPoolHost:
    """A real SGLang MHA host pool over a real (CPU) device pool."""
    device = MHATokenToKVPool(
        size=DEVICE_TOKENS,
        page_size=PAGE,
        dtype=dtype or torch.float32,
        head_num=HEADS,
        head_dim=DIM,
        layer_num=LAYERS,
        device="cpu",
        enable_memory_saver=False,
    )
    return MHATokenToKVPoolHost(
        buffer_info=device.get_device_pool_infos()[0].buffer_info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=PAGE,
        layout=layout,
        pin_memory=False,
        device="cpu",
        device_capacity_tokens=device.size,
        start_layer=device.start_layer,
        end_layer=device.end_layer,
    )


def storage_config(extra: dict[str, Any] | None, **overrides: Any) -> HiCacheStorageConfig:
    fields: dict[str, Any] = {
        "tp_rank": 0,
        "tp_size": 1,
        "pp_rank": 0,
        "pp_size": 1,
        "attn_cp_rank": 0,
        "attn_cp_size": 1,
        "is_mla_model": False,
        "enable_storage_metrics": False,
        "is_page_first_layout": True,
        "model_name": MODEL_NAME,
        "extra_config": extra,
    }
    return HiCacheStorageConfig(**{**fields, **overrides})


def kvshare_extra(
    store: Store, *, tenant: str = "alpha", token: str = "engine", sealed: bool = True
) -> dict[str, Any]:
    """The JSON object of --hicache-storage-backend-extra-config (docs/design.md §7)."""
    extra: dict[str, Any] = {
        "backend_name": "kvshare",
        "module_path": "replica_agent.adapters.sglang",
        "class_name": "KVShareHiCacheStorage",
        "target": store.address,
        "token_file": str(store.token_files[token]),
        "tenant": tenant,
        "timeout_s": 2,
    }
    if sealed:
        extra["keyring_file"] = str(store.keyring_file)
    return extra


def attach(pool: MHATokenToKVPoolHost, extra: dict[str, Any], **config: Any) -> Any:
    """The backend as SGLang's cache controller attaches it: the factory, then the
    host pool's registration."""
    backend = StorageBackendFactory.create_backend("dynamic", storage_config(extra, **config), pool)
    backend.register_mem_pool_host(pool)
    assert isinstance(backend, HiCacheStorage)
    return backend


def page_keys(tokens: list[int], prior: str | None = None) -> list[str]:
    """SGLang's own page keys: chained SHA-256 hex of each page's token ids."""
    keys = get_hash_str(tokens, prior, page_size=PAGE)
    assert isinstance(keys, list)
    return keys


def fill_random(pool: MHATokenToKVPoolHost, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(pool.kv_buffer.shape, generator=generator)
    pool.kv_buffer.copy_(values.to(pool.kv_buffer.dtype))


def page_bytes(pool: MHATokenToKVPoolHost, index: int) -> bytes:
    """A page as SGLang itself reads it (`get_data_page`), in a layout-free order:
    [k/v, layers, tokens, heads, dim] for every layout."""
    page = pool.get_data_page(index, flat=False)
    if pool.layout == "page_first":
        page = page.permute(0, 2, 1, 3, 4)
    elif pool.layout == "page_first_direct":
        page = page.squeeze(1)
    elif pool.layout == "page_head":
        page = page.squeeze(1).permute(0, 3, 2, 1, 4)
    return bytes(page.contiguous().view(torch.uint8).numpy().tobytes())
