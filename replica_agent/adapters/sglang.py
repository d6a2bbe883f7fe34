"""`KVShareHiCacheStorage`: kvshare as SGLang's HiCache storage tier (docs/design.md §7).

    python -m sglang.launch_server --model-path MODEL --enable-hierarchical-cache \\
      --page-size 64 --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "kvshare",
        "module_path": "replica_agent.adapters.sglang",
        "class_name": "KVShareHiCacheStorage", "interface_v1": 1,
        "target": "HOST:PORT", "token_file": "PATH", "tenant": "ID",
        "keyring_file": "PATH"}'

SGLang's cache controller builds one backend per rank (`cls(storage_config, kwargs)`),
registers its host KV pool, then calls it from background threads: `batch_exists`
(how many leading pages the store holds), `batch_get_v1` / `batch_set_v1` (pages
between the store and host-pool slots; with `"interface_v1": 1`, which the backend
sets when the key is absent) or the older `get/batch_get/set/batch_set/exists`. Page
keys are SGLang's chained SHA-256 hex strings, one per page of tokens; their 32 bytes
are kvshare's block digests, and the server names blocks by a keyed hash of them.

Tenancy: SGLang gives a storage backend no per-request identity, so the tenant is fixed
per deployment (`tenant`): one tenant per SGLang server, and per-user separation only
through SGLang's own `extra_key` / `cache_salt`, which seed its key chain.

Public prefixes (`"public_prefixes"`, default true; `sglang_public`): the catalogue of
`@public` for this namespace lists SGLang page keys of published pages; a listed key is
read in `@public` (opened with its key), any other in the tenant, and a listed key is
never saved. With `"publish": true` (a principal with only the `publish` action, no
`tenant`) the backend is a publisher: every page goes to `@public` and is listed.

Namespace: the model name (`model`, else SGLang's served model) with "sglang", the
attention kind (MHA; MLA pools are refused), PP and attention-CP rank/size, then the
codec layout (dtype, layers, KV heads, head dim, page tokens, TP rank/size), so pages
of different shapes never mix. Everything about pages and the store is in
`sglang_pages`; this module is the only one in kvshare that imports SGLang.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from kvcommon.errors import ConfigError
from replica_agent.adapters.settings import parse_store_settings
from replica_agent.adapters.sglang_pages import (
    HostPages,
    PageStore,
    namespace_spec,
    page_digest,
    parse_put_bytes,
)
from replica_agent.adapters.sglang_public import PublicSplitPages, PublishingPages
from replica_agent.breaker import CircuitBreaker
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.public import PUBLIC_SCOPE, PublicCatalogue
from replica_agent.telemetry import AgentTelemetry

if TYPE_CHECKING:
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from replica_agent.spec import ModelSpec

log = logging.getLogger(__name__)
T = TypeVar("T")
Pages = PageStore | PublicSplitPages | PublishingPages  # what the page verbs go through
SOURCE = "--hicache-storage-backend-extra-config"
# SGLang's own keys in the same JSON object (it pops some before the backend sees them).
ENGINE_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        "tp_lcm_size",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)
OWN_KEYS = frozenset({"put_bytes", "public_prefixes", "publish"})  # beside the store settings
KV_POOL = "kv"


class KVShareHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    def __init__(
        self, storage_config: HiCacheStorageConfig, kwargs: Mapping[str, Any] | None = None
    ) -> None:
        extra = storage_config.extra_config if storage_config.extra_config is not None else {}
        self.public_prefixes = _flag(extra, "public_prefixes", default=True)
        self.publish = _flag(extra, "publish", default=False)
        self.settings = parse_store_settings(
            extra, source=SOURCE, engine_keys=ENGINE_KEYS | OWN_KEYS, publisher=self.publish
        )
        self.put_bytes = parse_put_bytes(extra, source=SOURCE)
        if storage_config.is_mla_model:
            raise ConfigError(
                "kvshare's SGLang backend stores MHA pages only; MLA models are not supported yet"
            )
        self.storage_config = storage_config
        self.tenant = self.settings.tenant
        self._sealer = self.settings.sealer()
        if self._sealer is not None and self.tenant not in self._sealer.keyring.tenants():
            how = "kvshare admin keyring --public" if self.publish else "kvshare admin keyring"
            raise ConfigError(
                f"{SOURCE}: the keyring has no data key for tenant {self.tenant!r}; add one "
                f"({how}) or drop keyring_file"
            )
        self.stats = StoreStats()
        self._gate = StoreGate(CircuitBreaker(), AgentTelemetry(), self.stats)
        self._client = self.settings.connect()
        self._pages: HostPages | None = None
        self._store: Pages | None = None
        self.catalogue: PublicCatalogue | None = None  # of this namespace, when read
        self.namespace: str | None = None  # the store's model name of these pages
        if "interface_v1" not in extra:  # SGLang reads it after building the backend
            extra["interface_v1"] = 1
            log.info("kvshare HiCache backend: using SGLang's page interface (interface_v1)")

    # -- set-up ---------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        spec = namespace_spec(
            self.storage_config,
            mem_pool_host,
            self.settings.model,
            self.settings.weight_version,
        )
        layout = str(getattr(mem_pool_host, "layout", ""))
        kv_buffer = getattr(mem_pool_host, "kv_buffer", None)
        if not isinstance(kv_buffer, torch.Tensor):
            raise ConfigError("the host pool has no kv_buffer tensor: not an MHA host pool")
        self._pages = HostPages(kv_buffer, layout, spec)
        self.namespace = spec.wire_model()
        self._store = self._page_store(spec)
        log.info(
            "kvshare HiCache backend: namespace %s, %s pages of %d tokens, %s, %s",
            self.namespace,
            layout,
            spec.block_tokens,
            "sealed" if self._sealer is not None else "not sealed (no keyring_file)",
            "publishing to the public scope"
            if self.publish
            else f"public prefixes {'on' if self.catalogue is not None else 'off'}",
        )

    def _page_store(self, spec: ModelSpec) -> Pages:
        """The tenant's pages; a publisher's in @public; with public prefixes, the
        tenant's beside the published pages its catalogue lists (sglang_public)."""

        def scope(tenant: str) -> PageStore:
            return PageStore(
                self._client,
                spec,
                tenant,
                sealer=self._sealer,
                gate=self._gate,
                put_bytes=self.put_bytes,
            )

        if self.publish:
            return PublishingPages(scope(PUBLIC_SCOPE))
        if not self.public_prefixes:
            return scope(self.tenant)
        if self._sealer is not None and PUBLIC_SCOPE not in self._sealer.keyring.tenants():
            log.info(
                "kvshare HiCache backend: public prefixes off: the keyring has no key for "
                "the public scope (kvshare admin keyring --public)"
            )
            return scope(self.tenant)
        self.catalogue = PublicCatalogue(
            self._client, self._gate, spec.wire_model(), sealer=self._sealer
        )
        return PublicSplitPages(scope(self.tenant), scope(PUBLIC_SCOPE), self.catalogue.digests)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        if str(host_pool_name) != KV_POOL:
            raise ConfigError(
                f"this model has a HiCache pool {str(host_pool_name)!r} besides its KV "
                "(Mamba, SWA, indexer state): kvshare's SGLang backend stores KV pages only"
            )
        super().register_mem_host_pool_v2(host_pool, host_pool_name)

    # -- the page interface ---------------------------------------------------------------

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        """How many leading pages of `keys` the store holds (0 when it cannot say)."""
        return self._safely("lookup", 0, lambda store, _: store.leading(_digests(keys)))

    def batch_get_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Fill the host pages at `host_indices` from the store; True for each page
        filled, always a prefix: SGLang uses the pages up to the first False."""

        def load(store: Pages, pages: HostPages) -> list[bool]:
            targets = pages.pages(host_indices.tolist(), len(keys))
            return store.load(_digests(keys), targets)

        return self._safely("get", [False] * len(keys), load)

    def batch_set_v1(
        self, keys: list[str], host_indices: torch.Tensor, extra_info: Any = None
    ) -> list[bool]:
        """Save the host pages at `host_indices`; all True, or all False (dropped)."""

        def save(store: Pages, pages: HostPages) -> list[bool]:
            return store.save(_digests(keys), pages.pages(host_indices.tolist(), len(keys)))

        return self._safely("put", [False] * len(keys), save)

    # -- the older interface: flat pages in the host layout's order ------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def get(
        self, key: str, target_location: Any = None, target_sizes: Any = None
    ) -> torch.Tensor | None:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_get(
        self, keys: list[str], target_locations: Any = None, target_sizes: Any = None
    ) -> list[torch.Tensor | None]:
        def load(store: Pages, pages: HostPages) -> list[torch.Tensor | None]:
            targets = [pages.new_flat() for _ in keys]
            if target_locations is not None:
                targets = list(target_locations)
            if len(targets) != len(keys):
                raise ValueError(f"{len(keys)} keys but {len(targets)} target locations")
            done = store.load(_digests(keys), [pages.flat(t) for t in targets])
            return [t if ok else None for t, ok in zip(targets, done, strict=True)]

        return self._safely("get", [None] * len(keys), load)

    def set(
        self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None
    ) -> bool:
        return value is not None and self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any = None,
        target_locations: Any = None,
        target_sizes: Any = None,
    ) -> bool:
        def save(store: Pages, pages: HostPages) -> bool:
            flats = [pages.flat(v) for v in values]
            return len(flats) == len(keys) and all(store.save(_digests(keys), flats))

        return bool(values is not None and self._safely("put", False, save))

    # -- the rest -------------------------------------------------------------------------

    def clear(self) -> None:
        """SGLang's /clear_hicache_storage_backend: the store is shared with other
        replicas (and tenants), so an engine does not empty it; an admin can
        (`kvshare admin`, a tenant's epoch, or Delete with admin rights)."""
        log.warning("kvshare HiCache backend: clear ignored; the store is shared")

    def close(self) -> None:
        if self._store is not None:
            self._store.close()
        self._client.close()

    def _safely(self, what: str, miss: T, action: Callable[[Pages, HostPages], T]) -> T:
        """`action`, or `miss` before a host pool is registered or if anything raised:
        nothing reaches SGLang's storage threads but a miss or a dropped save."""
        store, pages = self._store, self._pages
        if store is None or pages is None:
            return miss
        try:
            return action(store, pages)
        except Exception:
            log.exception("kvshare HiCache %s failed; serving a miss", what)
            return miss


def _digests(keys: Sequence[str]) -> list[bytes]:
    return [page_digest(key) for key in keys]


def _flag(extra: Mapping[str, Any], key: str, *, default: bool) -> bool:
    value = extra.get(key, default)
    if not isinstance(value, bool):
        raise ConfigError(f"{SOURCE}: {key} must be true or false")
    return value
