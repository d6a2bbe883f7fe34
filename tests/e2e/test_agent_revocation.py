"""A replica whose principal an operator revokes (a live reload of the server's config)
degrades to misses with one log line, never an error; a new token written to its token
file brings the cache back, without a restart of the replica.

Real server (reloading its file, as `kvshare serve --config` does), real LMDB, a real
tiny transformers model, the agent's default transport (the bulk channel's same-host
arena, which the server shuts for a revoked principal).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from replica_agent.adapters.hf import blocks_from_cache, prefill, spec_for
from replica_agent.adapters.hf_tiny import TinyLlama, tiny_llama
from replica_agent.agent import PrefixMatch, ReplicaAgent
from replica_agent.breaker import CircuitBreaker
from replica_agent.credentials import TokenFile
from tests.support.reload import Grant, LiveConfig, reload, seconds_until, start
from tests.support.servers import Running

BLOCK = 8
RW = ["read", "write"]
PROMPT = [(i * 11 + 3) % 256 for i in range(3 * BLOCK)]


def write_secret(path: Path, text: str) -> None:
    new = path.with_name(path.name + ".new")
    fd = os.open(new, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    new.replace(path)


@pytest.fixture
def live(tmp_path: Path) -> LiveConfig:
    return LiveConfig(
        tmp_path,
        {"alpha": 0},
        {"replica": Grant(["alpha"], RW), "root": Grant(["alpha"], [*RW, "admin"])},
    )


@pytest.fixture
def running(live: LiveConfig) -> Iterator[Running]:
    with start(live) as server:
        yield server


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return tiny_llama(
        9,
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_kv_heads=2,
        intermediate_size=128,
        vocab_size=256,
    )


def test_a_revoked_replica_serves_misses_with_one_log_line_and_a_new_token_recovers(
    running: Running,
    live: LiveConfig,
    model: TinyLlama,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = spec_for(model, model_id="t/tiny", revision="r1", block_tokens=BLOCK)
    token_file = tmp_path / "token"
    write_secret(token_file, running.tokens["replica"])
    tokens = TokenFile(token_file, check_interval_s=0.0, settle_s=0.0)
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=0.05)
    agent = ReplicaAgent.connect(running.address, tokens, spec, breaker=breaker)
    _, cache = prefill(model, PROMPT)
    kv = blocks_from_cache(cache, spec, 0, len(PROMPT) // BLOCK)
    digests = agent.digests(PROMPT)
    assert agent.save("alpha", digests, kv) and agent.flush()
    assert len(agent.load(agent.match("alpha", digests))) == 3  # a bulk connection is open

    del live.principals["replica"]  # revoked; its successor is issued in the same reload
    live.principals["replica-2"] = Grant(["alpha"], RW)
    live.write()
    with caplog.at_level(logging.INFO, logger="replica_agent"):
        assert reload(running, live).applied
        seconds_until(lambda: agent.match("alpha", digests).blocks == 0)
        for _ in range(5):  # a miss, a short load and a dropped save: never an error
            assert agent.match("alpha", digests).blocks == 0
            assert len(agent.load(PrefixMatch("alpha", tuple(digests), 3, BLOCK))) == 0
            assert agent.save("alpha", digests, kv) and agent.flush()
    refusals = [r.getMessage() for r in caplog.records if "UNAUTHENTICATED" in r.getMessage()]
    assert len(refusals) == 1 and "token file" in refusals[0]
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]

    caplog.clear()
    write_secret(token_file, running.tokens["replica-2"])
    with caplog.at_level(logging.INFO, logger="replica_agent"):
        seconds_until(lambda: agent.match("alpha", digests).blocks == 3)
        restored = agent.load(agent.match("alpha", digests))
    assert all(torch.equal(a, b) for a, b in zip(restored, kv, strict=True))
    assert "the store accepts this replica's token again" in caplog.text
    agent.close()
