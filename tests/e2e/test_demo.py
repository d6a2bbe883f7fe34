"""`kvshare demo` and the failure modes the agent must absorb, on real processes."""

from __future__ import annotations

import hashlib
import json
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from cacheserver.tiers import PendingWrite
from cacheserver.tiers.lmdb.tier import LmdbTier
from kvshare.demo.replica import Replica, ReplicaSettings, StoreSettings, demo_model
from kvshare.demo.runner import DemoOptions, StoreHandle, run_demo, write_keyring
from kvshare.demo.workload import DemoRequest, WorkloadShape, build_workload
from policy.sealing import BlockSealer, Keyring
from policy.types import StorageKey, TenantId
from tests.support.repo import REPO
from tests.support.servers import ServerProcess

pytestmark = pytest.mark.slow
TENANTS = ["tenant-0", "tenant-1", "tenant-2"]


def demo_config(tmp_path: Path) -> tuple[Path, str]:
    token = secrets.token_urlsafe(24)
    lines = [f'data_dir = "{tmp_path / "data"}"']
    for tenant in TENANTS:
        lines += ["[[tenants]]", f'id = "{tenant}"']
    lines += [
        "[[principals]]",
        'name = "replicas"',
        f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"',
        f"tenants = {json.dumps(TENANTS)}",
        'actions = ["read", "write"]',
    ]
    path = tmp_path / "demo.toml"
    path.write_text("\n".join(lines) + "\n")
    return path, token


def test_demo_json_contract_and_the_gain_of_the_shared_store() -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvshare.cli",
            "demo",
            "--replicas",
            "4",
            "--requests",
            "40",
            "--json",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert set(report) == {"replicas", "requests", "runs", "outputs_identical"}
    assert report["replicas"] == 4 and report["requests"] == 40
    local, shared = report["runs"]["local_only"], report["runs"]["shared_store"]
    keys = {"token_hit_rate", "ttft_p50_s", "ttft_p95_s", "prefill_tokens"}
    assert set(local) == keys
    assert set(shared) == keys | {"local_hit_rate", "store_hit_rate"}
    assert report["outputs_identical"] is True
    # Hit rates are counts, not timings: deterministic for the seeded workload.
    assert shared["token_hit_rate"] >= local["token_hit_rate"] + 0.15
    assert shared["prefill_tokens"] < local["prefill_tokens"]
    assert shared["local_hit_rate"] + shared["store_hit_rate"] == pytest.approx(
        shared["token_hit_rate"], abs=1e-3
    )


def test_requests_complete_while_the_store_is_killed_and_hit_again_once_back(
    tmp_path: Path,
) -> None:
    config, token = demo_config(tmp_path)
    server = ServerProcess("--config", str(config), "--listen", "127.0.0.1:0")
    port = server.address.rsplit(":", 1)[1]
    state = {"server": server}

    def chaos(run: str, index: int) -> None:
        if run != "shared_store":
            return
        if index == 8:
            state["server"].kill9()
        if index == 16:
            state["server"] = ServerProcess(
                "--config", str(config), "--listen", f"127.0.0.1:{port}"
            )

    store = StoreHandle(server.address, token, write_keyring(tmp_path, TENANTS))
    options = DemoOptions(replicas=2, requests=36)
    try:
        result = run_demo(options, store=store, hook=chaos)
    finally:
        state["server"].terminate()
    shared = result.shared.results
    assert len(shared) == 36  # every request completed
    assert result.outputs_identical
    assert sum(r.store_tokens for r in shared[:8]) > 0  # positive control: hits before
    assert sum(r.store_tokens for r in shared[9:16]) == 0  # store down: recomputed
    assert sum(r.store_tokens for r in shared[24:]) > 0  # served again once it is back


def test_a_block_corrupted_on_the_server_is_rejected_and_recomputed(tmp_path: Path) -> None:
    config, token = demo_config(tmp_path)
    keyring = write_keyring(tmp_path, TENANTS)
    shape = WorkloadShape(tenants=1)
    request = build_workload(1, shape)[0]
    server = ServerProcess("--config", str(config), "--listen", "127.0.0.1:0")
    store = StoreSettings(server.address, token, keyring)
    writer = Replica(0, ReplicaSettings())
    writer.configure(store)
    expected = writer.serve(request)
    writer.flush()
    server.terminate()

    tamper_one_stored_block(tmp_path / "data" / "lmdb", index=3)

    server = ServerProcess("--config", str(config), "--listen", "127.0.0.1:0")
    try:
        reader = Replica(1, ReplicaSettings())
        reader.configure(StoreSettings(server.address, token, keyring))
        got = reader.serve(
            DemoRequest(1, request.tenant, "s", request.token_ids, request.max_new_tokens)
        )
        assert reader.agent is not None
        assert reader.agent.stats.open_failures == 1
        assert got.output_tokens == expected.output_tokens
        assert 0 < got.store_tokens < len(request.token_ids) - 32  # stopped at the bad block
        assert got.prefill_tokens > expected.prompt_tokens - got.store_tokens - 1
    finally:
        server.terminate()


def tamper_one_stored_block(lmdb_dir: Path, index: int) -> None:
    """What a compromised store could do: rewrite a block with a valid at-rest checksum."""
    tier = LmdbTier(lmdb_dir, map_bytes=1 << 30, sync_writes=True)
    try:
        metas = sorted(tier.scan(), key=lambda m: m.clock)
        victim = metas[index]
        payload = bytearray(tier.read_many([victim.key])[0] or b"")
        payload[len(payload) // 2] ^= 0x40
        tier.delete([victim.key])
        tier.write(
            [
                PendingWrite(
                    StorageKey(victim.key),
                    TenantId(victim.tenant),
                    victim.epoch,
                    victim.clock,
                    bytes(payload),
                    victim.model_tag,
                )
            ],
            [],
        )
    finally:
        tier.close()


def test_sealed_demo_blocks_open_only_for_their_tenant(tmp_path: Path) -> None:
    keyring = Keyring.from_file(write_keyring(tmp_path, TENANTS))
    sealer = BlockSealer(keyring)
    sealed = sealer.seal("tenant-0", "m", b"d" * 32, b"kv bytes")
    assert sealer.open("tenant-0", "m", b"d" * 32, sealed) == b"kv bytes"
    with pytest.raises(Exception, match="cannot be opened"):
        sealer.open("tenant-1", "m", b"d" * 32, sealed)


def test_a_published_framework_prompt_is_stored_once_and_outputs_stay_identical() -> None:
    """`--public-prefix`: the third run publishes the prompt every tenant's requests
    begin with; its store holds it once instead of once per tenant, every tenant's
    first request finds it, and every output is the same as without any store."""
    options = DemoOptions(replicas=2, requests=12, public_prefix=128)
    result = run_demo(options)
    report = result.report()
    assert report["outputs_identical"] is True
    shared, public = report["runs"]["shared_store"], report["runs"]["public_scope"]
    stored = report["public_prefix"]["stored_bytes"]
    tenants_seen = len({r.tenant for r in build_workload(12, options.shape)})
    settings = ReplicaSettings()
    _, spec = demo_model(settings)
    # The prompt's 4 blocks: stored by each tenant that sent a request, vs once.
    copies_saved = (tenants_seen - 1) * (128 // settings.block_tokens)
    assert tenants_seen > 1
    assert (
        stored["shared_store"] - stored["public_scope"] >= copies_saved * spec.block_payload_bytes
    )
    assert public["prefill_tokens"] < shared["prefill_tokens"]  # first turns hit it too
    assert report["public_prefix"]["tokens"] == 128
