"""The agent rotates its token and its keyring without a restart, and a replica whose
token the store refuses serves misses with one log line, then recovers.

A real server on 127.0.0.1:0 with a real LMDB, a real tiny transformers model whose
prefill gives the blocks, the agent's default transports. Files are rotated as an
operator does: a new file renamed over the old one.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from policy.sealing import new_key_entry
from replica_agent.adapters.hf_tiny import TinyLlama
from replica_agent.agent import ReplicaAgent
from replica_agent.breaker import CircuitBreaker
from replica_agent.credentials import KeyringFileSealer, TokenFile
from replica_agent.spec import ModelSpec
from tests.support.credential_files import write_secret
from tests.support.replicas import prefix_blocks, small_model, tiny_spec
from tests.support.servers import Running, launch, write_config

BLOCK = 8
VOCAB = 256


RW = ["read", "write"]


def token_file_at_once(path: Path) -> TokenFile:
    """Checked on every call, taken at once: the test controls when files change."""
    return TokenFile(path, check_interval_s=0.0, settle_s=0.0)


@pytest.fixture(scope="module")
def model() -> TinyLlama:
    return small_model(3)


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Running]:
    """`old` may use alpha; `new` (its replacement) alpha and beta; `writer` alpha."""
    tenancy = write_config(
        tmp_path,
        principals={
            "old": (["alpha"], RW),
            "new": (["alpha", "beta"], RW),
            "writer": (["alpha"], RW),
        },
    )
    with launch(tenancy) as running:
        yield running


def spec_of(model: TinyLlama) -> ModelSpec:
    return tiny_spec(model, BLOCK)


def computed(model: TinyLlama, prompt: list[int]) -> list[torch.Tensor]:
    return prefix_blocks(model, spec_of(model), prompt)


def prompt(seed: int) -> list[int]:
    return [(seed * 31 + i * 7) % VOCAB for i in range(3 * BLOCK)]


def test_a_rewritten_token_file_is_used_without_a_restart(
    server: Running, model: TinyLlama, tmp_path: Path
) -> None:
    token_file = tmp_path / "token"
    write_secret(token_file, server.tokens["old"])
    agent = ReplicaAgent.connect(server.address, token_file_at_once(token_file), spec_of(model))
    tokens = prompt(1)
    digests, kv = agent.digests(tokens), computed(model, tokens)
    assert agent.save("alpha", digests, kv) and agent.flush()
    assert agent.match("alpha", digests).blocks == 3
    assert agent.match("beta", digests).blocks == 0  # the old token may not use beta
    assert agent.stats.refused_calls == 1

    write_secret(token_file, server.tokens["new"])  # the same agent, the new token
    assert agent.save("beta", digests, kv) and agent.flush()
    match = agent.match("beta", digests)
    assert match.blocks == 3 and agent.stats.blocks_saved == 6
    assert all(torch.equal(a, b) for a, b in zip(agent.load(match), kv, strict=True))
    alpha = agent.match("alpha", digests)  # what the old token stored is still served
    assert all(torch.equal(a, b) for a, b in zip(agent.load(alpha), kv, strict=True))
    assert agent.stats.refused_calls == 1 and agent.stats.store_errors == 0
    agent.close()


def test_a_rotated_keyring_seals_with_its_newest_key_and_opens_what_it_lists(
    server: Running, model: TinyLlama, tmp_path: Path
) -> None:
    keyring = tmp_path / "keyring.toml"
    write_secret(keyring, new_key_entry("alpha", 1))
    sealer = KeyringFileSealer(keyring, check_interval_s=0.0, settle_s=0.0)
    agent = ReplicaAgent.connect(
        server.address, server.tokens["old"], spec_of(model), sealer=sealer
    )
    raw = server.client("writer")
    first, second = prompt(2), prompt(3)
    first_digests, second_digests = agent.digests(first), agent.digests(second)
    assert agent.save("alpha", first_digests, computed(model, first)) and agent.flush()

    write_secret(keyring, keyring.read_text() + new_key_entry("alpha", 2))  # add v2
    second_kv = computed(model, second)
    assert agent.save("alpha", second_digests, second_kv) and agent.flush()
    stored = raw.get("alpha", agent.model, [first_digests[0], second_digests[0]])
    assert [int.from_bytes(s[5:9], "big") for s in stored] == [1, 2]  # sealed under v2 now
    for digests in (first_digests, second_digests):  # v1 still listed: its blocks open
        assert len(agent.load(agent.match("alpha", digests))) == 3

    v2_only = "[[keys]]" + keyring.read_text().split("[[keys]]")[2]
    write_secret(keyring, v2_only)  # v1 retired
    retired = agent.match("alpha", first_digests)
    assert retired.blocks == 3  # the store still holds them ...
    assert len(agent.load(retired)) == 0  # ... but they open no more: a miss
    assert agent.stats.open_failures == 1
    kept = agent.load(agent.match("alpha", second_digests))  # positive control: v2 opens
    assert all(torch.equal(a, b) for a, b in zip(kept, second_kv, strict=True))
    assert agent.stats.store_errors == 0
    agent.close()


def test_a_refused_token_gives_misses_and_one_log_line_and_a_new_token_recovers(
    server: Running, model: TinyLlama, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """To the store a revoked token and one it never issued are the same: both are
    UNAUTHENTICATED on every path (the bulk channel's tickets come from a gRPC call
    that carries the token). The replica starts with such a token."""
    spec, tokens = spec_of(model), prompt(4)
    writer = ReplicaAgent.connect(server.address, server.tokens["writer"], spec)
    digests, kv = writer.digests(tokens), computed(model, tokens)
    assert writer.save("alpha", digests, kv) and writer.flush()
    writer.close()

    token_file = tmp_path / "token"
    write_secret(token_file, secrets.token_urlsafe(24))  # a token the store refuses
    # cooldown 0: every call reaches the store (and is refused): the worst case for logs
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=0.0)
    agent = ReplicaAgent.connect(
        server.address, token_file_at_once(token_file), spec, breaker=breaker
    )
    with caplog.at_level(logging.INFO, logger="replica_agent"):
        for _ in range(5):
            match = agent.match("alpha", digests)
            assert match.blocks == 0  # a miss, never an exception
            forced = type(match)("alpha", match.digests, 3, BLOCK)
            assert len(agent.load(forced)) == 0
            assert agent.save("alpha", digests, kv)
            assert agent.flush()
    refused = [r for r in caplog.records if r.levelno >= logging.INFO]
    assert len(refused) == 1, [r.getMessage() for r in refused]
    assert "UNAUTHENTICATED" in refused[0].getMessage()
    assert "token file" in refused[0].getMessage()
    assert agent.stats.blocks_saved == 0 and agent.stats.blocks_restored == 0

    caplog.clear()
    write_secret(token_file, server.tokens["writer"])
    with caplog.at_level(logging.INFO, logger="replica_agent"):
        match = agent.match("alpha", digests)
        restored = agent.load(match)
    assert match.blocks == 3
    assert all(torch.equal(a, b) for a, b in zip(restored, kv, strict=True))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == [
        f"token_file {token_file} changed: the new version is in use",
        "the store accepts this replica's token again; the cache is back",
    ]
    agent.close()
