"""The docs/design.md §8 hit-rate contract and the time model, on traces small enough to do by hand.

Shared trace (block_tokens = 4, arrivals one second apart):

    r0  10 tokens  blocks [1, 2, 3]   (last block partial: 2 tokens)
    r1  10 tokens  blocks [1, 2, 3]
    r2   8 tokens  blocks [1, 2]
    r3  12 tokens  blocks [1, 2, 4]
    r4   6 tokens  blocks [5, 6]      46 input tokens in all

Round robin over 2 replicas sends r0, r2, r4 to replica 0 and r1, r3 to replica 1.
"""

from __future__ import annotations

import pytest

from kvshare.simulate.engine import SimConfig, SimResult, ideal_token_hit_rate, simulate
from kvshare.simulate.timing import TimeModel, percentile
from kvshare.simulate.trace import Request

BLOCK_TOKENS = 4
TRACE = (
    Request(0.0, 10, 1, (1, 2, 3)),
    Request(1.0, 10, 1, (1, 2, 3)),
    Request(2.0, 8, 1, (1, 2)),
    Request(3.0, 12, 1, (1, 2, 4)),
    Request(4.0, 6, 1, (5, 6)),
)
INPUT_TOKENS = 46
# Prefill 2 tokens/s; restore 0.5 s per token after 0.25 s latency (5e8 B at 1 GB/s).
SLOW = TimeModel(
    prefill_tokens_per_s=2.0,
    kv_bytes_per_token=500_000_000,
    restore_gb_per_s=1.0,
    restore_latency_s=0.25,
)


def _run(
    requests: tuple[Request, ...] = TRACE,
    *,
    policy: str = "round_robin",
    replicas: int = 2,
    shared_store: bool = False,
    replica_capacity_blocks: int | None = None,
    store_capacity_blocks: int | None = None,
    scenario: str = "static",
) -> SimResult:
    config = SimConfig(
        policy=policy,
        replicas=replicas,
        shared_store=shared_store,
        block_tokens=BLOCK_TOKENS,
        replica_capacity_blocks=replica_capacity_blocks,
        store_capacity_blocks=store_capacity_blocks,
        time_model=SLOW,
        scenario=scenario,
    )
    return simulate(requests, config)


def test_round_robin_without_store_reuses_only_what_its_replica_saw() -> None:
    # r0 0, r1 0 (replica 1 is cold), r2 8 (blocks 1,2 on replica 0), r3 8, r4 0.
    result = _run()
    assert (result.input_tokens, result.local_hit_tokens, result.store_hit_tokens) == (46, 16, 0)
    assert result.token_hit_rate == 16 / 46
    assert result.local_hit_rate == 16 / 46
    assert result.store_hit_rate == 0.0
    assert result.prefill_tokens == 30


def test_store_supplies_what_the_local_cache_lacks_capped_at_the_prompt() -> None:
    # r1 finds [1,2,3] in the store: min(3 * 4, 10) = 10 tokens, all from the store.
    result = _run(shared_store=True)
    assert (result.local_hit_tokens, result.store_hit_tokens) == (16, 10)
    assert result.token_hit_rate == 26 / 46
    assert result.store_hit_rate == 10 / 46
    assert result.reused_tokens == 26


def test_ideal_is_one_unbounded_cache_and_an_unbounded_store_reaches_it() -> None:
    assert ideal_token_hit_rate(TRACE, BLOCK_TOKENS) == 26 / 46
    for policy in ("round_robin", "random", "prefix_affinity", "cache_aware"):
        assert _run(policy=policy, shared_store=True).token_hit_rate == 26 / 46


def test_local_share_is_the_local_prefix_and_the_store_adds_the_rest() -> None:
    # r3 reaches replica 1 holding [1, 9]: 1 local block (4 tokens); the store holds
    # [1, 2, 3]: min(12, 11) = 11, so 7 tokens come from the store. r1 finds [1] in the
    # store (4 tokens) but not 9. Input 12 + 8 + 4 + 11 = 35.
    requests = (
        Request(0.0, 12, 0, (1, 2, 3)),
        Request(1.0, 8, 0, (1, 9)),
        Request(2.0, 4, 0, (7,)),
        Request(3.0, 11, 0, (1, 2, 3)),
    )
    result = _run(requests, shared_store=True)
    assert (result.input_tokens, result.local_hit_tokens, result.store_hit_tokens) == (35, 4, 11)
    assert result.local_hit_rate == 4 / 35
    assert result.store_hit_rate == 11 / 35


