"""Routing policies, each on a hand-built cluster."""

from __future__ import annotations

from collections import Counter

from kvshare.simulate.cluster import Cluster
from kvshare.simulate.policies import (
    CacheAware,
    PolicyParams,
    PrefixAffinity,
    RandomChoice,
    RoundRobin,
)
from kvshare.simulate.trace import Request

BLOCK_TOKENS = 4


def _cluster(replicas: int) -> Cluster:
    cluster = Cluster(replica_capacity_blocks=None, block_tokens=BLOCK_TOKENS)
    for _ in range(replicas):
        cluster.add_replica()
    return cluster


def _request(block_ids: tuple[int, ...], input_tokens: int | None = None) -> Request:
    tokens = len(block_ids) * BLOCK_TOKENS if input_tokens is None else input_tokens
    return Request(0.0, tokens, 0, block_ids)


def test_round_robin_cycles_over_active_replicas_in_join_order() -> None:
    cluster = _cluster(3)
    policy = RoundRobin()
    picks = [policy.choose(_request((1,)), cluster, 0.0) for _ in range(4)]
    assert picks == [0, 1, 2, 0]
    cluster.remove_replica(1)
    cluster.add_replica()  # id 3; active is now [0, 2, 3]
    picks = [policy.choose(_request((1,)), cluster, 0.0) for _ in range(3)]
    assert picks == [2, 3, 0]  # counter 4, 5, 6 over three replicas: index 1, 2, 0


def test_random_is_seeded_and_covers_the_pool() -> None:
    cluster = _cluster(4)
    policy_a, policy_b, policy_c = RandomChoice(7), RandomChoice(7), RandomChoice(8)
    picks_a = [policy_a.choose(_request((1,)), cluster, 0.0) for _ in range(200)]
    picks_b = [policy_b.choose(_request((1,)), cluster, 0.0) for _ in range(200)]
    picks_c = [policy_c.choose(_request((1,)), cluster, 0.0) for _ in range(200)]
    assert picks_a == picks_b
    assert picks_a != picks_c
    assert set(picks_a) == {0, 1, 2, 3}


def test_prefix_affinity_sends_a_key_to_one_replica_while_loads_allow() -> None:
    cluster = _cluster(4)
    policy = PrefixAffinity(PolicyParams(affinity_load_factor=100.0))
    owners = {key: policy.choose(_request((key, 99)), cluster, 0.0) for key in range(40)}
    again = {key: policy.choose(_request((key, 98)), cluster, 0.0) for key in range(40)}
    assert owners == again  # only the leading block is the key
    assert len(set(owners.values())) == 4


def test_prefix_affinity_is_consistent_when_a_replica_leaves() -> None:
    cluster = _cluster(3)
    policy = PrefixAffinity(PolicyParams(affinity_load_factor=100.0))
    before = {key: policy.choose(_request((key,)), cluster, 0.0) for key in range(60)}
    cluster.remove_replica(2)
    after = {key: policy.choose(_request((key,)), cluster, 1.0) for key in range(60)}
    assert all(after[key] == owner for key, owner in before.items() if owner != 2)
    assert set(after.values()) == {0, 1}


def test_prefix_affinity_bounds_a_hot_key_and_spills_in_ring_order() -> None:
    cluster = _cluster(4)
    policy = PrefixAffinity(PolicyParams(affinity_load_factor=1.25))
    loads: Counter[int] = Counter()
    picks = []
    for _ in range(400):
        replica_id = policy.choose(_request((5,), input_tokens=100), cluster, 0.0)
        loads[replica_id] += 100
        picks.append(replica_id)
    unbounded = PrefixAffinity(PolicyParams(affinity_load_factor=100.0))
    assert picks[0] == unbounded.choose(_request((5,)), cluster, 0.0)  # the key's owner
    mean = sum(loads.values()) / 4
    assert max(loads.values()) / mean <= 1.25
    assert len(loads) == 4


def _cache_aware_cluster() -> Cluster:
    cluster = _cluster(3)
    cluster.replicas[0].cache.insert([7])
    cluster.replicas[1].cache.insert([1, 2, 3])
    return cluster


def test_cache_aware_follows_the_longest_match_above_the_threshold() -> None:
    chosen = CacheAware(PolicyParams()).choose(_request((1, 2, 3)), _cache_aware_cluster(), 0.0)
    assert chosen == 1


def test_cache_aware_sends_weak_matches_to_the_smallest_cache() -> None:
    # 1 of 4 blocks matched on replica 1: 4 of 16 tokens is below 0.3; replica 2 is empty.
    chosen = CacheAware(PolicyParams()).choose(_request((1, 9, 9, 9)), _cache_aware_cluster(), 0.0)
    assert chosen == 2


def test_cache_aware_load_guard_picks_the_idlest_replica() -> None:
    policy = CacheAware(PolicyParams(balance_abs_threshold=64, balance_rel_threshold=1.5))
    cluster = _cache_aware_cluster()
    for _ in range(64):
        cluster.replicas[1].queue.serve(0.0, 100.0)
    assert policy.choose(_request((1, 2, 3)), cluster, 1.0) == 1  # gap 64 is not above 64
    cluster.replicas[1].queue.serve(0.0, 100.0)
    assert policy.choose(_request((1, 2, 3)), cluster, 1.0) == 0  # gap 65: least in flight
    assert policy.choose(_request((1, 2, 3)), cluster, 10_000.0) == 1  # queue drained
