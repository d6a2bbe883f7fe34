"""`kvshare admin delete-model` against a real server, as an operator retires a weight
version: every tensor-parallel shard of that version goes; other versions and other
tenants stay (the positive controls); a non-admin and a malformed namespace get one line.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from tests.support.servers import Running, run_cli

NAMESPACE = "t/tiny@r1;fp32;L2;H2;D8;B4;tp1/2;Wstep-200"  # as a replica of v200 names it
SHARDS = ["t/tiny@r1;fp32;L2;H2;D8;B4;tp0/2", "t/tiny@r1;fp32;L2;H2;D8;B4;tp1/2"]
DIGESTS = [bytes([i]) * 32 for i in range(2)]
BLOCK = b"kv" * 512


def token_file(running: Running, tmp_path: Path, who: str) -> Path:
    path = tmp_path / f"{who}.token"
    path.write_text(running.tokens[who])
    path.chmod(0o600)
    return path


def held(running: Running, tenant: str, namespace: str) -> int:
    with running.client("root", transport="grpc") as client:
        return client.lookup(tenant, namespace, DIGESTS)


def test_delete_model_removes_one_weight_version_of_every_shard(
    start_server: Callable[..., Running], tmp_path: Path
) -> None:
    running = start_server()  # principals a (alpha), b (beta), root (admin of both)
    with running.client("root", transport="grpc") as client:
        for tenant in ("alpha", "beta"):
            for shard in SHARDS:
                for version in ("step-100", "step-200"):
                    client.put(tenant, f"{shard};W{version}", DIGESTS, [BLOCK, BLOCK])
    args = [
        "admin", "delete-model", "--address", running.address,
        "--token-file", str(token_file(running, tmp_path, "root")),
        "--tenant", "alpha", "--namespace", NAMESPACE, "--weight-version", "step-100",
    ]  # fmt: skip
    done = run_cli(*args)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["namespaces"] == [f"{shard};Wstep-100" for shard in SHARDS]
    assert report["deleted_blocks"] == 4
    for shard in SHARDS:
        assert held(running, "alpha", f"{shard};Wstep-100") == 0
        assert held(running, "alpha", f"{shard};Wstep-200") == 2  # the serving version stays
        assert held(running, "beta", f"{shard};Wstep-100") == 2  # another tenant's stays

    refused = run_cli(*args[:4], "--token-file", str(token_file(running, tmp_path, "a")), *args[6:])
    assert refused.returncode == 1
    assert refused.stderr.startswith("kvshare admin delete-model: PERMISSION_DENIED")
    assert len(refused.stderr.strip().splitlines()) == 1
    assert held(running, "alpha", f"{SHARDS[0]};Wstep-200") == 2

    malformed = run_cli(*args[:9], "not-a-namespace")
    assert malformed.returncode == 2
    assert "copy it from a replica" in malformed.stderr
    assert len(malformed.stderr.strip().splitlines()) == 1
