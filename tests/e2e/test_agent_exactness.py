"""A prefix restored from the store, written by another process, gives the same output.

fp32: logits within 1e-4 of a full recompute and identical greedy tokens. bf16: greedy
tokens equal those of a bf16 run with the same prefix/suffix split.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from policy.sealing import BlockSealer, Keyring, new_key_entry
from replica_agent.adapters.hf import cache_from_blocks, greedy_continue, prefill
from replica_agent.agent import ReplicaAgent
from tests.support.agent_writer import build
from tests.support.repo import REPO
from tests.support.servers import Running, launch, write_config

pytestmark = pytest.mark.slow  # every test here takes seconds

BLOCK_TOKENS = 16
SUFFIXES = [1, 5, 11]


def prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [
        [rng.randrange(512) for _ in range(blocks * BLOCK_TOKENS + suffix)]
        for blocks in (1, 2, 3, 4)
        for suffix in SUFFIXES
    ]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[tuple[Running, Path]]:
    tenancy = write_config(tmp_path)
    keyring = tmp_path / "keyring.toml"
    keyring.write_text(new_key_entry("alpha", 1))
    keyring.chmod(0o600)
    with launch(tenancy) as running:
        yield running, keyring


def write_from_another_process(running: Running, keyring: Path, dtype: str) -> None:
    args = {
        "address": running.address,
        "token": running.tokens["a"],
        "keyring": str(keyring),
        "dtype": dtype,
        "block_tokens": BLOCK_TOKENS,
        "prompts": prompts(),
        "tenant": "alpha",
    }
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.agent_writer", json.dumps(args)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["store_errors"] == 0
    assert report["blocks_saved"] == sum(len(p) // BLOCK_TOKENS for p in prompts())


@dataclass
class Reader:
    agent: ReplicaAgent
    model: Any

    def restored(self, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Logits and 8 greedy tokens with every full block restored from the store."""
        digests = self.agent.digests(prompt)
        match = self.agent.match("alpha", digests)
        assert match.blocks == len(digests)  # the other process's blocks are all there
        blocks = self.agent.load(match)
        assert blocks.shape[0] == len(digests)
        cache = cache_from_blocks(blocks, self.agent.spec, self.model.config)
        logits, cache = prefill(self.model, prompt, prefix_cache=cache, prefix_tokens=match.tokens)
        return logits, greedy_continue(self.model, logits, cache, 8)


def reader(running: Running, keyring: Path, dtype: str) -> Reader:
    model, spec = build(dtype, BLOCK_TOKENS)
    agent = ReplicaAgent.connect(
        running.address,
        running.tokens["a"],
        spec,  # type: ignore[arg-type]
        sealer=BlockSealer(Keyring.from_file(keyring)),
    )
    return Reader(agent, model)


def test_fp32_restore_matches_full_recompute(store: tuple[Running, Path]) -> None:
    running, keyring = store
    write_from_another_process(running, keyring, "float32")
    read = reader(running, keyring, "float32")
    model = read.model
    for prompt in prompts():
        logits, tokens = read.restored(prompt)
        full_logits, full_cache = prefill(model, prompt)
        assert torch.max(torch.abs(logits - full_logits)).item() < 1e-4
        assert tokens == greedy_continue(model, full_logits, full_cache, 8)
    assert read.agent.stats.open_failures == 0 and read.agent.stats.blocks_restored > 0
    read.agent.close()


def test_bf16_restore_matches_a_bf16_run_with_the_same_split(store: tuple[Running, Path]) -> None:
    running, keyring = store
    write_from_another_process(running, keyring, "bfloat16")
    read = reader(running, keyring, "bfloat16")
    model = read.model
    for prompt in prompts():
        _, tokens = read.restored(prompt)
        split = len(prompt) // BLOCK_TOKENS * BLOCK_TOKENS
        _, prefix_cache = prefill(model, prompt[:split])
        logits, cache = prefill(
            model,
            prompt,
            prefix_cache=prefix_cache,
            prefix_tokens=split,
        )
        assert tokens == greedy_continue(model, logits, cache, 8)
    read.agent.close()
