"""`kvshare stats`: per-tenant usage of the tenants the caller may see, as a table or JSON."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.support.servers import launch, run_cli, write_config

pytestmark = pytest.mark.slow  # every test here takes seconds

MODEL = "obs/model@r1;fp32;L2;H2;D8;B4;tp0/1"


def test_stats_shows_only_visible_tenants_with_hit_rate_and_bytes(tmp_path: Path) -> None:
    tenancy = write_config(tmp_path)
    token_file = tmp_path / "a.token"
    token_file.write_text(tenancy.tokens["a"] + "\n")
    digests = [os.urandom(32) for _ in range(4)]
    with launch(tenancy) as running:
        with running.client("a") as a, running.client("b") as b:
            a.put("alpha", MODEL, digests[:3], [b"x" * 1000] * 3)
            assert a.lookup("alpha", MODEL, digests) == 3  # 3 of 4 digests present
            assert a.get("alpha", MODEL, digests[:2]) == [b"x" * 1000] * 2
            b.put("beta", MODEL, digests[:1], [b"y" * 500])

        as_a = run_cli("stats", "--address", running.address, "--token-file", str(token_file),
                       "--json")  # fmt: skip
        table = run_cli("stats", "--address", running.address, "--token-file", str(token_file))
        # `--token=...`: a token may start with "-", which argparse would take for a flag
        as_root = run_cli("stats", "--address", running.address,
                          f"--token={tenancy.tokens['root']}", "--json")  # fmt: skip
        wrong = run_cli("stats", "--address", running.address, "--token=not-a-token")

    assert as_a.returncode == 0, as_a.stderr
    report = json.loads(as_a.stdout)
    assert [t["tenant"] for t in report["tenants"]] == ["alpha"]  # never beta
    alpha = report["tenants"][0]
    assert (alpha["blocks"], alpha["bytes"], alpha["blocks_stored"]) == (3, 3000, 3)
    assert (alpha["lookups"], alpha["lookup_digests"], alpha["lookup_hits"]) == (1, 4, 3)
    assert alpha["hit_rate"] == 0.75
    assert (alpha["blocks_served"], alpha["bytes_served"]) == (2, 2000)
    assert "tiers" not in report  # tiers and integrity failures: admins only

    assert table.returncode == 0, table.stderr
    header, row = table.stdout.splitlines()[:2]
    assert header.split()[:2] == ["tenant", "blocks"] and "hit rate" in header
    assert row.split()[0] == "alpha" and "75.0%" in row and "beta" not in table.stdout

    assert as_root.returncode == 0, as_root.stderr
    everything = json.loads(as_root.stdout)
    assert [t["tenant"] for t in everything["tenants"]] == ["alpha", "beta"]
    assert {t["name"] for t in everything["tiers"]} == {"memory", "lmdb"}
    assert everything["integrity_failures"] == 0

    assert wrong.returncode == 1 and "UNAUTHENTICATED" in wrong.stderr
    assert "not-a-token" not in wrong.stderr
