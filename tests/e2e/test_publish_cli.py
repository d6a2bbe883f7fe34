"""`kvshare admin publish` against a real server, as an operator runs it.

The server has a public scope read by alpha; `publisher` may only publish, `engine`
reads and writes alpha. The demo's model computes the prefix's KV; a reading agent then
finds it in the catalogue and restores exactly what the model computes.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvshare.demo.replica import ReplicaSettings, demo_model
from policy.sealing import BlockSealer, Keyring, new_key_entry
from policy.types import PUBLIC
from replica_agent.adapters.hf import blocks_from_cache, prefill
from replica_agent.agent import ReplicaAgent
from replica_agent.public import PublicCatalogue, plan_chain
from tests.support.servers import Running, launch, run_cli, write_engine_files, write_public_config

pytestmark = pytest.mark.slow
BLOCK_TOKENS = 16
PREFIX = list(range(300, 300 + 3 * BLOCK_TOKENS + 5))  # three full blocks and a tail


@pytest.fixture
def deployment(tmp_path: Path) -> Iterator[tuple[Running, dict[str, Path], Path]]:
    tenancy = write_public_config(
        tmp_path,
        {"engine": (["alpha"], ["read", "write"]), "publisher": ([], ["publish"])},
        readers=("alpha",),
    )
    running = launch(tenancy)
    token_files, keyring = write_engine_files(tmp_path, tenancy.tokens)
    with keyring.open("a") as file:  # the public scope's key, beside the tenants'
        file.write(new_key_entry(PUBLIC, 1))
    try:
        yield running, token_files, keyring
    finally:
        running.stop()


def publish(running: Running, token_file: Path, keyring: Path, tokens: Path) -> list[str]:
    return [
        "admin", "publish", "--target", running.address, "--token-file", str(token_file),
        "--keyring", str(keyring), "--tokens-file", str(tokens),
        "--block-tokens", str(BLOCK_TOKENS),
    ]  # fmt: skip


def test_a_published_prefix_is_listed_and_restores_exactly(
    deployment: tuple[Running, dict[str, Path], Path], tmp_path: Path
) -> None:
    running, tokens, keyring = deployment
    ids = tmp_path / "prefix.json"
    ids.write_text(json.dumps(PREFIX))
    done = run_cli(*publish(running, tokens["publisher"], keyring, ids), timeout_s=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["blocks"] == report["new_blocks"] == 3
    assert report["catalogue_blocks"] == 3
    again = run_cli(*publish(running, tokens["publisher"], keyring, ids), timeout_s=120)
    assert json.loads(again.stdout)["new_blocks"] == 0  # found published: not computed

    model, spec = demo_model(ReplicaSettings(block_tokens=BLOCK_TOKENS))
    sealer = BlockSealer(Keyring.from_file(keyring))
    agent = ReplicaAgent.connect(running.address, tokens["engine"].read_text(), spec, sealer=sealer)
    try:
        catalogue = PublicCatalogue(agent.client, agent.gate, agent.model, sealer=sealer)
        prompt = PREFIX[: 3 * BLOCK_TOKENS] + list(range(900, 900 + 2 * BLOCK_TOKENS))
        plan = plan_chain(agent.model, BLOCK_TOKENS, prompt, catalogue.refresh())
        assert plan.public_blocks == 3
        match = agent.match(PUBLIC, plan.digests[:3])
        restored = agent.load(match)
    finally:
        agent.close()
    with torch.inference_mode():
        _, cache = prefill(model, PREFIX[: 3 * BLOCK_TOKENS])
    expected = blocks_from_cache(cache, spec, 0, 3)
    assert restored.shape[0] == 3
    for got, want in zip(restored, expected, strict=True):
        assert torch.equal(got, want)


def test_publishing_needs_the_publish_action_and_the_public_key(
    deployment: tuple[Running, dict[str, Path], Path], tmp_path: Path
) -> None:
    running, tokens, keyring = deployment
    ids = tmp_path / "prefix.json"
    ids.write_text(json.dumps(PREFIX))
    refused = run_cli(*publish(running, tokens["engine"], keyring, ids), timeout_s=120)
    assert refused.returncode == 2
    assert "publish action" in refused.stderr
    tenants_only = tmp_path / "tenants-only.toml"
    tenants_only.write_text(new_key_entry("alpha", 1))
    tenants_only.chmod(0o600)
    no_key = run_cli(*publish(running, tokens["publisher"], tenants_only, ids), timeout_s=120)
    assert no_key.returncode == 2
    assert "kvshare admin keyring --public" in no_key.stderr
    short = tmp_path / "short.json"
    short.write_text(json.dumps(PREFIX[:5]))
    too_short = run_cli(*publish(running, tokens["publisher"], keyring, short), timeout_s=120)
    assert too_short.returncode == 2 and "no full block" in too_short.stderr
