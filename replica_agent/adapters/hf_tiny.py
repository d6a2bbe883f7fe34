"""The demo's model: a small random-weight Llama, built from a config, never downloaded.

The demo, the GPU check and the tests run the transformers adapter
(`replica_agent.adapters.hf`) on it: the same weights in every process for the same
arguments, so two replicas (or a test and its subprocess) share blocks.
"""

from __future__ import annotations

from typing import Any, TypeAlias

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Sized for the demo on 2 CPU cores: ~2.5k prompt tokens/s, ~40M params, and 32 KiB of
# fp32 KV per token (8 layers x 2 x 4 heads x 64 dims x 4 bytes), so a 256-token fp32
# block is 8 MiB of payload (+ the codec's 64-byte header).
TINY_LLAMA_DEFAULTS: dict[str, int] = {
    "num_layers": 8,
    "hidden_size": 512,
    "num_attention_heads": 8,
    "num_kv_heads": 4,
    "intermediate_size": 2048,
    "vocab_size": 8192,
    "max_position_embeddings": 16384,
}


# What `tiny_llama` builds, named here so that callers outside the engine adapters
# (the demo) can type it without importing transformers themselves.
TinyLlama: TypeAlias = LlamaForCausalLM


def tiny_llama(
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    num_layers: int = TINY_LLAMA_DEFAULTS["num_layers"],
    hidden_size: int = TINY_LLAMA_DEFAULTS["hidden_size"],
    num_attention_heads: int = TINY_LLAMA_DEFAULTS["num_attention_heads"],
    num_kv_heads: int = TINY_LLAMA_DEFAULTS["num_kv_heads"],
    intermediate_size: int = TINY_LLAMA_DEFAULTS["intermediate_size"],
    vocab_size: int = TINY_LLAMA_DEFAULTS["vocab_size"],
    max_position_embeddings: int = TINY_LLAMA_DEFAULTS["max_position_embeddings"],
) -> LlamaForCausalLM:
    """A random-weight Llama, the same in every process for the same arguments.

    Built from a config, never downloaded. Weights are drawn in fp32 under `seed`
    (without disturbing the caller's global RNG) and then cast, so the bf16 model is
    the rounding of the fp32 one. Returns a `LlamaForCausalLM` in eval mode.
    """
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # sdpa is ~2x faster than eager on CPU and as exact for a split prefill.
    model.set_attn_implementation("sdpa")
    # Through Any: transformers' decorated `to`/`eval` carry signatures mypy misreads.
    untyped: Any = model
    untyped.to(dtype=dtype).eval()
    return model
