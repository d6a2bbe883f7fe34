"""The vLLM connector's scheduler-side plans, without vLLM.

The store is a counting stand-in here (a pure-arithmetic unit); the same planner runs
against a real store and a real vLLM `Scheduler` in tests/vllm/test_scheduler_contract.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvcommon.errors import ConfigError
from replica_agent.adapters.vllm_plan import (
    TENANT_PARAM,
    LoadPlan,
    NewStep,
    RequestKey,
    RunningStep,
    SavePlan,
    SchedulerPlanner,
    parse_vllm_options,
    request_tenant,
    store_block_tokens,
)
from replica_agent.hashing import BlockHasher

MODEL = "m@r;fp32;L2;H2;D8;B32;tp0/1"
BT, BS = 32, 16  # store block: 2 vLLM blocks


class CountingStore:
    def __init__(self, present: int) -> None:
        self.present = present
        self.calls: list[tuple[str, int]] = []

    def lookup(self, tenant: str, digests: Sequence[bytes]) -> int:
        self.calls.append((tenant, len(digests)))
        return min(self.present, len(digests))


def planner(present: int) -> tuple[SchedulerPlanner, CountingStore]:
    store = CountingStore(present)
    return SchedulerPlanner(MODEL, BT, BS, store.lookup), store


def key(tokens: int, tenant: str = "alpha", salt: bytes = b"") -> RequestKey:
    return RequestKey(tenant, list(range(100, 100 + tokens)), salt)


def test_store_block_tokens_are_a_multiple_of_vllms_block() -> None:
    assert store_block_tokens(128, None) == 256
    assert store_block_tokens(16, None) == 256
    assert store_block_tokens(96, None) == 288
    assert store_block_tokens(16, 32) == 32
    with pytest.raises(ConfigError, match="not a multiple of vLLM's block size 128; use 128"):
        store_block_tokens(128, 200)


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"block_tokens": 0}, "block_tokens"),
        ({"require_request_tenant": "yes"}, "require_request_tenant"),
        ({"save_queue_bytes": -1}, "save_queue_bytes"),
        ({"flush_timeout_s": "5"}, "flush_timeout_s"),
    ],
)
def test_bad_vllm_options_name_the_key(raw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_vllm_options(raw, source="kv_connector_extra_config")


def test_the_gateway_sets_the_tenant_else_the_default_or_none() -> None:
    assert request_tenant({TENANT_PARAM: "beta"}, "alpha", require_request_tenant=False) == "beta"
    assert request_tenant(None, "alpha", require_request_tenant=False) == "alpha"
    assert request_tenant({"other": 1}, "alpha", require_request_tenant=True) is None
    # A malformed tenant never falls back to the default: that would merge namespaces.
    for bad in ("Beta", "../x", "", 7, "a" * 64):
        assert request_tenant({TENANT_PARAM: bad}, "alpha", require_request_tenant=False) is None


def test_one_lookup_per_request_and_repeated_questions_are_free() -> None:
    plan, store = planner(present=3)
    answers = [plan.new_matched_tokens("r1", 0, lambda: key(100)) for _ in range(5)]
    assert answers == [96] * 5  # 3 full blocks, the last prompt token left to compute
    assert store.calls == [("alpha", 3)]
    assert plan.new_matched_tokens("r1", 32, lambda: key(100)) == 64  # beyond local hits
    plan.finished("r1")
    assert plan.tracked_requests == 0


def test_the_last_prompt_token_is_never_supplied() -> None:
    plan, _ = planner(present=3)
    assert plan.new_matched_tokens("r", 0, lambda: key(96)) == 64  # 96 = 3 blocks exactly


def test_partial_hit_and_miss() -> None:
    plan, _ = planner(present=1)
    assert plan.new_matched_tokens("r", 0, lambda: key(100)) == 32
    plan, _ = planner(present=0)
    assert plan.new_matched_tokens("r", 0, lambda: key(100)) == 0


def test_a_request_without_a_tenant_asks_nothing() -> None:
    plan, store = planner(present=3)
    assert plan.new_matched_tokens("r", 0, lambda: None) == 0
    assert plan.new_matched_tokens("short", 0, lambda: key(BT - 1)) == 0  # no full block
    assert store.calls == [] and plan.stats.requests_skipped == 1
    assert plan.build([NewStep("r", [1, 2], 0, 40)], []) == ([], [])


def test_cache_salt_changes_every_digest() -> None:
    tokens = list(range(64))
    plain = BlockHasher(MODEL, BT).digests(tokens)
    salted = BlockHasher(MODEL, BT, b"user-1").digests(tokens)
    assert len(plain) == len(salted) == 2 and not set(plain) & set(salted)


def test_load_plan_covers_the_external_tokens_after_local_hits() -> None:
    plan, _ = planner(present=3)
    digests = BlockHasher(MODEL, BT).digests(key(100).token_ids)
    assert plan.new_matched_tokens("r", 16, lambda: key(100)) == 80  # one local vLLM block
    plan.after_alloc("r", 80)
    table = [10, 11, 12, 13, 14, 15, 16]
    loads, saves = plan.build([NewStep("r", table, 96, 4)], [])
    # Store blocks 0..2; vLLM already holds the first 16 tokens (its block 10).
    assert loads == [LoadPlan("r", "alpha", tuple(digests), 16, (11, 12, 13, 14, 15))]
    assert saves == []  # every full block is in the store already


def test_saves_follow_chunked_prefill_and_skip_what_the_store_holds() -> None:
    plan, _ = planner(present=1)
    digests = BlockHasher(MODEL, BT).digests(key(130).token_ids)
    plan.new_matched_tokens("r", 0, lambda: key(130))
    plan.after_alloc("r", 32)
    loads, saves = plan.build([NewStep("r", [1, 2, 3, 4], 32, 40)], [])  # computes to 72
    assert [p.block_ids for p in loads] == [(1, 2)]
    assert saves == [SavePlan("r", "alpha", (digests[1],), (3, 4))]
    step = RunningStep("r", [5, 6, 7, 8, 9], False, 72, 58)  # computes to 130
    loads, saves = plan.build([], [step])
    assert loads == [] and saves == [SavePlan("r", "alpha", tuple(digests[2:4]), (5, 6, 7, 8))]
    loads, saves = plan.build([], [RunningStep("r", None, False, 130, 1)])  # decoding
    assert (loads, saves) == ([], [])


def test_a_resumed_request_gets_its_new_block_table_and_load() -> None:
    plan, _ = planner(present=2)
    plan.new_matched_tokens("r", 0, lambda: key(70))
    plan.after_alloc("r", 64)
    plan.build([NewStep("r", [1, 2, 3, 4, 5], 64, 6)], [])
    plan.after_alloc("r", 64)  # preempted, then allocated again
    loads, _ = plan.build([], [RunningStep("r", [7, 8, 9, 10, 11], True, 64, 6)])
    assert [p.block_ids for p in loads] == [(7, 8, 9, 10)]


def test_plans_never_show_digests_in_their_repr() -> None:
    """Plans travel in vLLM's step metadata, which vLLM may log (C23: no digests in logs)."""
    load = LoadPlan("r", "alpha", (b"\x01" * 32,), 0, (1,))
    save = SavePlan("r", "alpha", (b"\x01" * 32,), (1, 2))
    for plan in (load, save):
        assert "digests" not in repr(plan) and "\\x01" not in repr(plan)
