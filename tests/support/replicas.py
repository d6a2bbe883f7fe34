"""A replica's model for the agent tests: a small random-weight Llama
(replica_agent.adapters.hf_tiny), its spec under one model id and revision, and the KV
blocks its prefill computes."""

from __future__ import annotations

import torch

from replica_agent.adapters.hf import blocks_from_cache, prefill, spec_for
from replica_agent.adapters.hf_tiny import TinyLlama, tiny_llama
from replica_agent.spec import ModelSpec

MODEL_ID = "t/tiny"
REVISION = "r1"


def small_model(seed: int, *, vocab_size: int = 256) -> TinyLlama:
    """Two layers, 64 wide, 4 heads over 2 KV heads: seconds to build and run on a CPU."""
    return tiny_llama(
        seed,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=vocab_size,
    )


def tiny_spec(model: TinyLlama, block_tokens: int, weight_version: str | None = None) -> ModelSpec:
    return spec_for(
        model,
        model_id=MODEL_ID,
        revision=REVISION,
        block_tokens=block_tokens,
        weight_version=weight_version,
    )


def prefix_blocks(model: TinyLlama, spec: ModelSpec, prompt: list[int]) -> list[torch.Tensor]:
    """The KV blocks of `prompt`'s full blocks, from the model's prefill."""
    _, cache = prefill(model, prompt)
    return blocks_from_cache(cache, spec, 0, len(prompt) // spec.block_tokens)
