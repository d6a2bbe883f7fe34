"""KVShareConnector on a real vLLM `Scheduler` and a real kvshare server (no model run).

As vLLM's own connector unit tests do: a `VllmConfig` with `DeviceConfig("cpu")`, the
committed tiny config.json, `skip_tokenizer_init=True`, and a `Scheduler` that builds
the connector from `--kv-transfer-config`'s fields. vLLM blocks of 16 tokens, store
blocks of 32. Blocks are put in the store under the digests the connector computes,
then the scheduler is driven through hits, misses, partial hits, a dead store, and a
finished and an aborted request.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from replica_agent.adapters.vllm import KVShareConnector, KVShareMetadata
from replica_agent.hashing import BlockHasher
from tests.support.servers import free_port
from tests.support.vllm_store import CONFIG_DIR, Store

BLOCK, STORE_BLOCK, PROMPT = 16, 32, 100  # 3 full store blocks; 96 tokens loadable


def make_scheduler(store: Store | Path, *, num_blocks: int = 200, **extra: Any) -> Scheduler:
    """A scheduler whose connector uses `store`, or a dead address (a token in a dir)."""
    if isinstance(store, Path):
        token_file = store / "engine.token"
        token_file.write_text("token")
        token_file.chmod(0o600)
        target = _dead_address()
    else:
        token_file, target = store.token_files["engine"], store.address
    connector_config = {
        "target": target,
        "token_file": str(token_file),
        "tenant": "alpha",
        "block_tokens": STORE_BLOCK,
        "timeout_s": 1.0,
        "load_mode": "sync",  # the async protocol has its own tests below
        **extra,
    }
    model = ModelConfig(
        model=str(CONFIG_DIR), skip_tokenizer_init=True, dtype="float32", max_model_len=1024
    )
    config = VllmConfig(
        model_config=model,
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(
            max_num_seqs=4,
            max_num_batched_tokens=1024,
            max_model_len=1024,
            is_encoder_decoder=False,
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVShareConnector",
            kv_connector_module_path="replica_agent.adapters.vllm",
            kv_role="kv_both",
            kv_connector_extra_config=connector_config,
        ),
    )
    config.cache_config.num_gpu_blocks = num_blocks
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=64, dtype=torch.float32)
    cache = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    return Scheduler(
        vllm_config=config,
        kv_cache_config=cache,
        structured_output_manager=StructuredOutputManager(config),
        block_size=BLOCK,
        log_stats=True,
    )


def _dead_address() -> str:
    return f"127.0.0.1:{free_port()}"


init_none_hash(sha256)
HASHER = get_request_block_hasher(BLOCK, sha256)


def request(request_id: str, tokens: list[int], max_tokens: int = 1, **params: Any) -> Request:
    extra = {"kv_transfer_params": params} if params else None
    sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, extra_args=extra)
    return Request(request_id, tokens, sampling, None, block_hasher=HASHER)


def connector(scheduler: Scheduler) -> KVShareConnector:
    assert isinstance(scheduler.connector, KVShareConnector)
    return scheduler.connector


def put_blocks(
    store: Store, scheduler: Scheduler, tokens: list[int], count: int, tenant: str = "alpha"
) -> list[bytes]:
    conn = connector(scheduler)
    digests = BlockHasher(conn.namespace, STORE_BLOCK).digests(tokens)
    client = store_client(store)
    client.put(tenant, conn.namespace, digests[:count], [b"block"] * count)
    client.close()
    return digests


def store_client(store: Store) -> Any:
    from replica_agent.client import BlockClient

    return BlockClient(store.address, store.tokens["engine"])


def step(scheduler: Scheduler) -> tuple[Any, KVShareMetadata]:
    output = scheduler.schedule()
    metadata = output.kv_connector_metadata
    assert isinstance(metadata, KVShareMetadata)
    return output, metadata


def finish_step(
    scheduler: Scheduler, output: Any, token: int = 7, kv: KVConnectorOutput | None = None
) -> None:
    ids = list(output.num_scheduled_tokens)
    result = ModelRunnerOutput(
        req_ids=ids,
        req_id_to_index={r: i for i, r in enumerate(ids)},
        sampled_token_ids=[[token] for _ in ids],
        kv_connector_output=kv,
    )
    scheduler.update_from_output(output, result)


TOKENS = list(range(1000, 1000 + PROMPT))


def test_the_connector_makes_block_load_failures_recompute(store: Store) -> None:
    scheduler = make_scheduler(store)
    assert scheduler.recompute_kv_load_failures  # a bad block is recomputed, never fatal
    assert connector(scheduler).namespace.endswith(";fp32;L4;H2;D64;B32;tp0/1")


def test_hit_loads_every_block_but_the_last_token(store: Store) -> None:
    scheduler = make_scheduler(store)
    digests = put_blocks(store, scheduler, TOKENS, 3)
    scheduler.add_request(request("r1", TOKENS))
    output, metadata = step(scheduler)
    (load,) = metadata.loads
    assert load.tenant == "alpha" and load.digests == tuple(digests) and load.skip_tokens == 0
    block_table = output.scheduled_new_reqs[0].block_ids[0]
    assert load.block_ids == tuple(block_table[:6])
    assert output.scheduled_new_reqs[0].num_computed_tokens == 96
    assert output.num_scheduled_tokens["r1"] == PROMPT - 96
    assert metadata.saves == []  # the store holds every full block already


def test_repeated_questions_cost_one_lookup(store: Store) -> None:
    scheduler = make_scheduler(store)
    put_blocks(store, scheduler, TOKENS, 2)
    conn, pending = connector(scheduler), request("r1", TOKENS)
    answers = {conn.get_num_new_matched_tokens(pending, 0) for _ in range(4)}
    assert answers == {(64, False)}  # partial hit: blocks 0 and 1
    assert conn.get_num_new_matched_tokens(pending, 32) == (32, False)
    client = store_client(store)
    (alpha,) = [t for t in client.stats().tenants if t.tenant == "alpha"]
    client.close()
    assert alpha.lookups == 1


def test_a_miss_loads_nothing_and_saves_what_prefill_completes(store: Store) -> None:
    scheduler = make_scheduler(store)
    scheduler.add_request(request("r1", TOKENS))
    output, metadata = step(scheduler)
    assert metadata.loads == [] and output.num_scheduled_tokens["r1"] == PROMPT
    (save,) = metadata.saves
    digests = BlockHasher(connector(scheduler).namespace, STORE_BLOCK).digests(TOKENS)
    assert save.digests == tuple(digests)
    assert save.block_ids == tuple(output.scheduled_new_reqs[0].block_ids[0][:6])


def after_a_local_hit(store: Store, **extra: Any) -> tuple[Any, Any, Any]:
    """A scheduler whose vLLM cache holds block 0 of TOKENS (a request that shared its
    first 24 tokens ran), and the step that schedules TOKENS: (scheduler, output, load)."""
    scheduler = make_scheduler(store, **extra)
    put_blocks(store, scheduler, TOKENS, 3)
    first = TOKENS[:24] + [5] * 76  # shares vLLM block 0 (16 tokens) with TOKENS
    scheduler.add_request(request("warm", first))
    output, _ = step(scheduler)
    finish_step(scheduler, output)
    scheduler.add_request(request("r2", TOKENS))
    output, metadata = step(scheduler)
    (load,) = metadata.loads
    return scheduler, output, load


def test_local_hits_come_first_and_the_store_supplies_the_rest(store: Store) -> None:
    _, output, load = after_a_local_hit(store)
    new = next(r for r in output.scheduled_new_reqs if r.req_id == "r2")
    assert new.num_computed_tokens == 96
    # Store block 0 is half in vLLM's cache: only its second vLLM block is filled.
    assert load.skip_tokens == 16 and len(load.digests) == 3
    assert load.block_ids == tuple(new.block_ids[0][1:6])


@pytest.mark.parametrize("public_prefixes", [True, False])
def test_a_dead_store_means_misses_and_no_failed_request(
    tmp_path: Path, public_prefixes: bool
) -> None:
    scheduler = make_scheduler(tmp_path, public_prefixes=public_prefixes)
    for index in range(4):
        scheduler.add_request(request(f"r{index}", [index, *TOKENS[1:]]))  # no local hits
        output, metadata = step(scheduler)
        assert metadata.loads == []
        assert output.num_scheduled_tokens[f"r{index}"] == PROMPT
        finish_step(scheduler, output)
    stats = connector(scheduler).stats
    assert stats.store_errors == 3  # the breaker opened
    # With public prefixes the catalogue's first read is one of the three failures (it
    # is read once a minute): one lookup fewer reaches the dead store.
    assert stats.skipped_breaker_open == (2 if public_prefixes else 1)


def test_tenant_from_kv_transfer_params_and_cache_salt_name_the_blocks(store: Store) -> None:
    scheduler = make_scheduler(store)
    put_blocks(store, scheduler, TOKENS, 3)  # alpha's blocks
    conn = connector(scheduler)
    assert conn.get_num_new_matched_tokens(request("b", TOKENS, kvshare_tenant="beta"), 0) == (
        0,
        False,
    )
    assert conn.get_num_new_matched_tokens(request("a", TOKENS, kvshare_tenant="alpha"), 0) == (
        96,
        False,
    )  # positive control: the owner's tenant hits
    salted = request("s", TOKENS)
    salted.cache_salt = "user-7"
    assert conn.get_num_new_matched_tokens(salted, 0) == (0, False)


def test_require_request_tenant_skips_requests_without_one(store: Store) -> None:
    scheduler = make_scheduler(store, require_request_tenant=True)
    put_blocks(store, scheduler, TOKENS, 3)
    conn = connector(scheduler)
    assert conn.get_num_new_matched_tokens(request("none", TOKENS), 0) == (0, False)
    tagged = request("t", TOKENS, kvshare_tenant="alpha")
    assert conn.get_num_new_matched_tokens(tagged, 0) == (96, False)


def test_finished_and_aborted_requests_leave_no_state(store: Store) -> None:
    scheduler = make_scheduler(store)
    put_blocks(store, scheduler, TOKENS, 3)
    scheduler.add_request(request("done", TOKENS))
    scheduler.add_request(request("aborted", [9] * 70))
    output, _ = step(scheduler)
    assert connector(scheduler).tracked_requests == 2
    scheduler.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    finish_step(scheduler, output)  # max_tokens=1: "done" finishes
    assert connector(scheduler).tracked_requests == 0
    waiting = request("waiting", TOKENS)
    connector(scheduler).get_num_new_matched_tokens(waiting, 0)
    scheduler.add_request(waiting)
    scheduler.finish_requests("waiting", RequestStatus.FINISHED_ABORTED)  # never scheduled
    assert connector(scheduler).tracked_requests == 0


def test_async_load_keeps_the_request_out_of_the_batch_until_it_is_in(store: Store) -> None:
    scheduler = make_scheduler(store, load_mode="async")
    digests = put_blocks(store, scheduler, TOKENS, 3)
    scheduler.add_request(request("r1", TOKENS))
    output, metadata = step(scheduler)
    assert "r1" not in output.num_scheduled_tokens  # waiting for its blocks
    (load,) = metadata.loads
    assert load.digests == tuple(digests) and load.skip_tokens == 0 and len(load.block_ids) == 6
    finish_step(scheduler, output)
    output, metadata = step(scheduler)
    assert "r1" not in output.num_scheduled_tokens and metadata.loads == []
    finish_step(scheduler, output, kv=KVConnectorOutput(finished_recving={"r1"}))
    output, metadata = step(scheduler)
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 96 and output.num_scheduled_tokens["r1"] == PROMPT - 96
    assert tuple(new.block_ids[0][:6]) == load.block_ids and metadata.loads == []


def test_async_load_after_a_local_hit_fills_only_the_blocks_past_it(store: Store) -> None:
    scheduler, output, load = after_a_local_hit(store, load_mode="async")
    assert load.skip_tokens == 16 and len(load.digests) == 3 and len(load.block_ids) == 5
    finish_step(scheduler, output, kv=KVConnectorOutput(finished_recving={"r2"}))
    output, _ = step(scheduler)
    new = next(r for r in output.scheduled_new_reqs if r.req_id == "r2")
    assert new.num_computed_tokens == 96
    assert load.block_ids == tuple(new.block_ids[0][1:6])


def test_async_load_errors_recompute_from_the_first_failed_block(store: Store) -> None:
    scheduler = make_scheduler(store, load_mode="async")
    put_blocks(store, scheduler, TOKENS, 3)
    scheduler.add_request(request("r1", TOKENS))
    output, metadata = step(scheduler)
    (load,) = metadata.loads
    failed = KVConnectorOutput(finished_recving={"r1"}, invalid_block_ids=set(load.block_ids[2:]))
    finish_step(scheduler, output, kv=failed)
    output, metadata = step(scheduler)
    (new,) = output.scheduled_new_reqs
    assert new.num_computed_tokens == 32 and metadata.loads == []  # no second load
    assert output.num_scheduled_tokens["r1"] == PROMPT - 32


def test_async_load_that_failed_entirely_is_recomputed_not_retried(store: Store) -> None:
    scheduler = make_scheduler(store, load_mode="async")
    put_blocks(store, scheduler, TOKENS, 3)
    scheduler.add_request(request("r1", TOKENS))
    output, metadata = step(scheduler)
    (load,) = metadata.loads
    failed = KVConnectorOutput(finished_recving={"r1"}, invalid_block_ids=set(load.block_ids))
    finish_step(scheduler, output, kv=failed)
    output, metadata = step(scheduler)
    assert output.num_scheduled_tokens["r1"] == PROMPT and metadata.loads == []


def test_auto_loads_before_the_forward_alone_and_off_it_beside_a_running_request(
    store: Store,
) -> None:
    """The default mode: alone, the request's load runs before this step's forward
    pass and the request starts in it; beside a decoding request, the load is
    asynchronous, so the decoding request's step does not wait for it."""
    scheduler = make_scheduler(store, load_mode="auto")
    put_blocks(store, scheduler, TOKENS, 3)
    scheduler.add_request(request("r1", TOKENS, max_tokens=10))
    output, metadata = step(scheduler)
    (load,) = metadata.loads
    assert not load.is_async and output.has_sync_kv_loads and metadata.has_forward
    assert output.num_scheduled_tokens["r1"] == PROMPT - 96  # scheduled in the same step
    finish_step(scheduler, output)
    other = [token + 1 for token in TOKENS]
    put_blocks(store, scheduler, other, 3)
    scheduler.add_request(request("r2", other))
    output, metadata = step(scheduler)
    (load,) = metadata.loads
    assert load.request_id == "r2" and load.is_async and not output.has_sync_kv_loads
    assert list(output.num_scheduled_tokens) == ["r1"]  # r1 decodes; r2 waits for its blocks
    stats = connector(scheduler)._planner.stats  # type: ignore[union-attr]
    assert (stats.loads_sync, stats.loads_async) == (1, 1)


