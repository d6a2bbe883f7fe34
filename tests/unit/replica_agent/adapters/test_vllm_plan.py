"""The vLLM connector's scheduler-side plans, without vLLM.

The store is a counting stand-in here (a pure-arithmetic unit), except for the public
prefix tests at the end, which run the planner against a real server with a public
scope and record every call its real client makes; the same planner runs against a
real store and a real vLLM `Scheduler` in tests/vllm/test_scheduler_contract.py.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.adapters.vllm_plan import (
    NewStep,
    RequestKey,
    RunningStep,
    SchedulerPlanner,
)
from replica_agent.breaker import CircuitBreaker
from replica_agent.client import BlockClient, Payload, View
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.hashing import BlockHasher
from replica_agent.public import (
    CATALOGUE_DIGEST,
    PUBLIC_SCOPE,
    PublicCatalogue,
    plan_chain,
    write_catalogue,
)
from replica_agent.telemetry import AgentTelemetry
from tests.support.servers import Running, launch, write_public_config

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


def test_auto_loads_synchronously_alone_and_asynchronously_beside_others() -> None:
    """The default mode: a load that would stall nobody runs before the forward pass
    (the request starts in the same step); beside a running request it runs off it."""
    plan, _ = planner(present=3)
    assert plan.new_matched_tokens("alone", 0, lambda: key(100)) == 96
    assert not plan.is_load_async("alone")
    plan.after_alloc("alone", 96, [1, 2, 3, 4, 5, 6, 7], is_async=False)
    loads, _ = plan.build([NewStep("alone", [1, 2, 3, 4, 5, 6, 7], 96, 4)], [])
    assert [p.is_async for p in loads] == [False]
    # "alone" now decodes: the next arrival's load must not stall it.
    assert plan.new_matched_tokens("next", 0, lambda: key(100)) == 96
    assert plan.is_load_async("next")
    plan.after_alloc("next", 96, [8, 9, 10, 11, 12, 13, 14], is_async=True)
    loads, _ = plan.build([], [RunningStep("alone", None, False, 100, 1)])
    assert [(p.request_id, p.is_async) for p in loads] == [("next", True)]
    assert (plan.stats.loads_sync, plan.stats.loads_async) == (1, 1)
    plan.finished("alone")  # the batch empties: the next load is synchronous again
    plan.build([], [])
    assert plan.new_matched_tokens("third", 0, lambda: key(100)) == 96
    assert not plan.is_load_async("third")


@pytest.mark.parametrize(("mode", "is_async"), [("sync", False), ("async", True)])
def test_a_forced_load_mode_holds_whatever_runs(mode: str, is_async: bool) -> None:
    store = CountingStore(3)
    plan = SchedulerPlanner(MODEL, BT, BS, store.lookup, load_mode=mode)
    for name, running in (("r1", []), ("r2", [RunningStep("r0", None, False, 10, 1)])):
        plan.build([], running)
        assert plan.new_matched_tokens(name, 0, lambda: key(100)) == 96
        assert plan.is_load_async(name) is is_async


def test_a_request_finished_during_its_asynchronous_load_cancels_it() -> None:
    """vLLM frees an aborted request's blocks once the worker reports its load: the
    worker is told, so it skips the load if it has not started (no write into blocks
    that are about to be freed), and still reports it."""
    plan, _ = planner(present=3)
    plan.build([], [RunningStep("other", None, False, 10, 1)])
    plan.new_matched_tokens("r", 0, lambda: key(100))
    plan.after_alloc("r", 96, [1, 2, 3, 4, 5, 6, 7], is_async=True)
    loads, _ = plan.build([], [RunningStep("other", None, False, 11, 1)])
    assert [p.request_id for p in loads] == ["r"] and plan.take_cancelled() == []
    plan.finished("r")
    assert plan.take_cancelled() == ["r"] and plan.take_cancelled() == []
    assert plan.tracked_requests == 0
    plan.finished("never-loaded")
    assert plan.take_cancelled() == []
    # A load the worker already reported leaves nothing to cancel.
    plan.new_matched_tokens("done", 0, lambda: key(100))
    plan.after_alloc("done", 96, [8, 9, 10, 11, 12, 13, 14], is_async=True)
    plan.build([], [RunningStep("other", None, False, 12, 1)])
    plan.loads_reported(["done"])
    plan.finished("done")
    assert plan.take_cancelled() == []


def test_two_live_requests_under_one_id_both_skip_the_cache() -> None:
    """vLLM randomises request ids unless VLLM_DISABLE_REQUEST_ID_RANDOMIZATION is set;
    two live requests under one id must never load or save under each other's digests."""
    plan, store = planner(present=3)
    first, second = object(), object()
    assert plan.new_matched_tokens("dup", 0, lambda: key(100), first) == 96
    assert plan.new_matched_tokens("dup", 0, lambda: key(100), first) == 96  # same request
    assert plan.new_matched_tokens("dup", 0, lambda: key(70, "beta"), second) == 0
    assert plan.new_matched_tokens("dup", 0, lambda: key(100), first) == 0
    assert plan.build([NewStep("dup", [1, 2, 3, 4, 5, 6, 7], 0, 100)], []) == ([], [])
    assert plan.stats.duplicate_ids == 1 and store.calls == [("alpha", 3)]


