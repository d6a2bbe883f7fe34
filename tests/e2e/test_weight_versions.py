"""A block's identity includes the weights that computed it: replicas of one model id
and revision whose weights differ never load each other's blocks, and a replica whose
weight version is missing finds nothing of a versioned one (a miss, not a guess).

Real server on 127.0.0.1:0 with a real LMDB, real tiny transformers models, and the
engine adapters' store layers (vLLM's worker store, SGLang's page store) with the
namespaces their settings and the engine's layout give (no engine: tests/vllm and
tests/sglang run the engines).
"""

from __future__ import annotations

import copy
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvcommon.errors import ConfigError
from replica_agent.adapters.hf_tiny import TinyLlama
from replica_agent.adapters.hf_weights import weights_fingerprint
from replica_agent.adapters.settings import parse_store_settings
from replica_agent.adapters.sglang_pages import HostPages, PageStore, namespace_spec
from replica_agent.adapters.vllm_layout import ConcatLastDim
from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.adapters.vllm_options import engine_spec
from replica_agent.adapters.vllm_store import PagedCache, WorkerStore
from replica_agent.agent import PrefixMatch, ReplicaAgent
from replica_agent.breaker import CircuitBreaker
from replica_agent.gate import StoreGate, StoreStats
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry
from tests.support.replicas import prefix_blocks, small_model, tiny_spec
from tests.support.servers import Running

BLOCK = 8
VOCAB = 256


PROMPT = [(i * 13 + 5) % VOCAB for i in range(3 * BLOCK)]


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return small_model(5)


def fine_tuned(model: TinyLlama) -> TinyLlama:
    """The same architecture, config, id and revision; one matrix moved a little, as a
    fine-tune pushed again under the same revision moves its weights."""
    tuned = copy.deepcopy(model)
    with torch.no_grad():
        tuned.model.layers[1].self_attn.q_proj.weight.add_(1e-3)
    return tuned


def agent_for(server: Running, spec: ModelSpec) -> ReplicaAgent:
    return ReplicaAgent(server.client("engine"), spec)


def save_prefix(server: Running, model: TinyLlama, spec: ModelSpec) -> list[torch.Tensor]:
    writer = agent_for(server, spec)
    kv = prefix_blocks(model, spec, PROMPT)
    assert writer.save("alpha", writer.digests(PROMPT), kv) and writer.flush()
    writer.close()
    return kv


def loaded(server: Running, spec: ModelSpec) -> tuple[int, int]:
    """(blocks matched, blocks loaded even when the match is forced to all of them)."""
    reader = agent_for(server, spec)
    digests = reader.digests(PROMPT)
    matched = reader.match("alpha", digests).blocks
    forced = reader.load(PrefixMatch("alpha", tuple(digests), len(digests), BLOCK))
    reader.close()
    return matched, len(forced)


def spec_of(model: TinyLlama, weight_version: str | None = None) -> ModelSpec:
    return tiny_spec(model, BLOCK, weight_version)


def test_a_fine_tune_under_the_same_revision_never_loads_the_old_weights_blocks(
    server: Running, model: TinyLlama
) -> None:
    kv = save_prefix(server, model, spec_of(model))
    same_weights = small_model(5)  # another replica loading the same checkpoint
    assert spec_of(same_weights) == spec_of(model)
    reader = agent_for(server, spec_of(same_weights))
    match = reader.match("alpha", reader.digests(PROMPT))
    restored = reader.load(match)  # positive control: same weights, same blocks
    assert all(torch.equal(a, b) for a, b in zip(restored, kv, strict=True))
    reader.close()

    tuned = fine_tuned(model)
    assert loaded(server, spec_of(tuned)) == (0, 0)
    assert spec_of(tuned).weight_version != spec_of(model).weight_version


def test_explicit_weight_versions_never_mix_and_a_missing_one_is_a_miss(
    server: Running, model: TinyLlama
) -> None:
    save_prefix(server, model, spec_of(model, "step-100"))
    assert loaded(server, spec_of(model, "step-100")) == (3, 3)  # positive control
    assert loaded(server, spec_of(model, "step-200")) == (0, 0)
    unversioned = spec_of(model, "")  # a replica that does not say which weights it has
    assert unversioned.wire_model() == spec_of(model, "step-100").wire_model().rsplit(";", 1)[0]
    assert loaded(server, unversioned) == (0, 0)


def test_weights_that_are_not_loaded_have_no_version_to_guess() -> None:
    with torch.device("meta"):
        empty = small_model(5)
    with pytest.raises(ValueError, match="pass weight_version explicitly"):
        weights_fingerprint(empty)
    with pytest.raises(ValueError, match="weight_version"):
        ModelSpec("t/tiny", "r1", 2, 2, 16, "float32", weight_version="v 1;x")