def test_a_request_aborted_during_its_async_load_frees_its_blocks_at_the_report(
    store: Store,
) -> None:
    """The blocks stay allocated until the worker reports the load (its thread may be
    writing them); the worker is told to skip it; the report frees them; nothing of
    the request is left in the connector."""
    scheduler = make_scheduler(store, load_mode="async")
    put_blocks(store, scheduler, TOKENS, 3)
    pool = scheduler.kv_cache_manager.block_pool
    free_before = pool.get_num_free_blocks()
    scheduler.add_request(request("r1", TOKENS))
    output, metadata = step(scheduler)
    assert [plan.is_async for plan in metadata.loads] == [True]
    finish_step(scheduler, output)
    scheduler.finish_requests("r1", RequestStatus.FINISHED_ABORTED)
    assert connector(scheduler).tracked_requests == 0
    assert pool.get_num_free_blocks() < free_before  # held for the loader thread
    output, metadata = step(scheduler)
    assert metadata.cancelled == ["r1"] and metadata.loads == [] and not metadata.has_forward
    finish_step(scheduler, output, kv=KVConnectorOutput(finished_recving={"r1"}))
    assert pool.get_num_free_blocks() == free_before
    output, metadata = step(scheduler)
    assert (metadata.loads, metadata.cancelled, scheduler.requests) == ([], [], {})


