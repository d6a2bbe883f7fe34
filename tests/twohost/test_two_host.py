"""kvshare across a real network boundary: the server in one network namespace, its
replicas in another (tests/twohost/conftest.py), as a deployment runs them.

The server listens on a wildcard address, as a store beside a pool of GPU hosts does;
replicas dial the server's address on the veth. What the server counted (its
Prometheus endpoint) says which path the bytes took.
"""

from __future__ import annotations

import json
import random
import subprocess
import time
from pathlib import Path

import pytest

from kvshare.bench.netns import TwoHosts
from policy.sealing import new_key_entry
from tests.support.certs import TestCA
from tests.support.repo import REPO
from tests.support.scrape import Samples, value
from tests.support.servers import write_config
from tests.support.twohost import RemoteServer, replica_command, run_in

pytestmark = pytest.mark.slow  # every test here takes seconds

BLOCK_TOKENS = 16
GRPC_PORT = 50051
SPIFFE = "spiffe://kvshare.test"


def calls(samples: Samples, method: str) -> float:
    return value(samples, "kvshare_rpc_requests_total", method=method, status="OK")


def assert_bulk_carried_the_payloads(samples: Samples) -> None:
    assert calls(samples, "kvshare.bulk/Put") >= 1
    assert calls(samples, "kvshare.bulk/Get") >= 1
    assert calls(samples, "kvshare.v1.BlockStore/Put") == 0
    assert calls(samples, "kvshare.v1.BlockStore/Get") == 0


def wildcard_server(rig: TwoHosts, tmp_path: Path, config: Path, *extra: str) -> RemoteServer:
    return RemoteServer(
        rig.server, tmp_path, "--config", str(config), "--listen", f"0.0.0.0:{GRPC_PORT}",
        "--metrics-listen", "127.0.0.1:0", *extra,
    )  # fmt: skip


def prompts(seed: int, count: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [rng.randrange(512) for _ in range(blocks * BLOCK_TOKENS + 5)]
        for blocks in range(1, count + 1)
    ]


def test_wildcard_listen_moves_payloads_over_the_bulk_channel(
    rig: TwoHosts, tmp_path: Path
) -> None:
    tenancy = write_config(tmp_path)
    server = wildcard_server(rig, tmp_path, tenancy.path, "--allow-insecure-listen")
    try:
        assert server.bulk_bound == server.bulk_announced == f"0.0.0.0:{GRPC_PORT + 1}"
        address = f"{rig.server.address}:{GRPC_PORT}"
        args = {"address": address, "token": tenancy.tokens["a"], "tenant": "alpha"}
        report = run_in(rig.client, "blocks", {**args, "count": 8, "block_bytes": 1 << 20})
        assert report == {"stored": 8, "identical": True, "warnings": []}  # no fallback
        assert_bulk_carried_the_payloads(server.scrape())
        # Positive control: a gRPC-only client is counted where the bulk one was not.
        # (gRPC is what a failed bulk channel falls back to.)
        grpc_only = {**args, "count": 1, "block_bytes": 10, "bulk": False}
        assert run_in(rig.client, "blocks", grpc_only)["identical"]
        samples = server.scrape()
        assert calls(samples, "kvshare.v1.BlockStore/Get") == 1
        assert calls(samples, "kvshare.v1.BlockStore/Put") == 1
    finally:
        server.stop()


def test_tls_and_mtls_across_hosts(rig: TwoHosts, tmp_path: Path) -> None:
    ca = TestCA(tmp_path / "ca")
    server_cert = ca.server_cert(ips=(rig.server.address,))
    local_only = ca.server_cert("local-only")  # 127.0.0.1 and localhost only
    client_cert = ca.client_cert("replica", common_name="replica", uri=f"{SPIFFE}/replica")
    address = f"{rig.server.address}:{GRPC_PORT}"
    tls = {"root_ca": str(ca.cert_path)}
    mtls = {**tls, "client_cert": str(client_cert.cert), "client_key": str(client_cert.key)}
    principal = (
        f'\n[[principals]]\nname = "replica"\ncert_identity = "uri:{SPIFFE}/replica"\n'
        'tenants = ["alpha"]\nactions = ["read", "write"]\n'
    )
    for mode, cert in (("tls", server_cert), ("mtls", server_cert), ("tls", local_only)):
        directory = tmp_path / f"{mode}-{cert.cert.stem}"
        directory.mkdir()
        tenancy = write_config(directory)
        if mode == "mtls":
            with tenancy.path.open("a") as f:
                f.write(principal)
        server = wildcard_server(
            rig, tmp_path, tenancy.path, "--tls-cert", str(cert.cert), "--tls-key",
            str(cert.key), *(("--tls-client-ca", str(ca.cert_path)) if mode == "mtls" else ()),
        )  # fmt: skip
        try:
            token = tenancy.tokens["a"] if mode == "tls" else ""
            args = {"address": address, "token": token, "tenant": "alpha",
                    "count": 4, "block_bytes": 1 << 20}  # fmt: skip
            if cert is local_only:  # the address a replica dials is not in the certificate
                assert run_in(rig.client, "blocks", {**args, **tls})["error"] == "UNAVAILABLE"
                continue
            expected = {"stored": 4, "identical": True, "warnings": []}
            assert run_in(rig.client, "blocks", {**args, **(mtls if mode == "mtls" else tls)}) == (
                expected
            )
            assert_bulk_carried_the_payloads(server.scrape())
            if mode == "mtls":  # no client certificate: not even a connection
                refused = run_in(rig.client, "blocks", {**args, **tls, "token": "x"})
                assert refused["error"] == "UNAVAILABLE"
        finally:
            server.stop()


