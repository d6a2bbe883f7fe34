"""`KVShareConnector`: kvshare as a vLLM v1 KV-transfer connector (docs/design.md §7).

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVShareConnector",
      "kv_connector_module_path": "replica_agent.adapters.vllm", "kv_role": "kv_both",
      "kv_connector_extra_config": {"target": "HOST:PORT", "token_file": "PATH",
                                    "tenant": "ID", "keyring_file": "PATH"}}'

vLLM builds one instance in its scheduler and one in each worker. The scheduler side
(`replica_agent.adapters.vllm_plan`) hashes prompts with kvshare's digest chain, asks
the store once per request how many leading blocks it holds, and puts the step's load
and save plans in the connector metadata. The worker side (`vllm_store`) fills vLLM's
paged cache from the store and copies new blocks out after each forward pass for the
write-behind saver; a block that fails to open or decode is reported through
`get_block_ids_with_load_errors` and recomputed by vLLM. The store down or slow opens
a breaker: requests are served by recompute, none fails.

Who waits for a load is chosen per request (`"load_mode": "auto"`, the default;
`vllm_modes`): with other requests in the batch the load is asynchronous (vLLM keeps
the loading request out of the batch while a worker thread, `vllm_loader`, places its
blocks, and `get_finished` reports it, so a slow store never stalls the requests
already decoding); with none, it runs before the forward pass of the step that
schedules the request, which then starts at once. `"async"` and `"sync"` force one.
Saves cover the model's output too (`"save_generated"`, default true): the next turn of
a conversation, whose prompt holds the answer, finds those blocks on any replica.
Public prefixes (`"public_prefixes"`, default true; replica_agent.public): the scheduler
holds the public catalogue of its namespace, and a request's leading blocks listed
there are read from `@public` (opened with the public scope's key), the rest from its
tenant; saves go to the tenant only, after the public blocks.

This module imports vLLM; nothing else in kvshare imports it, so the agent installs and
runs without vLLM. Its configuration is read in `vllm_options`; block namespace
(`engine_spec`): the served model (or the `model` key), its revision, dtype, layers, KV
heads, head dim, store block size and tensor-parallel rank/size, so blocks of different
layouts never mix.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcommon.errors import ConfigError
from replica_agent.adapters.settings import parse_store_settings
from replica_agent.adapters.vllm_layout import backend_page_layout
from replica_agent.adapters.vllm_loader import AsyncLoader
from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.adapters.vllm_modes import SYNC
from replica_agent.adapters.vllm_options import (
    ENGINE_KEYS,
    engine_spec,
    parse_vllm_options,
    request_tenant,
    store_block_tokens,
)
from replica_agent.adapters.vllm_plan import NewStep, RequestKey, RunningStep, SchedulerPlanner
from replica_agent.adapters.vllm_store import PagedCache, WorkerStore
from replica_agent.adapters.vllm_trace import LoadTimeline
from replica_agent.breaker import CircuitBreaker
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.public import PUBLIC_SCOPE, PublicCatalogue
from replica_agent.telemetry import AgentTelemetry

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)
SOURCE = "kv_connector_extra_config"
# How long a step with no forward pass waits for the loader thread (it has nothing
# else to do, and the thread gets the interpreter's lock meanwhile). Bounded, since
# the engine takes new requests only between steps: an arrival waits this long at most.
IDLE_STEP_WAIT_S = 0.02
_LAYER_INDEX = re.compile(r"\d+")


@dataclass
class KVShareMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """Scheduler -> workers, once per step: what to load before and save after it."""

    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)
    cancelled: list[str] = field(default_factory=list)  # finished: skip their queued loads
    has_forward: bool = True  # the step runs a forward pass (else only connector work)


class KVShareConnector(KVConnectorBase_V1):  # type: ignore[misc]
    def __init__(
        self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None
    ) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        raw = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.settings = parse_store_settings(raw, source=SOURCE, engine_keys=ENGINE_KEYS)
        self.options = parse_vllm_options(raw, source=SOURCE)
        self.vllm_block_tokens = int(vllm_config.cache_config.block_size)
        self.block_tokens = store_block_tokens(self.vllm_block_tokens, self.options.block_tokens)
        self.spec = engine_spec(
            vllm_config,
            self.settings.model,
            self.block_tokens,
            weight_version=self.settings.weight_version,
        )
        self.namespace = self.spec.wire_model()  # the chain's model; rank 0's store namespace
        self.stats = StoreStats()
        self._sealer = self.settings.sealer()
        self._gate = StoreGate(CircuitBreaker(), AgentTelemetry(), self.stats)
        self._client = self.settings.connect()
        self._planner: SchedulerPlanner | None = None
        self._store: WorkerStore | None = None
        self._cache: PagedCache | None = None
        self._load_errors: set[int] = set()
        self._loader: AsyncLoader | None = None
        self._loaded_early: set[str] = set()  # async loads with no cache to fill: done
        self.timeline = LoadTimeline()  # this side's marks (vllm_trace)
        if role == KVConnectorRole.SCHEDULER:
            # What `kvshare admin delete-model --namespace` takes (rank 0's name).
            log.info("KVShareConnector: store namespace %s", self.namespace)
            self._adopt_recompute_policy()
            catalogue = self._public_catalogue()
            self._planner = SchedulerPlanner(
                self.namespace,
                self.block_tokens,
                self.vllm_block_tokens,
                self._lookup,
                catalogue.digests if catalogue is not None else None,
                self.options.load_mode,
            )

    def _public_catalogue(self) -> PublicCatalogue | None:
        """The public scope's catalogue of this namespace (`"public_prefixes"`), read
        through this side's gate; None when off, or when blocks are sealed and the
        keyring has no key for the public scope (nothing there could be opened)."""
        if not self.options.public_prefixes:
            return None
        if self._sealer is not None and PUBLIC_SCOPE not in self._sealer.keyring.tenants():
            log.info(
                "KVShareConnector: public prefixes off: the keyring has no key for the "
                "public scope (kvshare admin keyring --public)"
            )
            return None
        # Rank 0's namespace: the chain's model and where the publisher lists the digests.
        return PublicCatalogue(self._client, self._gate, self.namespace, sealer=self._sealer)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a save that never happens is a future miss, nothing more

    def _adopt_recompute_policy(self) -> None:
        """A block that fails to load must be recomputed, never fail its request: vLLM's
        default policy is "fail", so the connector sets "recompute" (read by the scheduler
        right after it builds the connector) unless the deployer set it already."""
        config = self._kv_transfer_config
        if getattr(config, "kv_load_failure_policy", "recompute") != "recompute":
            log.info("KVShareConnector: kv_load_failure_policy set to 'recompute'")
            config.kv_load_failure_policy = "recompute"

    # -- scheduler side -------------------------------------------------------------------

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int, bool]:
        assert self._planner is not None
        request_id = request.request_id
        tokens = self._planner.new_matched_tokens(
            request_id, num_computed_tokens, lambda: self._request_key(request), request
        )
        is_async = tokens > 0 and self._planner.is_load_async(request_id)
        if tokens > 0:
            self.timeline.mark(request_id, "looked_up")
            self.timeline.mark(request_id, "async" if is_async else "sync")
        return tokens, is_async

    def _request_key(self, request: Any) -> RequestKey | None:
        tenant = request_tenant(
            request.kv_transfer_params,
            self.settings.tenant,
            require_request_tenant=self.options.require_request_tenant,
        )
        if tenant is None or request.prompt_token_ids is None or request.mm_features:
            return None  # no tenant; prompt embeddings or media: not hashable from tokens
        if self._sealer is not None and tenant not in self._sealer.keyring.tenants():
            log.warning("no data key for a request's tenant in the keyring; it skips the cache")
            return None
        salt = request.cache_salt.encode("utf-8") if request.cache_salt else b""
        lora = request.lora_request.lora_name if request.lora_request is not None else None
        # vLLM appends each sampled token to this list: saves of the output read it live.
        live = request.all_token_ids if self.options.save_generated else None
        return RequestKey(tenant, request.prompt_token_ids, salt, lora, live)

    def _lookup(self, tenant: str, digests: Any) -> int:
        return self._gate.leading(self._client, tenant, self.namespace, digests)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        is_async = num_external_tokens > 0 and self._planner.is_load_async(request.request_id)
        if num_external_tokens > 0:
            self.timeline.mark(request.request_id, "allocated")
        block_ids = blocks.get_block_ids()[0] if is_async else ()
        self._planner.after_alloc(
            request.request_id, num_external_tokens, block_ids, is_async=is_async
        )

    def build_connector_meta(self, scheduler_output: Any) -> KVShareMetadata:
        assert self._planner is not None
        scheduled = scheduler_output.num_scheduled_tokens
        new = [
            NewStep(r.req_id, r.block_ids[0], r.num_computed_tokens, scheduled[r.req_id])
            for r in scheduler_output.scheduled_new_reqs
        ]
        cached = scheduler_output.scheduled_cached_reqs
        running = [
            RunningStep(
                req_id,
                cached.new_block_ids[i][0] if cached.new_block_ids[i] is not None else None,
                req_id in cached.resumed_req_ids,
                cached.num_computed_tokens[i],
                scheduled[req_id],
            )
            for i, req_id in enumerate(cached.req_ids)
        ]
        loads, saves = self._planner.build(new, running)
        for step in new:
            self.timeline.mark_known(step.request_id, "scheduled")
        return KVShareMetadata(
            loads,
            saves,
            self._planner.take_cancelled(),
            scheduler_output.total_num_scheduled_tokens > 0,
        )

    def update_connector_output(self, connector_output: Any) -> None:
        if self._planner is not None:
            self._planner.loads_reported(connector_output.finished_recving or ())

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, None]:
        if self._planner is not None:
            self._planner.finished(request.request_id)
        return False, None  # saves copy their blocks out first: vLLM may free them now

    @property
    def tracked_requests(self) -> int:
        return self._planner.tracked_requests if self._planner is not None else 0

    # -- worker side ----------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = sorted(kv_caches, key=lambda n: [int(x) for x in _LAYER_INDEX.findall(n)])
        if len(names) != self.spec.num_layers:
            raise ConfigError(
                f"vLLM registered {len(names)} KV cache layers; the model has "
                f"{self.spec.num_layers}: models that share or skip KV layers are not supported"
            )
        first = kv_caches[names[0]]
        layer = self._vllm_config.compilation_config.static_forward_context.get(names[0])
        layout = backend_page_layout(
            first, layer, num_kv_heads=self.spec.num_kv_heads, head_dim=self.spec.head_dim
        )
        if any(kv_caches[n].shape != first.shape for n in names):
            raise ConfigError("KV cache layers differ in shape; not supported by KVShareConnector")
        if self.vllm_block_tokens % layout.block_tokens:
            raise ConfigError(
                f"vLLM's block size {self.vllm_block_tokens} is not a multiple of the "
                f"attention kernel's {layout.block_tokens}"
            )
        self._cache = PagedCache(tuple(kv_caches[n] for n in names), layout, self.vllm_block_tokens)
        spec = engine_spec(
            self._vllm_config,
            self.settings.model,
            self.block_tokens,
            self._tp_rank(),
            weight_version=self.settings.weight_version,
        )
        self._store = WorkerStore(
            self._client,
            spec,
            sealer=self._sealer,
            gate=self._gate,
            save_queue_bytes=self.options.save_queue_bytes,
        )
        if self.options.load_mode != SYNC:
            store, cache = self._store, self._cache
            self._loader = AsyncLoader(
                lambda plan: store.load(cache, plan), cache.device, self.timeline
            )

    @staticmethod
    def _tp_rank() -> int:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """A synchronous plan's blocks are in the cache (or reported) on return; an
        asynchronous plan is queued for the loader thread, reported by `get_finished`."""
        metadata = self._get_connector_metadata()
        if not isinstance(metadata, KVShareMetadata):
            return
        store, cache, loader = self._store, self._cache, self._loader
        for plan in metadata.loads:
            if store is None or cache is None or (plan.is_async and loader is None):
                self._load_errors.update(plan.block_ids)  # nothing to fill: vLLM recomputes
                if plan.is_async:
                    self._loaded_early.add(plan.request_id)
            elif plan.is_async and loader is not None:
                loader.submit(plan)
            else:
                self.timeline.mark(plan.request_id, "load_started")
                self._load_errors.update(store.load(cache, plan))
                self.timeline.mark(plan.request_id, "load_finished")
        if loader is not None and metadata.cancelled:
            loader.cancel(metadata.cancelled)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._loaded_early = self._loaded_early, set()
        if self._loader is not None:
            metadata = self._get_connector_metadata()
            if isinstance(metadata, KVShareMetadata) and not metadata.has_forward:
                self._loader.wait_settled(IDLE_STEP_WAIT_S)
            done |= self._loader.take_finished()
        for request_id in done:
            self.timeline.mark(request_id, "reported")
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Nothing to wait for: a synchronous load is complete before the forward pass, and
        # an asynchronous one keeps its request out of the batch until it is complete.
        return

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # blocks are copied out once per step, in wait_for_save

    def wait_for_save(self) -> None:
        metadata = self._get_connector_metadata()
        if self._store is None or self._cache is None or not isinstance(metadata, KVShareMetadata):
            return
        for plan in metadata.saves:
            try:
                self._store.save(self._cache, plan)
            except Exception:  # a bug in the copy must not fail the step: the save is dropped
                log.exception("copying blocks out for a save failed; dropped")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if self._loader is not None:
            errors |= self._loader.take_failed_block_ids()
        return errors

    def shutdown(self) -> None:
        if self._loader is not None:
            self._loader.close(self.options.flush_timeout_s)
            self._loader = None
        if self._store is not None:
            self._store.close(self.options.flush_timeout_s)
            self._store = None
        else:
            self._client.close()