def test_plans_never_show_digests_in_their_repr() -> None:
    """Plans travel in vLLM's step metadata, which vLLM may log (C23: no digests in logs)."""
    load = LoadPlan("r", "alpha", (b"\x01" * 32,), 0, (1,))
    save = SavePlan("r", "alpha", (b"\x01" * 32,), (1, 2))
    for plan in (load, save):
        assert "digests" not in repr(plan) and "\\x01" not in repr(plan)


# -- public prefixes, against a real server ---------------------------------------------


@pytest.fixture
def public_store(tmp_path: Path) -> Iterator[Running]:
    """A real server with a public scope: tenants alpha and beta read it (read_public);
    `engine` reads and writes both, `publisher` only publishes (it has no tenants)."""
    tenancy = write_public_config(
        tmp_path,
        {"engine": (["alpha", "beta"], ["read", "write"]), "publisher": ([], ["publish"])},
        readers=("alpha", "beta"),
    )
    running = launch(tenancy)
    try:
        yield running
    finally:
        running.stop()


@dataclass
class Recording:
    """A real BlockClient whose every call is recorded as (verb, tenant, digests)."""

    client: BlockClient
    calls: list[tuple[str, str, tuple[bytes, ...]]] = field(default_factory=list)

    def lookup(self, tenant: str, model: str, digests: Sequence[bytes]) -> int:
        self.calls.append(("lookup", tenant, tuple(digests)))
        return self.client.lookup(tenant, model, digests)

    def iter_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> Iterator[View]:
        self.calls.append(("get", tenant, tuple(digests)))
        return self.client.iter_views(tenant, model, digests)

    def put(
        self, tenant: str, model: str, digests: Sequence[bytes], payloads: Sequence[Payload]
    ) -> list[bool]:
        self.calls.append(("put", tenant, tuple(digests)))
        return self.client.put(tenant, model, digests, payloads)

    def sent_to(self, tenant: str) -> list[bytes]:
        return [d for _, who, digests in self.calls if who == tenant for d in digests]

    def lookups(self) -> list[tuple[str, tuple[bytes, ...]]]:
        return [(who, digests) for verb, who, digests in self.calls if verb == "lookup"]


PREFIX = list(range(500, 500 + 2 * BT))  # two blocks, published


def publish(running: Running, tokens: Sequence[int], stored: int | None = None) -> list[bytes]:
    """A publisher's act: the plain chain's blocks into @public (only the first `stored`
    when given) and all of their digests into the catalogue."""
    digests = BlockHasher(MODEL, BT).digests(tokens)
    count = len(digests) if stored is None else stored
    with running.client("publisher") as publisher:
        assert publisher.put(PUBLIC_SCOPE, MODEL, digests[:count], [b"public"] * count)
        write_catalogue(publisher, MODEL, digests)
    return digests


@pytest.fixture
def public_planner(public_store: Running) -> Iterator[tuple[SchedulerPlanner, Recording]]:
    """The connector's scheduler side: a real client through the gate, for lookups and
    for the catalogue, every call recorded."""
    with public_store.client("engine") as client:
        recording = Recording(client)
        gate = StoreGate(CircuitBreaker(), AgentTelemetry(), StoreStats())
        catalogue = PublicCatalogue(recording, gate, MODEL)

        def lookup(tenant: str, digests: Sequence[bytes]) -> int:
            return gate.leading(recording, tenant, MODEL, digests)

        yield SchedulerPlanner(MODEL, BT, BS, lookup, catalogue.digests), recording


def test_public_blocks_are_asked_of_public_and_the_rest_of_the_tenant(
    public_store: Running, public_planner: tuple[SchedulerPlanner, Recording]
) -> None:
    plan, recording = public_planner
    published = publish(public_store, PREFIX)
    prompt = [*PREFIX, *range(900, 940)]  # 104 tokens: 2 public blocks, 1 private
    expected = plan_chain(MODEL, BT, prompt, frozenset(published), salt=b"user-1")
    assert expected.public_blocks == 2 and expected.digests[:2] == tuple(published)
    assert plan.new_matched_tokens("r", 0, lambda: key_for(prompt, b"user-1")) == 64
    assert recording.lookups() == [
        (PUBLIC_SCOPE, tuple(published)),
        ("alpha", expected.digests[2:]),  # the private chain: never sent to @public
    ]
    assert set(recording.sent_to(PUBLIC_SCOPE)) == {CATALOGUE_DIGEST, *published}
    assert plan.stats.public_blocks_matched == 2 and plan.stats.blocks_matched == 2

    plan.after_alloc("r", 64)
    loads, saves = plan.build([NewStep("r", list(range(1, 8)), 64, 40)], [])
    assert loads == [LoadPlan("r", "alpha", tuple(published), 0, (1, 2, 3, 4), 2)]
    # Saves go to the tenant and skip the public blocks: only the private block 2.
    assert saves == [SavePlan("r", "alpha", expected.digests[2:3], (5, 6))]


