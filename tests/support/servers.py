"""Real servers for tests: a two-tenant config (`write_config`), an in-process server on
127.0.0.1 port 0 with a real LMDB (`launch`, `Running`), `kvshare serve` as a child
process (`ServerProcess`), the CLI (`run_cli`), an engine's token and keyring files."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from cacheserver.config import ServerConfig, load_config
from cacheserver.embedded import EmbeddedServer
from cacheserver.server import Server
from cacheserver.store import BlockStore
from cacheserver.telemetry import ServerTelemetry
from policy import AccessPolicy
from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import Certs
from tests.support.repo import REPO

SERVING_RE = re.compile(r"serving on (\S+)")


@dataclass
class Tenancy:
    """A two-tenant config: tokens by principal name, written as TOML."""

    path: Path
    tokens: dict[str, str] = field(default_factory=dict)


def write_config(
    tmp_path: Path,
    *,
    quotas: dict[str, int] | None = None,
    extra: str = "",
    principals: dict[str, tuple[list[str], list[str]]] | None = None,
) -> Tenancy:
    """Tenants `alpha` and `beta`; principals `a` (alpha rw), `b` (beta rw), `root` (admin)."""
    quotas = quotas or {}
    principals = principals or {
        "a": (["alpha"], ["read", "write"]),
        "b": (["beta"], ["read", "write"]),
        "root": (["alpha", "beta"], ["read", "write", "admin"]),
    }
    tenancy = Tenancy(tmp_path / "kvshare.toml")
    lines = [f'data_dir = "{tmp_path / "data"}"', 'listen = "127.0.0.1:0"', extra]
    for tenant in ("alpha", "beta"):
        lines += ["[[tenants]]", f'id = "{tenant}"', f"quota_bytes = {quotas.get(tenant, 0)}"]
    for name, (tenants, actions) in principals.items():
        token = secrets.token_urlsafe(24)
        tenancy.tokens[name] = token
        lines += [
            "[[principals]]",
            f'name = "{name}"',
            f'token_sha256 = "{hashlib.sha256(token.encode()).hexdigest()}"',
            f"tenants = {tenants!r}".replace("'", '"'),
            f"actions = {actions!r}".replace("'", '"'),
        ]
    tenancy.path.write_text("\n".join(lines) + "\n")
    return tenancy


def write_public_config(
    tmp_path: Path,
    principals: dict[str, tuple[list[str], list[str]]],
    *,
    readers: tuple[str, ...] = ("alpha", "beta"),
    quota_bytes: int = 1 << 30,
    quotas: dict[str, int] | None = None,
) -> Tenancy:
    """`write_config` with a public scope (`[public] quota_bytes`) that `readers`
    read (`read_public = true`); a publisher is `([], ["publish"])` in `principals`."""
    tenancy = write_config(tmp_path, quotas=quotas, principals=principals)
    text = tenancy.path.read_text()
    for tenant in readers:
        text = text.replace(f'id = "{tenant}"\n', f'id = "{tenant}"\nread_public = true\n')
    tenancy.path.write_text(text + f"[public]\nquota_bytes = {quota_bytes}\n")
    return tenancy


# How a test's client reaches the store: gRPC only, the bulk channel over TCP (as from
# another host), or the bulk channel's same-host arena (BlockClient's default here).
# KVSHARE_TEST_BULK_WORKERS=N runs every test server with N bulk-serving processes
# ([bulk] workers; docs/architecture.md, "Bulk workers"), and clients then default to
# the bulk channel over TCP, the transport workers serve.
TEST_BULK_WORKERS = int(os.environ.get("KVSHARE_TEST_BULK_WORKERS", "1"))


def with_test_workers(config: ServerConfig) -> ServerConfig:
    """`config` with KVSHARE_TEST_BULK_WORKERS applied (unless it sets workers itself)."""
    if TEST_BULK_WORKERS <= 1 or config.bulk.processes() > 1:
        return config
    return dataclasses.replace(
        config, bulk=dataclasses.replace(config.bulk, workers=TEST_BULK_WORKERS)
    )


TRANSPORTS = ("grpc", "bulk-tcp", "bulk-same-host")


TRANSPORT_OPTIONS: dict[str, dict[str, bool]] = {
    "grpc": {"bulk": False},
    "bulk-tcp": {"same_host": False},
    "bulk-same-host": {},
}


@dataclass
class Running:
    """An in-process server (`launch`): its address, data dir, tokens by principal name,
    the server itself, its config and its certificates (TLS)."""

    address: str
    data_dir: Path
    tokens: dict[str, str]
    server: EmbeddedServer
    config: ServerConfig
    certs: Certs | None = None
    stopped: bool = False

    def client(
        self,
        who: str = "dev",
        *,
        cert: str | None = None,
        transport: str | None = None,
        **kwargs: Any,
    ) -> BlockClient:
        """A client with `who`'s token ('' for none), over `transport` (TRANSPORTS; the
        client's default when None) and, for mTLS, with the named client certificate."""
        token = self.tokens[who] if who else ""
        default = "bulk-tcp" if TEST_BULK_WORKERS > 1 else "bulk-same-host"
        options = {**TRANSPORT_OPTIONS[transport or default], **kwargs}
        return BlockClient(self.address, token, tls=self.tls(cert), **options)

    def tls(self, cert: str | None = None) -> ClientTls | None:
        if self.config.tls is None:
            return None
        assert self.certs is not None
        files = self.certs.clients[cert] if cert else None
        return ClientTls(
            root_ca=self.certs.ca.cert_path,
            client_cert=files.cert if files else None,
            client_key=files.key if files else None,
        )

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self.server.stop()

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def _server(self) -> Server:
        assert self.server.server is not None
        return self.server.server

    @property
    def policy(self) -> AccessPolicy:
        return self._server.policy

    @property
    def store(self) -> BlockStore:
        return self._server.store


