"""The public-prefix workload: T tenants share one framework prompt, with and without `@public`.

Every request of tenant t in conversation c at turn k is, in order: the public framework
prompt P (identical for all tenants), t's system prompt S_t, then turns 0..k of c. It is
generated (no trace), seeded, and replayed twice over the same replicas, policy and
shared store:

- **without the public scope** every block is keyed per tenant, P's blocks included:
  the store holds one copy of P per tenant, and a tenant computes P on its first
  request even when another tenant just did;
- **with the public scope** the blocks lying wholly inside P are keyed once, in
  `@public`, and a publisher puts them in the store before the first request; the
  block that straddles the end of P and everything after it stay keyed per tenant.

Invariants the comparison rests on:

- a block's id stands for its scope and the whole prefix up to the block's last token,
  so equal ids mean equal KV (the engine's prefix-chain semantics), and a partial last
  block never shares an id with a longer block at its position;
- the two runs issue the same requests (same tokens, order and arrivals); only the
  ids of P's whole blocks differ, so every private (per-tenant) block is the same in
  both runs and the private blocks stored are equal;
- the store is unbounded, so stored blocks are every distinct block written (plus
  those published) and stored bytes are blocks x block_tokens x KV bytes per token
  (a paged KV block is allocated whole, a partial last block included).
"""

from __future__ import annotations

import random
from collections.abc import Hashable
from dataclasses import dataclass

from kvshare.simulate.engine import SimConfig, SimResult, simulate
from kvshare.simulate.policies import PolicyParams
from kvshare.simulate.timing import TimeModel
from kvshare.simulate.trace import Request

PUBLIC_SCOPE = "@public"
ARRIVAL_INTERVAL_S = 0.1  # one request every 100 ms: 10 requests/s over the pool


@dataclass(frozen=True)
class PublicPrefixWorkload:
    """The shape of the traffic: who sends what, and how long each part is."""

    tenants: int = 8
    public_tokens: int = 2_000
    system_tokens: int = 500
    conversations: int = 4  # per tenant
    turns: int = 4  # per conversation
    turn_tokens: int = 200  # mean; each turn draws uniformly from [1/2, 3/2] of it
    seed: int = 0


@dataclass(frozen=True)
class WorkloadTrace:
    """One run's requests, the ids of P's whole blocks in them, and what is pre-published."""

    requests: tuple[Request, ...]
    public_prefix_block_ids: frozenset[int]
    published_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class PublicPrefixRun:
    """One replay and how the store's blocks split between P and the private chains."""

    result: SimResult
    public_prefix_blocks: int  # distinct blocks wholly inside P, published ones included
    published_blocks: int  # put in the store by the publisher before the first request
    block_bytes: int

    @property
    def private_blocks(self) -> int:
        return self.result.store_blocks - self.public_prefix_blocks

    @property
    def stored_bytes(self) -> int:
        return self.result.store_blocks * self.block_bytes


@dataclass(frozen=True)
class PublicPrefixComparison:
    """The same workload without and with the public scope."""

    workload: PublicPrefixWorkload
    without_public: PublicPrefixRun
    with_public: PublicPrefixRun

    @property
    def stored_bytes_ratio(self) -> float:
        """Stored bytes with the public scope over stored bytes without it."""
        return _ratio(self.with_public.stored_bytes, self.without_public.stored_bytes)

    @property
    def prefill_tokens_ratio(self) -> float:
        """Prefill tokens with the public scope over prefill tokens without it."""
        return _ratio(
            self.with_public.result.prefill_tokens, self.without_public.result.prefill_tokens
        )


def _ratio(part: int, whole: int) -> float:
    return part / whole if whole else 1.0


class _BlockIds:
    """Dense ints for block keys, given in order of first use (so runs are reproducible)."""

    def __init__(self) -> None:
        self._ids: dict[Hashable, int] = {}

    def __call__(self, key: Hashable) -> int:
        return self._ids.setdefault(key, len(self._ids))


