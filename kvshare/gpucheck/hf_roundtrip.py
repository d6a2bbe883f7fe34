"""The transformers adapter through a real store on a given device: save a prompt's blocks,
restore them into a fresh cache with `restore_cache`, continue, and compare with a run
that never left the device (fp32: a full recompute; bf16: the same prefix/suffix split,
since bf16 logits depend on how a prompt is split). Used by tests/e2e/test_gpu_restore.py
and scripts/gpu_check.py on a GPU and by tests/e2e/test_agent_restore_cache.py on the CPU.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import torch

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer
from replica_agent.adapters.hf import (
    blocks_from_cache,
    greedy_continue,
    prefill,
    restore_cache,
    spec_for,
)
from replica_agent.adapters.hf_tiny import tiny_llama
from replica_agent.agent import ReplicaAgent

BLOCK_TOKENS = 16
NEW_TOKENS = 8


def restored_matches_recompute(dtype: str, device: str, *, blocks: int = 4) -> dict[str, Any]:
    model: Any = tiny_llama(0, dtype=getattr(torch, dtype))
    model.to(device)
    spec = spec_for(model, model_id="check/tiny", revision="seed0", block_tokens=BLOCK_TOKENS)
    prompt = [(31 * i + 7) % 8192 for i in range(blocks * BLOCK_TOKENS + 5)]
    with tempfile.TemporaryDirectory() as tmp:
        data_dir = Path(tmp) / "data"
        with EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=data_dir)) as server:
            token = (data_dir / "dev.token").read_text().strip()
            agent = ReplicaAgent.connect(server.address, token, spec, device=device)
            digests = agent.digests(prompt)
            _, produced = prefill(model, prompt)
            agent.save("dev", digests, blocks_from_cache(produced, spec, 0, len(digests)))
            agent.flush()
            cache, count = restore_cache(agent, agent.match("dev", digests), model)
            agent.close()
    prefix = count * BLOCK_TOKENS
    logits, cache = prefill(model, prompt, prefix_cache=cache, prefix_tokens=prefix)
    tokens = greedy_continue(model, logits, cache, NEW_TOKENS)
    if dtype == "float32":
        reference_logits, reference_cache = prefill(model, prompt)
    else:
        _, split_cache = prefill(model, prompt[:prefix])
        reference_logits, reference_cache = prefill(
            model, prompt, prefix_cache=split_cache, prefix_tokens=prefix
        )
    reference = greedy_continue(model, reference_logits, reference_cache, NEW_TOKENS)
    return {
        "dtype": dtype,
        "device": device,
        "asked": len(digests),
        "blocks": count,
        "max_logit_diff": float(torch.max(torch.abs(logits - reference_logits)).item()),
        "tokens_equal": tokens == reference,
    }