def test_a_private_prompt_sends_nothing_to_public(
    public_store: Running, public_planner: tuple[SchedulerPlanner, Recording]
) -> None:
    plan, recording = public_planner
    publish(public_store, PREFIX)
    # Shares the first published block's tokens, then diverges: block 1 is not listed,
    # so the boundary is 1 and only the listed digest goes to @public.
    diverging = [*PREFIX[:BT], *range(7000, 7000 + 2 * BT)]
    private = list(range(3000, 3000 + 3 * BT + 5))
    plan.new_matched_tokens("private", 0, lambda: key_for(private))
    plan.new_matched_tokens("diverging", 0, lambda: key_for(diverging))
    published = BlockHasher(MODEL, BT).digests(PREFIX)
    after = plan_chain(MODEL, BT, diverging, frozenset(published))
    assert after.public_blocks == 1
    assert recording.lookups() == [
        ("alpha", tuple(BlockHasher(MODEL, BT).digests(private))),
        (PUBLIC_SCOPE, (published[0],)),
        ("alpha", after.digests[1:]),
    ]
    assert recording.sent_to(PUBLIC_SCOPE) == [CATALOGUE_DIGEST, published[0]]


def test_without_a_catalogue_the_chain_and_calls_are_todays(
    public_store: Running, public_planner: tuple[SchedulerPlanner, Recording]
) -> None:
    """Nothing published: the catalogue read finds nothing, P = 0, and the plan is the
    ordinary salted chain, asked of the tenant only."""
    plan, recording = public_planner
    prompt = [*PREFIX, *range(900, 940)]
    plan.new_matched_tokens("r", 0, lambda: key_for(prompt, b"user-1"))
    salted = BlockHasher(MODEL, BT, b"user-1").digests(prompt)
    assert recording.lookups() == [("alpha", tuple(salted))]
    assert recording.sent_to(PUBLIC_SCOPE) == [CATALOGUE_DIGEST]  # the catalogue read only


def test_public_blocks_missing_from_the_scope_are_neither_loaded_nor_saved(
    public_store: Running, public_planner: tuple[SchedulerPlanner, Recording]
) -> None:
    plan, recording = public_planner
    published = publish(public_store, PREFIX, stored=1)  # listed: 2; stored: 1
    prompt = [*PREFIX, *range(900, 940)]
    assert plan.new_matched_tokens("r", 0, lambda: key_for(prompt)) == BT
    assert [who for who, _ in recording.lookups()] == [PUBLIC_SCOPE]  # tenant not asked
    plan.after_alloc("r", BT)
    loads, saves = plan.build([NewStep("r", list(range(1, 8)), BT, 72)], [])
    assert loads == [LoadPlan("r", "alpha", tuple(published[:1]), 0, (1, 2), 1)]
    (save,) = saves
    assert save.digests == plan_chain(MODEL, BT, prompt, frozenset(published)).digests[2:3]


def test_the_next_turn_finds_the_output_blocks_saved_after_a_public_prefix(
    public_store: Running, public_planner: tuple[SchedulerPlanner, Recording]
) -> None:
    """Saves of the model's output extend the same split chain: the next turn's plan
    (the conversation as its prompt) computes those digests and finds them."""
    plan, recording = public_planner
    published = publish(public_store, PREFIX)
    prompt = [*PREFIX, *range(900, 910)]  # 74 tokens: 2 public blocks and 10 private
    live = list(prompt)
    key = RequestKey("alpha", prompt, b"", None, live)
    assert plan.new_matched_tokens("t1", 0, lambda: key) == 64
    plan.after_alloc("t1", 64)
    loads, saves = plan.build([NewStep("t1", [1, 2, 3, 4, 5], 64, 10)], [])
    assert [p.public_blocks for p in loads] == [2] and saves == []
    computed = len(prompt)
    for token in range(1200, 1200 + 2 * BT):  # the model's answer, one token a step
        live.append(token)
        step = RunningStep("t1", [6 + len(live) // BS], False, computed, 1)
        computed += 1
        _, new_saves = plan.build([], [step])
        saves += new_saves
    conversation = live[: 4 * BT]
    turn_two = plan_chain(MODEL, BT, conversation, frozenset(published))
    assert [d for s in saves for d in s.digests] == list(turn_two.digests[2:4])
    with public_store.client("engine") as client:  # what the worker's saver would put
        for save in saves:
            client.put("alpha", MODEL, save.digests, [b"kv"] * len(save.digests))
    recording.calls.clear()
    next_prompt = [*conversation, 1, 2, 3]
    assert plan.new_matched_tokens("t2", 0, lambda: key_for(next_prompt)) == 4 * BT
    assert recording.lookups() == [
        (PUBLIC_SCOPE, tuple(published)),
        ("alpha", turn_two.digests[2:4]),
    ]


def key_for(tokens: Sequence[int], salt: bytes = b"", tenant: str = "alpha") -> RequestKey:
    return RequestKey(tenant, list(tokens), salt)