def launch(
    tenancy: Tenancy,
    certs: Certs | None = None,
    *,
    server_telemetry: ServerTelemetry | None = None,
    **replace: Any,
) -> Running:
    """The one way tests start an in-process server: `tenancy`'s config, with fields
    of ServerConfig replaced by `replace`. Stop it with `.stop()` or `with` (fixtures
    do)."""
    config = load_config(tenancy.path)
    if replace:
        config = dataclasses.replace(config, **replace)
    config = with_test_workers(config)
    server = EmbeddedServer(config, telemetry=server_telemetry)
    server.start()
    return Running(server.address, config.data_dir, tenancy.tokens, server, config, certs)


class ServerProcess:
    """`kvshare serve` as a real child process (for kill -9, SIGTERM, CLI errors). One
    still running when its test ends (a failed assertion before `terminate`) is killed
    then (`_no_server_process_outlives_its_test`)."""

    started: ClassVar[list[subprocess.Popen[str]]] = []

    def __init__(self, *args: str) -> None:
        workers = ["--bulk-workers", str(TEST_BULK_WORKERS)] if TEST_BULK_WORKERS > 1 else []
        if "--bulk-workers" in args:
            workers = []
        self.args = [sys.executable, "-m", "kvshare.cli", "serve", *args, *workers]
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        ServerProcess.started.append(self.proc)
        self.startup_lines: list[str] = []  # stdout up to "serving on" (e.g. "metrics on")
        self.address = self._wait_ready()

    def _wait_ready(self, timeout_s: float = 60) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                _, err = self.proc.communicate(timeout=10)
                raise RuntimeError(f"server exited ({self.proc.returncode}): {err}")
            self.startup_lines.append(line)
            match = SERVING_RE.search(line)
            if match:
                return match.group(1)
        raise RuntimeError("server did not print 'serving on' in time")

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def terminate(self) -> tuple[int, str]:
        self.proc.send_signal(signal.SIGTERM)
        out, _ = self.proc.communicate(timeout=60)
        return self.proc.returncode, out


def write_engine_files(directory: Path, tokens: dict[str, str]) -> tuple[dict[str, Path], Path]:
    """What an engine adapter's config names: one owner-only token file per principal
    (`<name>.token`) and a keyring with keys for tenants `alpha` and `beta`."""
    token_files = {}
    for name, token in tokens.items():
        path = directory / f"{name}.token"
        path.write_text(token)
        path.chmod(0o600)
        token_files[name] = path
    return token_files, write_keyring(directory)


def free_port() -> int:
    """A loopback TCP port nothing listens on (a moment ago)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_keyring(directory: Path) -> Path:
    """An owner-only keyring file with keys for tenants `alpha` and `beta`."""
    from policy.sealing import new_key_entry

    keyring = directory / "keyring.toml"
    keyring.write_text(new_key_entry("alpha", 1) + new_key_entry("beta", 1))
    keyring.chmod(0o600)
    return keyring


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )


def require_sealed(tenancy: Tenancy, tenant: str = "alpha") -> Tenancy:
    """`tenancy`'s config with `require_sealed = true` for `tenant`."""
    text = tenancy.path.read_text()
    tenancy.path.write_text(
        text.replace(f'id = "{tenant}"', f'id = "{tenant}"\nrequire_sealed = true', 1)
    )
    return tenancy


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The one line a CLI that refused to start (exit code 2) printed on stderr."""
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, result.stderr
    return lines[0]
