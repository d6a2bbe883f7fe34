"""Shared fixtures: real servers on 127.0.0.1 port 0 with a real LMDB in tmp_path."""

from __future__ import annotations

import hashlib
import os
import re
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from cacheserver.config import ServerConfig, StorageConfig, load_config
from cacheserver.embedded import EmbeddedServer
from replica_agent.client import BlockClient

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session", autouse=True)
def _remove_journals_of_killed_servers() -> Iterator[None]:
    """Servers this session killed with -9 and never restarted leave their put journal
    on /dev/shm (a real server's restart would replay it): remove those at the end."""
    shm = Path("/dev/shm")  # where servers put their journals by default
    pattern = f"kvshare-{os.getuid()}-*.journal"
    before = set(shm.glob(pattern)) if shm.is_dir() else set()
    yield
    if shm.is_dir():
        for leftover in set(shm.glob(pattern)) - before:
            leftover.unlink(missing_ok=True)


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


@dataclass
class Running:
    address: str
    data_dir: Path
    tokens: dict[str, str]

    def client(self, who: str = "dev", **kwargs: object) -> BlockClient:
        return BlockClient(self.address, self.tokens[who], **kwargs)  # type: ignore[arg-type]


@pytest.fixture
def dev_server(tmp_path: Path) -> Iterator[Running]:
    """The dev-mode server (tenant `dev`, token from the data dir), in-process."""
    data_dir = tmp_path / "data"
    with EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=data_dir)) as server:
        token = (data_dir / "dev.token").read_text().strip()
        yield Running(server.address, data_dir, {"dev": token})


@pytest.fixture
def tenant_server(tmp_path: Path) -> Iterator[Running]:
    """Two tenants, three principals, from a real TOML config, in-process."""
    tenancy = write_config(tmp_path)
    config = load_config(tenancy.path)
    with EmbeddedServer(config) as server:
        yield Running(server.address, config.data_dir, tenancy.tokens)


def embedded(config: ServerConfig, **storage: int) -> EmbeddedServer:
    return EmbeddedServer(
        ServerConfig(
            listen=config.listen,
            data_dir=config.data_dir,
            access=config.access,
            storage=StorageConfig(**storage) if storage else config.storage,
            limits=config.limits,
        )
    )


class ServerProcess:
    """`kvshare serve` as a real child process (for kill -9, SIGTERM, CLI errors)."""

    def __init__(self, *args: str) -> None:
        self.args = [sys.executable, "-m", "kvshare.cli", "serve", *args]
        self.proc = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
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


def run_cli(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvshare.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
    )
