"""A replica whose principal an operator revokes (a live reload of the server's config)
degrades to misses with one log line, never an error; a new token written to its token
file brings the cache back, without a restart of the replica.

Real server (reloading its file, as `kvshare serve --config` does), real LMDB, a real
tiny transformers model, the agent's default transport (the bulk channel's same-host
arena, which the server shuts for a revoked principal).
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from replica_agent.adapters.hf_tiny import TinyLlama
from replica_agent.agent import PrefixMatch, ReplicaAgent
from replica_agent.breaker import CircuitBreaker
from replica_agent.credentials import TokenFile
from tests.support.credential_files import write_secret
from tests.support.reload import Grant, LiveConfig, reload, seconds_until
from tests.support.replicas import prefix_blocks, small_model, tiny_spec
from tests.support.servers import Running

BLOCK = 8
RW = ["read", "write"]
PROMPT = [(i * 11 + 3) % 256 for i in range(3 * BLOCK)]


@pytest.fixture
def live(tmp_path: Path) -> LiveConfig:
    return LiveConfig(
        tmp_path,
        {"alpha": 0},
        {"replica": Grant(["alpha"], RW), "root": Grant(["alpha"], [*RW, "admin"])},
    )


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return small_model(9)


def test_a_revoked_replica_serves_misses_with_one_log_line_and_a_new_token_recovers(
    running: Running,
    live: LiveConfig,
    model: TinyLlama,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    spec = tiny_spec(model, BLOCK)
    token_file = tmp_path / "token"
    write_secret(token_file, running.tokens["replica"])
    tokens = TokenFile(token_file, check_interval_s=0.0, settle_s=0.0)
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=0.05)
    agent = ReplicaAgent.connect(running.address, tokens, spec, breaker=breaker)
    kv = prefix_blocks(model, spec, PROMPT)
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