def test_two_live_requests_under_one_id_are_refused_the_cache(store: Store) -> None:
    """With VLLM_DISABLE_REQUEST_ID_RANDOMIZATION two requests may share an id: neither
    loads or saves under the other's digests (positive control: the first alone hits)."""
    scheduler = make_scheduler(store)
    put_blocks(store, scheduler, TOKENS, 3)
    conn = connector(scheduler)
    first, second = request("dup", TOKENS), request("dup", [5, *TOKENS[1:]])
    assert conn.get_num_new_matched_tokens(first, 0) == (96, False)
    assert conn.get_num_new_matched_tokens(second, 0) == (0, False)
    assert conn.get_num_new_matched_tokens(first, 0) == (0, False)


def test_generated_blocks_under_preemption_are_saved_once_and_only_by_their_owner(
    store: Store,
) -> None:
    """Three requests decode in a cache too small for all, so vLLM preempts and resumes
    them: every save names blocks the request holds in that step, every digest is
    saved once, and each request's saves are digests of its own tokens."""
    scheduler = make_scheduler(store, num_blocks=24)
    prompts = {f"r{i}": [i * 7 + 1, *TOKENS[1:]] for i in range(3)}
    for request_id, prompt in prompts.items():
        scheduler.add_request(request(request_id, prompt, max_tokens=60))
    saved: dict[str, list[bytes]] = {request_id: [] for request_id in prompts}
    preempted = 0
    for _ in range(400):
        if not scheduler.requests:
            break
        output, metadata = step(scheduler)
        preempted += len(output.preempted_req_ids or ())
        for save in metadata.saves:
            held = scheduler.kv_cache_manager.get_block_ids(save.request_id)[0]
            assert set(save.block_ids) <= set(held)
            saved[save.request_id].extend(save.digests)
        finish_step(scheduler, output)
    assert not scheduler.requests and preempted > 0  # the scenario happened
    every = [digest for digests in saved.values() for digest in digests]
    assert len(every) == len(set(every))
    namespace = connector(scheduler).namespace
    for request_id, prompt in prompts.items():
        own = BlockHasher(namespace, STORE_BLOCK).digests(prompt + [7] * 60)
        assert saved[request_id] and set(saved[request_id]) <= set(own)


