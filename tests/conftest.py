"""Shared fixtures: real servers on 127.0.0.1 port 0 with a real LMDB in tmp_path."""

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
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import pytest

from cacheserver.config import ServerConfig, load_config
from cacheserver.embedded import EmbeddedServer
from cacheserver.server import Server
from cacheserver.store import BlockStore
from cacheserver.store.journal.files import JOURNAL_NAME, SHM, remove_journal
from cacheserver.store.journal.format import SUPERBLOCK_READ_BYTES, owner_of
from cacheserver.telemetry import ServerTelemetry
from kvcommon import bulkio
from policy import AccessPolicy
from replica_agent.client import BlockClient, ClientTls
from tests.support.certs import Certs, make_certs
from tests.support.repo import REPO

if TYPE_CHECKING:
    from policy.sealing import BlockSealer


@pytest.fixture(scope="session", autouse=True)
def _remove_journals_of_killed_servers(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[None]:
    """Servers this session killed with -9 and never restarted leave their put journal
    on /dev/shm (a real server's restart would replay it): at the end, remove those
    whose data dir is under this session's temporary directory (and no other session's
    or server's)."""
    yield
    ours = str(tmp_path_factory.getbasetemp().resolve())
    for directory in SHM.glob(f"kvshare-{os.getuid()}-*"):
        journal = directory / JOURNAL_NAME
        try:
            with journal.open("rb") as f:
                owner = owner_of(f.read(SUPERBLOCK_READ_BYTES))
        except OSError:
            continue
        if owner is not None and owner.startswith(ours):
            remove_journal(journal)


def read_allocated(path: Path) -> bytes:
    """The bytes of `path` where it has data: LMDB's file is sparse up to its map size
    (gigabytes), only its start holds pages."""
    chunks = []
    with open(path, "rb") as f:
        fd, end, offset = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while offset < end:
            try:
                start = os.lseek(fd, offset, os.SEEK_DATA)
            except OSError:  # no data after offset
                break
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            chunks.append(os.pread(fd, stop - start, start))
            offset = stop
    return b"".join(chunks)


def flip_stored_byte(data_file: Path, near: bytes, offset: int) -> None:
    """Flip one bit `offset` bytes into the first place `near` is stored in `data_file`
    (a stopped server's LMDB file), as a failing disk would."""
    with open(data_file, "r+b") as f:
        fd, end, position = f.fileno(), os.fstat(f.fileno()).st_size, 0
        while position < end:
            start = os.lseek(fd, position, os.SEEK_DATA)
            stop = os.lseek(fd, start, os.SEEK_HOLE)
            where = os.pread(fd, stop - start, start).find(near)
            if where >= 0:
                at = start + where + offset
                os.pwrite(fd, bytes([os.pread(fd, 1, at)[0] ^ 0x01]), at)
                return
            position = stop
    raise AssertionError("the block's bytes are not in the data file")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--ks-samples",
        type=int,
        default=500,  # per arm; Gu et al. found provider cache sharing with ~250
        help="timings per arm of the cross-tenant KS timing test (longer runs: more power)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu`-marked tests where CUDA is absent (torch imported only if needed)."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in gpu_items:
        item.add_marker(skip)


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


# Calls a client made, recorded by `record_calls`: (verb, tenant, digests).
Calls = list[tuple[str, str, tuple[bytes, ...]]]


def record_calls(client: BlockClient) -> Calls:
    """Record every call `client` makes from now on; the calls themselves are real."""
    calls: Calls = []

    def wrap(verb: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def call(tenant: str, model: str, digests: Sequence[bytes], *rest: Any) -> Any:
            calls.append((verb, tenant, tuple(digests)))
            return real(tenant, model, digests, *rest)

        return call

    for verb in ("lookup", "iter_views", "get", "put", "delete"):
        setattr(client, verb, wrap(verb, getattr(client, verb)))
    return calls


def sent_to(calls: Calls, tenant: str) -> set[bytes]:
    """Every digest the recorded calls named in `tenant`."""
    return {d for _, who, digests in calls if who == tenant for d in digests}


def puts(calls: Calls) -> list[tuple[str, tuple[bytes, ...]]]:
    """The recorded puts: (tenant, digests)."""
    return [(who, digests) for verb, who, digests in calls if verb == "put"]


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


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Runs a test once per transport: pass it to `Running.client(transport=...)`."""
    return str(request.param)


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


@pytest.fixture
def start_server(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    """A factory: `start_server(quotas=..., extra=..., principals=..., **replace)` starts
    a two-tenant server (write_config) in its own directory; all stop at teardown."""
    started: list[Running] = []

    def start(
        *,
        quotas: dict[str, int] | None = None,
        extra: str = "",
        principals: dict[str, tuple[list[str], list[str]]] | None = None,
        **replace: Any,
    ) -> Running:
        directory = tmp_path / f"server{len(started)}"
        directory.mkdir()
        tenancy = write_config(directory, quotas=quotas, extra=extra, principals=principals)
        running = launch(tenancy, **replace)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()


@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[Running]:
    """The dev-mode server (tenant `dev`, token from the data dir), in-process."""
    data_dir = tmp_path / "data"
    config = with_test_workers(ServerConfig(listen="127.0.0.1:0", data_dir=data_dir))
    with EmbeddedServer(config) as server:
        token = (data_dir / "dev.token").read_text().strip()
        yield Running(server.address, data_dir, {"dev": token}, server, config)


@pytest.fixture
def tenant_server(tmp_path: Path) -> Iterator[Running]:
    """Two tenants, three principals, from a real TOML config, in-process."""
    running = launch(write_config(tmp_path))
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost, client certificates `cert-a`,
    `cert-b`, `stranger` (valid, mapped to nobody), and `cert-a` of a CA not trusted."""
    return make_certs(tmp_path_factory.mktemp("certs"))


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


@pytest.fixture
def sealer(tmp_path: Path) -> BlockSealer:
    """The agent's sealer with keys for tenants `alpha` and `beta`."""
    from policy.sealing import BlockSealer, Keyring

    return BlockSealer(Keyring.from_file(write_keyring(tmp_path)))


@pytest.fixture
def timeouts_set(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """Every timeout kvcommon.bulkio sets on a socket, in order (a Deadline: what is
    left when armed, the idle timeout when disarmed; a client's SocketTimer: when re-armed)."""
    sets: list[float] = []
    real = bulkio.set_timeout

    def counted(sock: socket.socket, seconds: float) -> None:
        sets.append(seconds)
        real(sock, seconds)

    monkeypatch.setattr(bulkio, "set_timeout", counted)
    return sets


@pytest.fixture(autouse=True)
def _no_server_process_outlives_its_test() -> Iterator[None]:
    yield
    while ServerProcess.started:
        proc = ServerProcess.started.pop()
        if proc.poll() is None:
            proc.kill()  # SIGKILL works on a stopped (SIGSTOP) process too
            proc.communicate(timeout=30)


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