def test_bounded_store_is_lru_over_blocks_in_prompt_order() -> None:
    # A 2-block store keeps [2, 3] after r0, so r1 misses block 1 there: no store hit.
    result = _run(shared_store=True, store_capacity_blocks=2)
    assert (result.local_hit_tokens, result.store_hit_tokens) == (16, 0)


def test_bounded_local_cache_is_lru_over_blocks() -> None:
    # One replica of 2 blocks: r1 and r2 miss block 1 (evicted by its own prompt's tail);
    # after r2 the cache is [1, 2], so r3 reuses 2 blocks = 8 tokens.
    result = _run(replicas=1, replica_capacity_blocks=2)
    assert (result.local_hit_tokens, result.store_hit_tokens) == (8, 0)


def test_time_model_counters_with_store() -> None:
    # replica 0: r0 prefill 10 -> done 5; r2 full local hit, waits -> done 5 (TTFT 3);
    #            r4 prefill 6 from 5 -> done 8 (TTFT 4).
    # replica 1: r1 restores 10 tokens: 0.25 + 5 -> done 6.25 (TTFT 5.25);
    #            r3 prefill 4 from 6.25 -> done 8.25 (TTFT 5.25).
    result = _run(shared_store=True)
    assert result.ttft_p50_s == pytest.approx(5.0)
    assert result.ttft_p99_s == pytest.approx(5.25)
    assert result.prefill_gpu_s == pytest.approx(10.0)
    assert result.restore_s == pytest.approx(5.25)
    assert result.load_imbalance == pytest.approx(24 / 23)  # routed 24 and 22 tokens
    assert result.replicas_started == 2


def test_time_model_counters_without_store() -> None:
    # TTFTs 5, 5, 3, 5, 4: r1 now prefills 10 tokens itself; r3 waits for it until 6.
    result = _run()
    assert result.ttft_p50_s == pytest.approx(5.0)
    assert result.ttft_p99_s == pytest.approx(5.0)
    assert result.prefill_gpu_s == pytest.approx(15.0)
    assert result.restore_s == 0.0


def test_percentile_is_nearest_rank() -> None:
    values = [3.0, 4.0, 5.0, 5.25, 5.25]
    assert percentile(values, 0.5) == 5.0
    assert percentile(values, 0.99) == 5.25
    assert percentile(values, 0.0) == 3.0
    assert percentile([], 0.5) == 0.0


def test_churn_restart_loses_the_local_cache_and_the_store_keeps_it() -> None:
    # One replica restarted at the midpoint (t = 2): r2 lands on a cold replica.
    without = _run(replicas=1, scenario="churn")
    assert (without.local_hit_tokens, without.store_hit_tokens) == (18, 0)
    with_store = _run(replicas=1, scenario="churn", shared_store=True)
    assert (with_store.local_hit_tokens, with_store.store_hit_tokens) == (18, 8)
    assert with_store.replicas_started == 2
    # Each replica took all traffic while it was the only one: balanced.
    assert with_store.load_imbalance == pytest.approx(1.0)


def test_autoscale_adds_a_cold_replica_then_removes_it() -> None:
    # Two replicas: one from the start, one from t = 4/3 to t = 8/3. Round robin's
    # third pick (r2) goes to replica 0 again; the extra replica serves nothing of the
    # 4 tokens that were its fair share (half of r2), so max/mean is 2.
    result = _run(scenario="autoscale")
    assert result.replicas_started == 2
    assert result.local_hit_tokens == 26
    assert result.load_imbalance == pytest.approx(2.0)


def test_store_blocks_counts_distinct_blocks_and_none_without_a_store() -> None:
    # The trace writes blocks 1..6 once each.
    assert _run(shared_store=True).store_blocks == 6
    assert _run().store_blocks == 0


def test_published_blocks_are_in_the_store_before_the_first_request() -> None:
    config = SimConfig("round_robin", 2, True, BLOCK_TOKENS, None, None, SLOW)
    # Blocks 1, 2 published: r0 restores them from the store (8 tokens), r1 then finds
    # [1, 2, 3] (10 tokens); r2 (replica 0) has [1, 2] locally, r3 finds [1, 2] on
    # replica 1 and r4 nothing. Published blocks are stored, not prefilled by anyone.
    result = simulate(TRACE, config, published_block_ids=(1, 2))
    assert (result.local_hit_tokens, result.store_hit_tokens) == (16, 18)
    assert result.prefill_tokens == INPUT_TOKENS - 34
    assert result.store_blocks == 6
    assert simulate(TRACE, config, published_block_ids=(7,)).store_blocks == 7
    local_only = SimConfig("round_robin", 2, False, BLOCK_TOKENS, None, None, SLOW)
    with pytest.raises(ValueError, match="need a shared store"):
        simulate(TRACE, local_only, published_block_ids=(1,))
