"""Replay one configuration (policy x replicas x store) over a trace.

Hit-rate semantics are the docs/design.md §8 contract, so results compare across tools:
requests are served in trace order; a request reuses min(k x block_tokens,
input_tokens) tokens where k is its number of leading blocks found in the serving
replica's local cache or, with the store enabled, in the store — the larger; after
serving, all of its blocks go into that local cache and into the store. The local
share of the reuse is what the local cache alone covers; the store share is the rest.
The time model (`timing`) runs alongside and never changes what is hit.

A replay may start with blocks already in the store (`published_block_ids`: what a
publisher put there before any request, e.g. a public prefix); they count as stored
but not as any request's input or prefill.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvshare.simulate.caches import BlockCache, UnboundedBlockCache, make_block_cache, reused_tokens
from kvshare.simulate.cluster import Cluster, Replica
from kvshare.simulate.policies import PolicyParams, make_policy
from kvshare.simulate.scenarios import ScalingEvent, plan_replicas
from kvshare.simulate.timing import TimeModel, percentile
from kvshare.simulate.trace import Request


@dataclass(frozen=True)
class SimConfig:
    """Everything one replay depends on; capacities of None mean unbounded."""

    policy: str
    replicas: int
    shared_store: bool
    block_tokens: int
    replica_capacity_blocks: int | None
    store_capacity_blocks: int | None
    time_model: TimeModel
    policy_params: PolicyParams = field(default_factory=PolicyParams)
    scenario: str = "static"
    seed: int = 0


@dataclass(frozen=True)
class SimResult:
    """Counters of one replay; rates are token-weighted over the whole trace."""

    config: SimConfig
    requests: int
    input_tokens: int
    local_hit_tokens: int
    store_hit_tokens: int
    ttft_p50_s: float
    ttft_p99_s: float
    prefill_gpu_s: float
    restore_s: float
    load_imbalance: float
    replicas_started: int
    store_blocks: int = 0  # distinct blocks the store holds at the end; 0 without a store

    @property
    def reused_tokens(self) -> int:
        return self.local_hit_tokens + self.store_hit_tokens

    @property
    def prefill_tokens(self) -> int:
        return self.input_tokens - self.reused_tokens

    @property
    def token_hit_rate(self) -> float:
        return _rate(self.reused_tokens, self.input_tokens)

    @property
    def local_hit_rate(self) -> float:
        return _rate(self.local_hit_tokens, self.input_tokens)

    @property
    def store_hit_rate(self) -> float:
        return _rate(self.store_hit_tokens, self.input_tokens)


def _rate(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


@dataclass
class _Tally:
    input_tokens: int = 0
    local_hit_tokens: int = 0
    store_hit_tokens: int = 0
    prefill_gpu_s: float = 0.0
    restore_s: float = 0.0
    ttfts_s: list[float] = field(default_factory=list)


def simulate(
    requests: Sequence[Request],
    config: SimConfig,
    published_block_ids: Sequence[int] = (),
) -> SimResult:
    """Replay `requests` in order under `config` and return its counters.

    `published_block_ids` go into the store before the first request; they need the
    store (`config.shared_store`), and local caches still start cold.
    """
    if published_block_ids and not config.shared_store:
        raise ValueError("published_block_ids need a shared store (config.shared_store)")
    start_s = min((r.arrival_s for r in requests), default=0.0)
    end_s = max((r.arrival_s for r in requests), default=0.0)
    plan = plan_replicas(config.scenario, config.replicas, start_s, end_s)
    cluster = Cluster(config.replica_capacity_blocks, config.block_tokens)
    for _ in range(plan.initial_replicas):
        cluster.add_replica()
    store = make_block_cache(config.store_capacity_blocks) if config.shared_store else None
    if store is not None:
        store.insert(published_block_ids)
    policy = make_policy(config.policy, config.policy_params, config.seed)
    events = plan.events
    next_event = 0
    tally = _Tally()
    for request in requests:
        while next_event < len(events) and events[next_event].at_s <= request.arrival_s:
            _apply_event(cluster, events[next_event])
            next_event += 1
        replica_id = policy.choose(request, cluster, request.arrival_s)
        cluster.record_routing(replica_id, request.input_tokens)
        _serve(request, cluster.replicas[replica_id], store, config, tally)
    ttfts_s = sorted(tally.ttfts_s)
    return SimResult(
        config=config,
        requests=len(requests),
        input_tokens=tally.input_tokens,
        local_hit_tokens=tally.local_hit_tokens,
        store_hit_tokens=tally.store_hit_tokens,
        ttft_p50_s=percentile(ttfts_s, 0.50),
        ttft_p99_s=percentile(ttfts_s, 0.99),
        prefill_gpu_s=tally.prefill_gpu_s,
        restore_s=tally.restore_s,
        load_imbalance=cluster.load_imbalance(),
        replicas_started=len(cluster.replicas),
        store_blocks=0 if store is None else len(store),
    )


def _apply_event(cluster: Cluster, event: ScalingEvent) -> None:
    for _ in range(event.leaves):
        victim = cluster.active[0] if event.leave_oldest else cluster.active[-1]
        cluster.remove_replica(victim)
    for _ in range(event.joins):
        cluster.add_replica()


def _serve(
    request: Request,
    replica: Replica,
    store: BlockCache | None,
    config: SimConfig,
    tally: _Tally,
) -> None:
    block_ids = request.block_ids
    input_tokens = request.input_tokens
    local_blocks = replica.cache.leading_hits(block_ids)
    store_blocks = store.leading_hits(block_ids) if store is not None else 0
    local_tokens = reused_tokens(local_blocks, config.block_tokens, input_tokens)
    reused = reused_tokens(max(local_blocks, store_blocks), config.block_tokens, input_tokens)
    store_tokens = reused - local_tokens
    restore_s = config.time_model.restore_s(store_tokens)
    prefill_s = config.time_model.prefill_s(input_tokens - reused)
    finish_s = replica.queue.serve(request.arrival_s, restore_s + prefill_s)
    replica.cache.insert(block_ids)
    if store is not None:
        store.insert(block_ids)
    tally.input_tokens += input_tokens
    tally.local_hit_tokens += local_tokens
    tally.store_hit_tokens += store_tokens
    tally.prefill_gpu_s += prefill_s
    tally.restore_s += restore_s
    tally.ttfts_s.append(finish_s - request.arrival_s)


def ideal_token_hit_rate(requests: Sequence[Request], block_tokens: int) -> float:
    """The contract's ideal: the same replay through one unbounded cache."""
    cache = UnboundedBlockCache()
    input_tokens = reused = 0
    for request in requests:
        hits = cache.leading_hits(request.block_ids)
        reused += reused_tokens(hits, block_tokens, request.input_tokens)
        input_tokens += request.input_tokens
        cache.insert(request.block_ids)
    return _rate(reused, input_tokens)
