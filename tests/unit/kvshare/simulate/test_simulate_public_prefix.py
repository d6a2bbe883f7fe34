"""The public-prefix workload, through the real generator and engine: what the public scope saves.

Small shape: 3 tenants, a 42-token public prompt P (10 whole 4-token blocks, then a
block that straddles P and the system prompt), 10-token system prompts, 2
conversations of 3 turns each per tenant, 2 replicas behind round robin, one store.
"""

from __future__ import annotations

from dataclasses import replace

from kvshare.simulate.public_prefix import (
    PublicPrefixComparison,
    PublicPrefixWorkload,
    arrival_order,
    build_trace,
    run_comparison,
)
from kvshare.simulate.timing import TimeModel

BLOCK_TOKENS = 4
KV_BYTES_PER_TOKEN = 1_000
BLOCK_BYTES = BLOCK_TOKENS * KV_BYTES_PER_TOKEN
WORKLOAD = PublicPrefixWorkload(
    tenants=3, public_tokens=42, system_tokens=10, conversations=2, turns=3, turn_tokens=8
)
PUBLIC_BLOCKS = 42 // BLOCK_TOKENS  # the straddling 11th block is private
MODEL = TimeModel(
    prefill_tokens_per_s=1_000.0,
    kv_bytes_per_token=KV_BYTES_PER_TOKEN,
    restore_gb_per_s=10.0,
    restore_latency_s=0.0,
)


def _compare(workload: PublicPrefixWorkload = WORKLOAD) -> PublicPrefixComparison:
    return run_comparison(
        workload,
        replicas=2,
        policy="round_robin",
        block_tokens=BLOCK_TOKENS,
        replica_capacity_blocks=None,
        time_model=MODEL,
    )


def test_without_public_scope_every_tenant_stores_its_own_copy_of_p() -> None:
    # Positive control: the comparison means something only if the baseline duplicates.
    without = _compare().without_public
    assert without.public_prefix_blocks == WORKLOAD.tenants * PUBLIC_BLOCKS
    assert without.published_blocks == 0
    assert without.result.store_blocks == without.public_prefix_blocks + without.private_blocks


def test_with_public_scope_p_is_stored_once_and_the_saving_is_t_minus_1_copies() -> None:
    comparison = _compare()
    without, with_public = comparison.without_public, comparison.with_public
    assert with_public.public_prefix_blocks == PUBLIC_BLOCKS
    assert with_public.published_blocks == PUBLIC_BLOCKS
    saved = without.stored_bytes - with_public.stored_bytes
    assert saved == (WORKLOAD.tenants - 1) * PUBLIC_BLOCKS * BLOCK_BYTES
    assert comparison.stored_bytes_ratio == with_public.stored_bytes / without.stored_bytes < 1


def test_private_blocks_are_the_same_in_both_runs() -> None:
    comparison = _compare()
    assert comparison.with_public.private_blocks == comparison.without_public.private_blocks
    assert comparison.with_public.private_blocks > 0
    # Same requests in both runs: only the ids of P's whole blocks differ.
    without = build_trace(WORKLOAD, BLOCK_TOKENS, public_scope=False).requests
    with_public = build_trace(WORKLOAD, BLOCK_TOKENS, public_scope=True).requests
    assert [(r.arrival_s, r.input_tokens) for r in without] == [
        (r.arrival_s, r.input_tokens) for r in with_public
    ]
    assert [len(r.block_ids) for r in without] == [len(r.block_ids) for r in with_public]


def test_prefill_drops_by_each_tenants_first_computation_of_p() -> None:
    # Without the scope each tenant prefills P's whole blocks once (its first request;
    # later ones find them locally or in the store). With it the publisher did, once,
    # before any request, so no tenant does; net of the publisher, T - 1 copies saved.
    comparison = _compare()
    without, with_public = comparison.without_public.result, comparison.with_public.result
    public_tokens = PUBLIC_BLOCKS * BLOCK_TOKENS
    assert without.prefill_tokens - with_public.prefill_tokens == WORKLOAD.tenants * public_tokens
    assert with_public.token_hit_rate > without.token_hit_rate
    assert comparison.prefill_tokens_ratio < 1
    assert without.input_tokens == with_public.input_tokens


def test_only_the_public_scope_lets_tenants_share_p() -> None:
    for public_scope, shared in ((False, False), (True, True)):
        trace = build_trace(WORKLOAD, BLOCK_TOKENS, public_scope=public_scope)
        first_of: dict[int, tuple[int, ...]] = {}
        for (tenant, _, _), request in zip(arrival_order(WORKLOAD), trace.requests, strict=True):
            first_of.setdefault(tenant, request.block_ids)
        p_chains = {ids[:PUBLIC_BLOCKS] for ids in first_of.values()}
        straddling = {ids[PUBLIC_BLOCKS] for ids in first_of.values()}
        assert (len(p_chains) == 1) is shared
        assert len(straddling) == WORKLOAD.tenants  # never shared: it holds S_t's tokens


def test_the_workload_is_seeded() -> None:
    assert build_trace(WORKLOAD, BLOCK_TOKENS, True) == build_trace(WORKLOAD, BLOCK_TOKENS, True)
    reseeded = replace(WORKLOAD, seed=1)
    assert arrival_order(reseeded) != arrival_order(WORKLOAD)
    assert _compare() == _compare()
