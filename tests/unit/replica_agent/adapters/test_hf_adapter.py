"""transformers adapter: a prefix restored from blocks gives the logits of a full recompute."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM
from transformers.cache_utils import DynamicLayer

from replica_agent.adapters.hf import (
    _cache_keyword,
    blocks_from_cache,
    cache_from_blocks,
    greedy_generate,
    prefill,
    spec_for,
)
from replica_agent.adapters.hf_tiny import tiny_llama
from replica_agent.adapters.hf_weights import weights_fingerprint
from replica_agent.codec import decode_block, encode_block
from replica_agent.spec import ModelSpec

# A real (tiny) Llama: each test loads or runs it, one in a child process that pays the
# transformers import (~5 s).
pytestmark = pytest.mark.slow

BLOCK = 16
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def fp32_model() -> LlamaForCausalLM:
    return tiny_llama(0)


@pytest.fixture(scope="module")
def bf16_model() -> LlamaForCausalLM:
    return tiny_llama(0, dtype=torch.bfloat16)


def spec_of(model: LlamaForCausalLM) -> ModelSpec:
    return spec_for(model, model_id="kvshare/tiny-llama", revision="seed0", block_tokens=BLOCK)


def prompt(num_tokens: int, seed: int = 0) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 8192, (num_tokens,), generator=generator).tolist()


def restore_via_bytes(
    model: LlamaForCausalLM, token_ids: list[int], num_blocks: int
) -> DynamicCache:
    """What the agent does: compute, export blocks, encode, decode, rebuild a cache."""
    spec = spec_of(model)
    _, cache = prefill(model, token_ids)
    payloads = [encode_block(spec, b) for b in blocks_from_cache(cache, spec, 0, num_blocks)]
    blocks = [decode_block(spec, payload) for payload in payloads]
    return cache_from_blocks(blocks, spec, model.config)


@pytest.mark.parametrize(("num_blocks", "suffix"), [(1, 5), (2, 1), (3, 11), (4, 15), (2, 0)])
def test_restored_prefix_matches_full_recompute_fp32(
    fp32_model: LlamaForCausalLM, num_blocks: int, suffix: int
) -> None:
    token_ids = prompt(num_blocks * BLOCK + suffix, seed=num_blocks)
    full_logits, _ = prefill(fp32_model, token_ids)

    prefix_tokens = num_blocks * BLOCK
    restored = restore_via_bytes(fp32_model, token_ids, num_blocks)
    split_logits, _ = prefill(
        fp32_model, token_ids, prefix_cache=restored, prefix_tokens=prefix_tokens
    )
    torch.testing.assert_close(split_logits, full_logits, rtol=0, atol=1e-4)

    again = restore_via_bytes(fp32_model, token_ids, num_blocks)
    assert greedy_generate(
        fp32_model, token_ids, NEW_TOKENS, prefix_cache=again, prefix_tokens=prefix_tokens
    ) == greedy_generate(fp32_model, token_ids, NEW_TOKENS)


@pytest.mark.parametrize(("num_blocks", "suffix"), [(1, 3), (3, 7)])
def test_restored_prefix_matches_same_split_bf16(
    bf16_model: LlamaForCausalLM, num_blocks: int, suffix: int
) -> None:
    token_ids = prompt(num_blocks * BLOCK + suffix, seed=10 + num_blocks)
    prefix_tokens = num_blocks * BLOCK
    ids = torch.tensor([token_ids])

    # The straightforward split, with plain transformers calls.
    with torch.inference_mode():
        cache = DynamicCache(config=bf16_model.config)
        bf16_model(input_ids=ids[:, :prefix_tokens], cache=cache, use_cache=True)
        expected_logits = bf16_model(input_ids=ids[:, prefix_tokens:], cache=cache).logits[0, -1]
    _, prefix_cache = prefill(bf16_model, token_ids[:prefix_tokens])
    split_tokens = greedy_generate(
        bf16_model, token_ids, NEW_TOKENS, prefix_cache=prefix_cache, prefix_tokens=prefix_tokens
    )

    restored = restore_via_bytes(bf16_model, token_ids, num_blocks)
    logits, _ = prefill(bf16_model, token_ids, prefix_cache=restored, prefix_tokens=prefix_tokens)
    assert torch.equal(logits, expected_logits)
    restored = restore_via_bytes(bf16_model, token_ids, num_blocks)
    assert (
        greedy_generate(
            bf16_model, token_ids, NEW_TOKENS, prefix_cache=restored, prefix_tokens=prefix_tokens
        )
        == split_tokens
    )


def test_blocks_round_trip_through_cache(fp32_model: LlamaForCausalLM) -> None:
    spec = spec_of(fp32_model)
    _, cache = prefill(fp32_model, prompt(3 * BLOCK + 4))
    blocks = blocks_from_cache(cache, spec, 0, 3)
    assert all(b.shape == spec.block_shape and b.is_contiguous() for b in blocks)
    assert blocks_from_cache(cache, spec, 1, 2)[1].equal(blocks[2])

    rebuilt = cache_from_blocks(torch.stack(blocks), spec, fp32_model.config)
    assert rebuilt.get_seq_length() == 3 * BLOCK
    restored = blocks_from_cache(rebuilt, spec, 0, 3)
    assert all(a.equal(b) for a, b in zip(restored, blocks, strict=True))

    # Blocks are copies: extending or editing the cache leaves them unchanged.
    before = blocks[0].clone()
    layer = cache.layers[0]
    assert isinstance(layer, DynamicLayer) and layer.keys is not None
    layer.keys.zero_()
    assert blocks[0].equal(before)


def test_empty_block_list_gives_empty_cache(fp32_model: LlamaForCausalLM) -> None:
    spec = spec_of(fp32_model)
    cache = cache_from_blocks([], spec, fp32_model.config)
    token_ids = prompt(BLOCK + 3)
    logits, _ = prefill(fp32_model, token_ids, prefix_cache=cache, prefix_tokens=0)
    assert torch.equal(logits, prefill(fp32_model, token_ids)[0])


def test_adapter_rejects_mismatches(fp32_model: LlamaForCausalLM) -> None:
    spec = spec_of(fp32_model)
    token_ids = prompt(2 * BLOCK + 1)
    _, cache = prefill(fp32_model, token_ids)
    with pytest.raises(ValueError, match="cached tokens"):
        blocks_from_cache(cache, spec, 1, 2)
    with pytest.raises(ValueError, match="KV heads"):
        blocks_from_cache(cache, ModelSpec("m", "r", 8, 2, 64, "float32", BLOCK), 0, 1)
    with pytest.raises(ValueError, match="layers"):
        blocks_from_cache(cache, ModelSpec("m", "r", 4, 4, 64, "float32", BLOCK), 0, 1)
    with pytest.raises(ValueError, match="dtype"):
        blocks_from_cache(cache, ModelSpec("m", "r", 8, 4, 64, "float16", BLOCK), 0, 1)

    blocks = blocks_from_cache(cache, spec, 0, 2)
    with pytest.raises(ValueError, match="this spec needs"):
        cache_from_blocks([blocks[0].half()], spec, fp32_model.config)
    restored = cache_from_blocks(blocks, spec, fp32_model.config)
    with pytest.raises(ValueError, match="prefix_tokens"):
        prefill(fp32_model, token_ids, prefix_cache=restored, prefix_tokens=BLOCK)
    with pytest.raises(ValueError, match="exceeds"):
        prefill(fp32_model, token_ids[:BLOCK], prefix_cache=restored, prefix_tokens=2 * BLOCK)
    with pytest.raises(ValueError, match="empty"):
        prefill(fp32_model, [])


def test_spec_for_reads_the_config(fp32_model: LlamaForCausalLM) -> None:
    spec = spec_of(fp32_model)
    layout, version = spec.wire_model().rsplit(";W", 1)
    assert layout == "kvshare/tiny-llama@seed0;fp32;L8;H4;D64;B16;tp0/1"
    assert version == weights_fingerprint(fp32_model)  # the loaded weights' version
    bf16 = tiny_llama(0, dtype=torch.bfloat16, num_layers=2)
    assert spec_for(bf16, model_id="m", revision="r", block_tokens=BLOCK).dtype == "bfloat16"


def test_tiny_llama_is_deterministic_across_processes(fp32_model: LlamaForCausalLM) -> None:
    state = torch.random.get_rng_state()
    tiny_llama(1, num_layers=1)
    assert torch.equal(torch.random.get_rng_state(), state), "must not move the global RNG"

    code = (
        "import torch; from replica_agent.adapters.hf_tiny import tiny_llama; "
        "print(repr(sum(p.double().sum().item() for p in tiny_llama(0).parameters())))"
    )
    other = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    local = sum(p.double().sum().item() for p in fp32_model.parameters())
    assert float(other.stdout.strip().splitlines()[-1]) == local


def test_cache_keyword_follows_the_forward_signature(fp32_model: LlamaForCausalLM) -> None:
    class OldStyle:  # a transformers version before the rename
        def forward(self, input_ids: Any = None, past_key_values: Any = None) -> Any:
            raise NotImplementedError

    old_style: Any = OldStyle()
    assert _cache_keyword(fp32_model) == "cache"
    assert _cache_keyword(old_style) == "past_key_values"


def test_prefill_accepts_tensor_ids(fp32_model: LlamaForCausalLM) -> None:
    token_ids = prompt(BLOCK + 2)
    from_list, _ = prefill(fp32_model, token_ids)
    from_tensor, cache = prefill(fp32_model, torch.tensor([token_ids]))
    assert torch.equal(from_list, from_tensor)
    assert cache.get_seq_length() == BLOCK + 2
