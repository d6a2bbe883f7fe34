"""`kvshare health` against the real server: exit 0 and SERVING while it serves, a
non-zero exit and one line otherwise (NOT_SERVING, nothing listening, an unknown
service, a CA that did not sign the server)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from grpc_health.v1 import health_pb2

from cacheserver.config import TlsFiles
from tests.support.servers import Running, launch, write_config

REPO = Path(__file__).resolve().parents[2]


def health(*args: str) -> tuple[int, str, str]:
    done = subprocess.run(
        [sys.executable, "-m", "kvshare.cli", "health", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    return done.returncode, done.stdout, done.stderr


def test_serving_server_exits_zero(tenant_server: Running) -> None:
    code, out, err = health("--address", tenant_server.address)
    assert (code, err) == (0, "")
    assert out == f"{tenant_server.address}: SERVING\n"
    code, out, _ = health("--address", tenant_server.address, "--service", "kvshare.v1.BlockStore")
    assert code == 0 and "SERVING" in out


def test_not_serving_exits_non_zero_with_one_line(tenant_server: Running) -> None:
    assert health("--address", tenant_server.address)[0] == 0  # positive control
    server = tenant_server.server.server
    assert server is not None
    loop: asyncio.AbstractEventLoop = tenant_server.server._loop
    asyncio.run_coroutine_threadsafe(
        server.health.set("", health_pb2.HealthCheckResponse.NOT_SERVING), loop
    ).result(timeout=30)
    code, out, err = health("--address", tenant_server.address)
    assert code == 1 and out == ""
    assert err == f"kvshare health: {tenant_server.address}: NOT_SERVING\n"


def test_unknown_service_and_no_server_exit_non_zero(tenant_server: Running) -> None:
    code, _, err = health("--address", tenant_server.address, "--service", "no.such.Service")
    assert code == 1
    assert err.count("\n") == 1 and "NOT_FOUND" in err
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    code, out, err = health("--address", closed, "--timeout-s", "2")
    assert code == 1 and out == ""
    assert err.startswith(f"kvshare health: {closed}: no answer (") and err.count("\n") == 1


@pytest.mark.slow
def test_tls_server(tmp_path: Path, certs: Any) -> None:
    tls = TlsFiles(certs.server.cert, certs.server.key, None)
    with launch(write_config(tmp_path), certs, tls=tls) as running:
        code, out, err = health("--address", running.address, "--tls-ca", str(certs.ca.cert_path))
        assert (code, err) == (0, "") and "SERVING" in out
        # Plaintext to a TLS port, and a CA that did not sign the server: no answer.
        assert health("--address", running.address, "--timeout-s", "2")[0] == 1
        other_ca = certs.other_ca_client.cert  # any certificate the server's is not under
        code, _, err = health(
            "--address", running.address, "--tls-ca", str(other_ca), "--timeout-s", "2"
        )
        assert code == 1 and err.count("\n") == 1
        missing = tmp_path / "missing.pem"
        code, _, err = health("--address", running.address, "--tls-ca", str(missing))
        assert code == 2 and "cannot read a TLS file" in err
