"""Shared fixtures: real servers on 127.0.0.1 port 0 with a real LMDB in tmp_path."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer
from cacheserver.store.journal.files import JOURNAL_NAME, SHM, remove_journal
from cacheserver.store.journal.format import SUPERBLOCK_READ_BYTES, owner_of
from kvcommon import bulkio
from tests.support.certs import Certs, make_certs
from tests.support.reload import LiveConfig, start
from tests.support.servers import (
    TRANSPORTS,
    Running,
    ServerProcess,
    launch,
    with_test_workers,
    write_config,
    write_keyring,
)

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


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    """Runs a test once per transport: pass it to `Running.client(transport=...)`."""
    return str(request.param)


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


@pytest.fixture
def running(live: LiveConfig) -> Iterator[Running]:
    """The server started from the test module's `live` config, which it reloads
    (tests.support.reload.start); a module that asks for it defines the `live` fixture."""
    with start(live) as server:
        yield server


@pytest.fixture(scope="session")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    """A CA, a server certificate for 127.0.0.1/localhost, client certificates `cert-a`,
    `cert-b`, `stranger` (valid, mapped to nobody), and `cert-a` of a CA not trusted."""
    return make_certs(tmp_path_factory.mktemp("certs"))


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
