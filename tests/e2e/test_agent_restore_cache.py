"""`restore_cache`: blocks from the store written straight into a transformers cache's
layers give the logits of a full recompute, and a shorter restore keeps only what it
holds. Real server, real agent, a small random-weight Llama on the CPU."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM
from transformers.cache_utils import Cache, DynamicLayer

from kvshare.gpucheck.hf_roundtrip import restored_matches_recompute
from replica_agent.adapters.hf import (
    blocks_from_cache,
    cache_from_blocks,
    layer_devices,
    prefill,
    restore_cache,
    spec_for,
)
from replica_agent.adapters.hf_tiny import tiny_llama
from replica_agent.agent import ReplicaAgent
from tests.support.servers import Running

BLOCK = 8


def filled_keys_values(cache: Cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's keys and values; every layer is a filled full-attention one."""
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        assert isinstance(layer, DynamicLayer), type(layer)
        assert layer.keys is not None and layer.values is not None
        kv.append((layer.keys, layer.values))
    return kv


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    return tiny_llama(1, num_layers=2, hidden_size=128, intermediate_size=256, vocab_size=512)


def saved_prompt(agent: ReplicaAgent, model: LlamaForCausalLM, tokens: list[int]) -> list[bytes]:
    _, cache = prefill(model, tokens)
    digests = agent.digests(tokens)
    assert agent.save("dev", digests, blocks_from_cache(cache, agent.spec, 0, len(digests)))
    agent.flush()
    return digests


def test_a_cache_restored_in_place_gives_the_logits_of_a_full_recompute(
    dev_server: Running, model: LlamaForCausalLM
) -> None:
    spec = spec_for(model, model_id="t/tiny", revision="r", block_tokens=BLOCK)
    agent = ReplicaAgent(dev_server.client(), spec)
    tokens = [(7 * i) % 512 for i in range(4 * BLOCK + 3)]
    digests = saved_prompt(agent, model, tokens)
    cache, count = restore_cache(agent, agent.match("dev", digests), model)
    assert count == 4 and int(cache.get_seq_length()) == 4 * BLOCK
    logits, _ = prefill(model, tokens, prefix_cache=cache, prefix_tokens=4 * BLOCK)
    full, _ = prefill(model, tokens)
    assert torch.max(torch.abs(logits - full)).item() < 1e-5
    agent.close()


def test_a_shorter_restore_keeps_only_the_blocks_it_holds(
    dev_server: Running, model: LlamaForCausalLM
) -> None:
    spec = spec_for(model, model_id="t/tiny", revision="r", block_tokens=BLOCK)
    agent = ReplicaAgent(dev_server.client(), spec)
    tokens = [(11 * i) % 512 for i in range(4 * BLOCK + 1)]
    digests = saved_prompt(agent, model, tokens)
    match = agent.match("dev", digests)
    agent.client.delete("dev", agent.model, digests[2:])  # evicted after the match
    cache, count = restore_cache(agent, match, model)
    assert count == 2 and int(cache.get_seq_length()) == 2 * BLOCK
    for keys, _ in filled_keys_values(cache):
        per_layer = keys.numel() * keys.element_size()
        assert keys.untyped_storage().nbytes() == per_layer  # not a view of 4 blocks
    logits, _ = prefill(model, tokens, prefix_cache=cache, prefix_tokens=2 * BLOCK)
    full, _ = prefill(model, tokens)
    assert torch.max(torch.abs(logits - full)).item() < 1e-5
    agent.close()


def test_a_miss_gives_an_empty_cache(dev_server: Running, model: LlamaForCausalLM) -> None:
    spec = spec_for(model, model_id="t/tiny", revision="r", block_tokens=BLOCK)
    agent = ReplicaAgent(dev_server.client(), spec)
    digests = agent.digests(list(range(2 * BLOCK)))
    cache, count = restore_cache(agent, agent.match("dev", digests), model)
    assert count == 0 and int(cache.get_seq_length()) == 0
    agent.close()


def test_cache_from_blocks_puts_each_layer_on_its_device(model: LlamaForCausalLM) -> None:
    spec = spec_for(model, model_id="t/tiny", revision="r", block_tokens=BLOCK)
    _, full = prefill(model, list(range(2 * BLOCK)))
    blocks = blocks_from_cache(full, spec, 0, 2)
    devices = layer_devices(model)
    assert devices == [torch.device("cpu")] * spec.num_layers
    cache = cache_from_blocks(blocks, spec, model.config, devices=devices)
    assert [keys.device for keys, _ in filled_keys_values(cache)] == devices
    with pytest.raises(ValueError, match="one per layer"):
        cache_from_blocks(blocks, spec, model.config, devices=devices[:1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_gpu_checks_adapter_scenario_passes_on_the_cpu(dtype: str) -> None:
    """The scenario scripts/gpu_check.py runs on a GPU, proven here on the CPU."""
    result = restored_matches_recompute(dtype, "cpu")
    assert result["blocks"] == result["asked"] == 4 and result["tokens_equal"], result
    if dtype == "float32":
        assert result["max_logit_diff"] < 1e-4