@pytest.mark.parametrize("save_generated", [True, False])
def test_generated_blocks_are_saved_under_the_prompt_chain(
    store: Store, save_generated: bool
) -> None:
    """Decoding past a store-block boundary saves the block holding the output, under
    the digest a later prompt with the same tokens computes."""
    scheduler = make_scheduler(store, save_generated=save_generated)
    scheduler.add_request(request("r1", TOKENS, max_tokens=40))
    saves, outputs = [], list[int]()
    for index in range(40):
        output, metadata = step(scheduler)
        saves.extend(metadata.saves)
        finish_step(scheduler, output, token=500 + index)
        outputs.append(500 + index)
    conversation = TOKENS + outputs
    digests = BlockHasher(connector(scheduler).namespace, STORE_BLOCK).digests(conversation)
    saved = [digest for save in saves for digest in save.digests]
    assert saved == (digests[:4] if save_generated else digests[:3])  # 128 tokens computed


@pytest.mark.parametrize(
    "bad",
    [{"block_tokens": 40}, {"keyring": "x"}, {"load_mode": "later"}, {"save_generated": 1}],
)
def test_bad_extra_config_fails_at_start_naming_the_key(store: Store, bad: dict[str, Any]) -> None:
    from kvcommon.errors import ConfigError

    with pytest.raises(ConfigError, match=next(iter(bad))):
        make_scheduler(store, **bad)