def sealed_store(tmp_path: Path) -> tuple[Path, Path, str]:
    tenancy = write_config(tmp_path, extra="")
    keyring = tmp_path / "keyring.toml"
    keyring.write_text(new_key_entry("alpha", 1))
    keyring.chmod(0o600)
    return tenancy.path, keyring, tenancy.tokens["a"]


def test_an_agent_on_the_far_host_restores_kv_exactly(rig: TwoHosts, tmp_path: Path) -> None:
    config, keyring, token = sealed_store(tmp_path)
    server = wildcard_server(rig, tmp_path, config, "--allow-insecure-listen")
    address = f"{rig.server.address}:{GRPC_PORT}"
    chosen = prompts(3, 4)
    try:
        writer = {"address": address, "token": token, "keyring": str(keyring),
                  "prompts": chosen, "tenant": "alpha"}  # fmt: skip
        saved = run_in(rig.client, "save", writer)  # one replica process saves...
        assert saved == {"blocks_saved": 10, "store_errors": 0, "warnings": []}
        report = run_in(rig.client, "restore", writer)  # ... another restores
        assert report["restored_tokens"] == 10 * BLOCK_TOKENS  # every full block
        assert report["max_logit_difference"] < 1e-4 and report["same_tokens"]
        assert report["open_failures"] == report["store_errors"] == 0
        assert_bulk_carried_the_payloads(server.scrape())
    finally:
        server.stop()


def test_the_production_configuration_restores_kv_exactly_over_the_sealed_channel(
    rig: TwoHosts, tmp_path: Path
) -> None:
    """TLS, a tenant that requires sealed blocks, agents with a keyring: the bulk channel
    is the sealed-payload channel (C50), across the veth, and the KV is exact."""
    config, keyring, token = sealed_store(tmp_path)
    text = config.read_text()
    config.write_text(text.replace('id = "alpha"', 'id = "alpha"\nrequire_sealed = true', 1))
    ca = TestCA(tmp_path / "ca")
    cert = ca.server_cert(ips=(rig.server.address,))
    server = wildcard_server(
        rig, tmp_path, config, "--tls-cert", str(cert.cert), "--tls-key", str(cert.key)
    )
    try:
        writer = {"address": f"{rig.server.address}:{GRPC_PORT}", "token": token,
                  "keyring": str(keyring), "prompts": prompts(7, 3), "tenant": "alpha",
                  "root_ca": str(ca.cert_path)}  # fmt: skip
        assert run_in(rig.client, "save", writer)["blocks_saved"] == 6
        report = run_in(rig.client, "restore", writer)
        assert report["restored_tokens"] == 6 * BLOCK_TOKENS
        assert report["max_logit_difference"] < 1e-4 and report["same_tokens"]
        assert report["open_failures"] == report["store_errors"] == 0
        assert report["warnings"] == []  # no fallback
        samples = server.scrape()
        assert_bulk_carried_the_payloads(samples)
        assert calls(samples, "kvshare.bulk/SealedHello") >= 2  # the saver's, the restorer's
        assert calls(samples, "kvshare.bulk/Hello") == 0  # no TLS bulk connection
    finally:
        server.stop()


class Replica:
    """A long-lived replica on the far host: one line of prompts in, one report out."""

    def __init__(self, rig: TwoHosts, args: dict[str, object]) -> None:
        self.proc = subprocess.Popen(
            replica_command(rig.client, "serve", args),
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        assert json.loads(self._line()) == {"ready": True}

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line, "the replica exited"
        return line

    def infer(self, chosen: list[list[int]]) -> dict[str, int]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompts": chosen}) + "\n")
        self.proc.stdin.flush()
        report: dict[str, int] = json.loads(self._line())
        return report

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def test_a_replica_keeps_serving_while_the_server_is_killed_and_restarted(
    rig: TwoHosts, tmp_path: Path
) -> None:
    config, keyring, token = sealed_store(tmp_path)
    server = wildcard_server(rig, tmp_path, config, "--allow-insecure-listen")
    first, later = prompts(5, 3), prompts(6, 3)
    replica = Replica(rig, {"address": f"{rig.server.address}:{GRPC_PORT}", "token": token,
                            "keyring": str(keyring), "tenant": "alpha"})  # fmt: skip
    try:
        assert replica.infer(first)["blocks_saved"] == 6  # acknowledged: 1 + 2 + 3 blocks
        warm = replica.infer(first)
        assert warm["store_tokens"] == 6 * BLOCK_TOKENS  # positive control: hits
        server.kill9()
        down = replica.infer(later + first)
        assert down["requests"] == 6 and down["failed"] == 0 and down["mismatches"] == 0
        assert down["store_tokens"] == 0 and down["skipped_breaker_open"] > 0
        server.start()  # same port, same data dir
        deadline = time.monotonic() + 30  # the breaker's cooldown, gRPC's reconnect backoff
        while True:
            back = replica.infer(first)
            assert back["failed"] == 0 and back["mismatches"] == 0
            if back["store_tokens"] == 6 * BLOCK_TOKENS or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert back["store_tokens"] == 6 * BLOCK_TOKENS  # acknowledged blocks survived kill -9
        assert_bulk_carried_the_payloads(server.scrape())  # the restarted server's counts
    finally:
        replica.close()
        server.stop()