def turn_lengths(workload: PublicPrefixWorkload) -> dict[tuple[int, int], tuple[int, ...]]:
    """Each (tenant, conversation)'s turn lengths in tokens, drawn from the seed."""
    rng = random.Random(workload.seed)
    low = max(1, workload.turn_tokens // 2)
    high = max(low, workload.turn_tokens * 3 // 2)
    return {
        (tenant, conversation): tuple(rng.randint(low, high) for _ in range(workload.turns))
        for tenant in range(workload.tenants)
        for conversation in range(workload.conversations)
    }


def arrival_order(workload: PublicPrefixWorkload) -> list[tuple[int, int, int]]:
    """(tenant, conversation, turn) in arrival order: conversations interleave at random,
    each conversation's turns stay in order. O(1) per request."""
    rng = random.Random(workload.seed + 1)
    open_sessions = [
        (tenant, conversation)
        for tenant in range(workload.tenants)
        for conversation in range(workload.conversations)
    ]
    next_turn = dict.fromkeys(open_sessions, 0)
    order = []
    while open_sessions:
        index = rng.randrange(len(open_sessions))
        session = open_sessions[index]
        order.append((*session, next_turn[session]))
        next_turn[session] += 1
        if next_turn[session] == workload.turns:
            open_sessions[index] = open_sessions[-1]
            open_sessions.pop()
    return order


def build_trace(
    workload: PublicPrefixWorkload, block_tokens: int, public_scope: bool
) -> WorkloadTrace:
    """The requests of one run; `public_scope` keys P's whole blocks in `@public`."""
    lengths = turn_lengths(workload)
    block_ids = _BlockIds()
    public_ids: set[int] = set()
    requests = []
    for index, (tenant, conversation, turn) in enumerate(arrival_order(workload)):
        history = sum(lengths[tenant, conversation][: turn + 1])
        input_tokens = workload.public_tokens + workload.system_tokens + history
        ids = []
        for end in _block_ends(input_tokens, block_tokens):
            key = _block_key(workload, tenant, conversation, end, public_scope)
            ids.append(block_ids(key))
            if end <= workload.public_tokens:
                public_ids.add(ids[-1])
        requests.append(Request(index * ARRIVAL_INTERVAL_S, input_tokens, 0, tuple(ids)))
    published: tuple[int, ...] = ()
    if public_scope:
        whole_public = workload.public_tokens // block_tokens
        published = tuple(
            block_ids((PUBLIC_SCOPE, (b + 1) * block_tokens)) for b in range(whole_public)
        )
        public_ids.update(published)
    return WorkloadTrace(tuple(requests), frozenset(public_ids), published)


def _block_ends(input_tokens: int, block_tokens: int) -> list[int]:
    """The end token (exclusive) of each block of a prompt; the last block may be partial."""
    return [
        min(start + block_tokens, input_tokens) for start in range(0, input_tokens, block_tokens)
    ]


def _block_key(
    workload: PublicPrefixWorkload, tenant: int, conversation: int, end: int, public_scope: bool
) -> Hashable:
    """Scope and prefix identity of the block ending at token `end`.

    The prefix up to `end` is P alone, P + part of S_t, or P + S_t + part of the
    conversation: the part `end` falls in names it. Only a block wholly in P is the
    same text for every tenant, and only the public scope lets tenants share it.
    """
    if end <= workload.public_tokens:
        return (PUBLIC_SCOPE, end) if public_scope else (tenant, "public", end)
    if end <= workload.public_tokens + workload.system_tokens:
        return (tenant, "system", end)
    return (tenant, "conversation", conversation, end)


def run_comparison(
    workload: PublicPrefixWorkload,
    *,
    replicas: int,
    policy: str,
    block_tokens: int,
    replica_capacity_blocks: int | None,
    time_model: TimeModel,
    policy_params: PolicyParams | None = None,
) -> PublicPrefixComparison:
    """Replay the workload without, then with, the public scope over an unbounded store."""
    config = SimConfig(
        policy=policy,
        replicas=replicas,
        shared_store=True,
        block_tokens=block_tokens,
        replica_capacity_blocks=replica_capacity_blocks,
        store_capacity_blocks=None,
        time_model=time_model,
        policy_params=policy_params or PolicyParams(),
        seed=workload.seed,
    )
    block_bytes = block_tokens * time_model.kv_bytes_per_token
    runs = [
        _run(build_trace(workload, block_tokens, public_scope), config, block_bytes)
        for public_scope in (False, True)
    ]
    return PublicPrefixComparison(workload, without_public=runs[0], with_public=runs[1])


def _run(trace: WorkloadTrace, config: SimConfig, block_bytes: int) -> PublicPrefixRun:
    result = simulate(trace.requests, config, trace.published_block_ids)
    return PublicPrefixRun(
        result,
        public_prefix_blocks=len(trace.public_prefix_block_ids),
        published_blocks=len(trace.published_block_ids),
        block_bytes=block_bytes,
    )