def settings(server: Running, tmp_path: Path, weight_version: str | None) -> Any:
    token = tmp_path / f"token-{weight_version}"
    token.write_text(server.tokens["engine"])
    token.chmod(0o600)
    raw = {"target": server.address, "token_file": str(token), "tenant": "alpha"}
    if weight_version is not None:
        raw["weight_version"] = weight_version
    return parse_store_settings(raw, source="test")


def vllm_config() -> SimpleNamespace:
    """The fields of vLLM's config that engine_spec reads (a real engine: tests/vllm)."""
    model = SimpleNamespace(
        dtype=torch.float32,
        served_model_name=["t/tiny"],
        model="/models/tiny",
        revision="r1",
        get_num_layers=lambda parallel: 2,
        get_num_kv_heads=lambda parallel: 2,
        get_head_size=lambda: 8,
    )
    return SimpleNamespace(
        model_config=model,
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )


VLLM_BLOCK, CACHE_BLOCKS, DIGESTS = 16, 4, (bytes(range(32)), bytes(range(1, 33)))


def vllm_worker(server: Running, tmp_path: Path, version: str | None) -> WorkerStore:
    s = settings(server, tmp_path, version)
    spec = engine_spec(vllm_config(), s.model, 32, weight_version=s.weight_version)
    gate = StoreGate(CircuitBreaker(), AgentTelemetry(), StoreStats())
    return WorkerStore(s.connect(), spec, sealer=s.sealer(), gate=gate, save_queue_bytes=1 << 30)


def paged(fill: bool) -> PagedCache:
    make = torch.randn if fill else torch.zeros
    layers = tuple(make(CACHE_BLOCKS, 2, VLLM_BLOCK, 16) for _ in range(2))
    return PagedCache(layers, ConcatLastDim(VLLM_BLOCK, 2, 8), VLLM_BLOCK)


def vllm_loads(server: Running, tmp_path: Path, version: str | None) -> int:
    store = vllm_worker(server, tmp_path, version)
    failed = store.load(paged(False), LoadPlan("r2", "alpha", DIGESTS, 0, (0, 1, 2, 3)))
    store.close(flush_timeout_s=1)
    return 2 - len(failed) // 2


def test_the_vllm_connectors_weight_version_setting_separates_its_blocks(
    server: Running, tmp_path: Path
) -> None:
    """Same digests on purpose: even a chain that agreed would name other blocks."""
    writer = vllm_worker(server, tmp_path, "v1")
    writer.save(paged(True), SavePlan("r1", "alpha", DIGESTS, (0, 1, 2, 3)))
    writer.close(flush_timeout_s=30)
    assert writer.stats.blocks_saved == 2
    assert vllm_loads(server, tmp_path, "v1") == 2  # positive control
    assert vllm_loads(server, tmp_path, "v2") == 0
    assert vllm_loads(server, tmp_path, None) == 0  # no version: a miss


def sglang_store(server: Running, tmp_path: Path, version: str | None) -> PageStore:
    s = settings(server, tmp_path, version)
    config = SimpleNamespace(
        model_name="t/tiny", tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0
    )
    config.attn_cp_size = 1
    pool = SimpleNamespace(
        dtype=torch.float32, head_dim=8, v_head_dim=8, layer_num=2, head_num=2, page_size=BLOCK
    )
    spec = namespace_spec(config, pool, s.model, s.weight_version)
    gate = StoreGate(CircuitBreaker(), AgentTelemetry(), StoreStats())
    return PageStore(s.connect(), spec, s.tenant, sealer=s.sealer(), gate=gate)


def host_pages(store: PageStore, fill: bool) -> HostPages:
    """An SGLang page_first host buffer [2, tokens, layers, heads, dim] of 4 pages."""
    make = torch.randn if fill else torch.zeros
    return HostPages(make(2, 4 * BLOCK, 2, 2, 8), "page_first", store.spec)


def sglang_loads(server: Running, tmp_path: Path, version: str | None) -> int:
    store = sglang_store(server, tmp_path, version)
    target = host_pages(store, fill=False)
    done = store.load(DIGESTS, [target.page(i * BLOCK) for i in range(2)])
    store.close()
    return sum(done)


def test_the_sglang_backends_weight_version_setting_separates_its_pages(
    server: Running, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="weight_version"):
        settings(server, tmp_path, "v1;L9")  # a version cannot fake the layout's fields
    writer = sglang_store(server, tmp_path, "v1")
    source = host_pages(writer, fill=True)
    assert writer.save(DIGESTS, [source.page(i * BLOCK) for i in range(2)]) == [True, True]
    writer.close()
    assert sglang_loads(server, tmp_path, "v1") == 2  # positive control
    assert sglang_loads(server, tmp_path, "v2") == 0
    assert sglang_loads(server, tmp_path, None) == 0  # no version: a miss
