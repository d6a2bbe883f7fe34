"""Routing policies: which active replica serves the next request.

Each policy sees the request and the `Cluster` (active replicas, their caches and
queues) and returns a replica id; none of them changes a cache. They are the four a
platform team picks from in practice:

- `round_robin`: what a standard L4/L7 balancer does; blind to prefixes.
- `random`: seeded uniform choice; the other prefix-blind baseline.
- `prefix_affinity`: consistent hashing on the leading block(s) with bounded loads
  (Mirrokni, Thorup, Zadimoghaddam 2018; HAProxy `hash-balance-factor`).
- `cache_aware`: longest local prefix match with a load-balance guard, after SGLang's
  cache-aware router.
"""

from __future__ import annotations

import bisect
import hashlib
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from kvshare.simulate.caches import reused_tokens
from kvshare.simulate.cluster import Cluster
from kvshare.simulate.errors import SimulateInputError
from kvshare.simulate.trace import Request


@dataclass(frozen=True)
class PolicyParams:
    """Tuning of the prefix-aware policies; the defaults are the cited ones."""

    affinity_key_blocks: int = 1
    # 1 + epsilon of "consistent hashing with bounded loads": no replica takes more than
    # 25% above the mean, the bound the study holds prefix affinity to.
    affinity_load_factor: float = 1.25
    # Virtual nodes per replica: enough that the ring splits keys within a few percent.
    affinity_virtual_nodes: int = 64
    # SGLang router / SMG defaults (--cache-threshold, --balance-abs-threshold,
    # --balance-rel-threshold).
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5


class RoutingPolicy(Protocol):
    """Picks the replica for a request; must return an id from `cluster.active`."""

    def choose(self, request: Request, cluster: Cluster, now_s: float) -> int: ...


class RoundRobin:
    """The i-th request goes to the (i mod n)-th active replica, whatever its prefix."""

    def __init__(self) -> None:
        self._next = 0

    def choose(self, request: Request, cluster: Cluster, now_s: float) -> int:
        active = cluster.active
        replica_id = active[self._next % len(active)]
        self._next += 1
        return replica_id


class RandomChoice:
    """A uniformly random active replica from a seeded generator, so runs repeat."""

    def __init__(self, seed: int) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: Request, cluster: Cluster, now_s: float) -> int:
        return self._rng.choice(cluster.active)


def _ring_point(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class PrefixAffinity:
    """Consistent hashing of the leading block(s), with bounded loads.

    The key (the first `affinity_key_blocks` block ids) picks a point on a ring of
    virtual nodes; the request goes to the first replica clockwise whose routed input
    tokens would stay within `affinity_load_factor` x the mean. A hot prefix therefore
    spills to the *same* next replicas each time, keeping what locality the bound
    allows, and max/mean routed tokens stays within the factor. Loads count from the
    last change of membership: a replica that joins is not flooded to make up for the
    others' history, and one that was idle before a change cannot take a burst on the
    strength of it.
    """

    def __init__(self, params: PolicyParams) -> None:
        self._params = params
        self._ring_members: tuple[int, ...] = ()
        self._ring_points: list[int] = []
        self._ring_owners: list[int] = []
        self._loads: dict[int, float] = {}
        self._total_load = 0.0

    def choose(self, request: Request, cluster: Cluster, now_s: float) -> int:
        self._sync_members(cluster.active)
        tokens = request.input_tokens
        bound = self._params.affinity_load_factor * (self._total_load + tokens) / len(self._loads)
        key = ",".join(map(str, request.block_ids[: self._params.affinity_key_blocks]))
        start = bisect.bisect(self._ring_points, _ring_point(key.encode()))
        candidates = list(self._walk(start))
        # Nobody fits only while the pool is nearly empty (a first request exceeds any
        # bound); the least loaded in ring order then keeps what affinity it can.
        chosen = next(
            (rid for rid in candidates if self._loads[rid] + tokens <= bound),
            min(candidates, key=self._loads.__getitem__),
        )
        self._loads[chosen] += tokens
        self._total_load += tokens
        return chosen

    def _walk(self, start: int) -> Iterator[int]:
        """Distinct replicas in ring order from position `start`."""
        seen: set[int] = set()
        owners = self._ring_owners
        for offset in range(len(owners)):
            owner = owners[(start + offset) % len(owners)]
            if owner not in seen:
                seen.add(owner)
                yield owner
                if len(seen) == len(self._loads):
                    return

    def _sync_members(self, active: Sequence[int]) -> None:
        if tuple(active) == self._ring_members:
            return
        members = tuple(active)
        self._loads = dict.fromkeys(members, 0.0)
        self._total_load = 0.0
        points = sorted(
            (_ring_point(f"replica-{rid}-vnode-{vnode}".encode()), rid)
            for rid in members
            for vnode in range(self._params.affinity_virtual_nodes)
        )
        self._ring_points = [point for point, _ in points]
        self._ring_owners = [rid for _, rid in points]
        self._ring_members = members


class CacheAware:
    """Longest local prefix match, unless the pool is out of balance (SGLang's router).

    If the busiest replica has more than `balance_abs_threshold` requests in flight
    above the idlest *and* more than `balance_rel_threshold` times as many, the idlest
    replica gets the request. Otherwise the replica with the longest cached prefix gets
    it when that prefix covers more than `cache_threshold` of the prompt, and the
    replica holding the fewest blocks (the most room) gets it when none does — ties,
    which are the rule once bounded caches fill up, go to the fewest requests in
    flight, then the fewest tokens routed. SGLang matches against its own approximate
    radix tree of what it routed; this reads the replicas' true caches, the tree's best
    case.
    """

    def __init__(self, params: PolicyParams) -> None:
        self._params = params

    def choose(self, request: Request, cluster: Cluster, now_s: float) -> int:
        active = cluster.active
        replicas = cluster.replicas
        loads = {rid: replicas[rid].queue.outstanding(now_s) for rid in active}
        busiest, idlest = max(loads.values()), min(loads.values())
        params = self._params
        if (
            busiest - idlest > params.balance_abs_threshold
            and busiest > params.balance_rel_threshold * idlest
        ):
            return min(active, key=lambda rid: (loads[rid], rid))
        hits = {rid: replicas[rid].cache.leading_hits(request.block_ids) for rid in active}
        best = min(active, key=lambda rid: (-hits[rid], loads[rid], rid))
        matched_tokens = reused_tokens(hits[best], cluster.block_tokens, request.input_tokens)
        if matched_tokens > params.cache_threshold * request.input_tokens:
            return best
        return min(
            active,
            key=lambda rid: (len(replicas[rid].cache), loads[rid], replicas[rid].routed_tokens),
        )


POLICY_NAMES: tuple[str, ...] = ("round_robin", "random", "prefix_affinity", "cache_aware")


def make_policy(name: str, params: PolicyParams, seed: int) -> RoutingPolicy:
    """A fresh policy (no state carried between configurations)."""
    if name == "round_robin":
        return RoundRobin()
    if name == "random":
        return RandomChoice(seed)
    if name == "prefix_affinity":
        return PrefixAffinity(params)
    if name == "cache_aware":
        return CacheAware(params)
    raise SimulateInputError(
        f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)} (comma-separated)"
    )
