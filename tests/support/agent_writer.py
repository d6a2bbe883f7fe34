"""Child process for the cross-process exactness test: compute prefixes, save them.

    python -m tests.support.agent_writer '<json args>'

Builds the same small model as the test (same seed), prefills each prompt in full,
and saves every full block through a real ReplicaAgent (sealed) to the store.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

from policy.sealing import BlockSealer, Keyring
from replica_agent.adapters.hf import blocks_from_cache, prefill, spec_for
from replica_agent.adapters.hf_tiny import tiny_llama
from replica_agent.agent import ReplicaAgent

SMALL_MODEL = {
    "num_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 4,
    "num_kv_heads": 2,
    "intermediate_size": 256,
    "vocab_size": 512,
}


def build(dtype_name: str, block_tokens: int) -> tuple[torch.nn.Module, object]:
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype_name]
    model = tiny_llama(7, dtype=dtype, **SMALL_MODEL)
    spec = spec_for(model, model_id="test/tiny", revision="seed7", block_tokens=block_tokens)
    return model, spec


def main() -> None:
    args = json.loads(sys.argv[1])
    model, spec = build(args["dtype"], args["block_tokens"])
    sealer = BlockSealer(Keyring.from_file(Path(args["keyring"])))
    agent = ReplicaAgent.connect(args["address"], args["token"], spec, sealer=sealer)  # type: ignore[arg-type]
    for prompt in args["prompts"]:
        _, cache = prefill(model, prompt)  # type: ignore[arg-type]
        digests = agent.digests(prompt)
        agent.save(args["tenant"], digests, blocks_from_cache(cache, spec, 0, len(digests)))  # type: ignore[arg-type]
    agent.flush()
    print(
        json.dumps(
            {"blocks_saved": agent.stats.blocks_saved, "store_errors": agent.stats.store_errors}
        )
    )
    agent.close()


if __name__ == "__main__":
    main()
