"""Fixtures for the reliability suite: `kvshare serve` child processes with a config
written here, their put journal in a private tmpfs directory removed afterwards."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from benchmarks.reliability.harness import (
    PrincipalSpec,
    ServerProc,
    Tenancy,
    TenantSpec,
    private_journal_dir,
    write_tenancy,
)
from tests.support.reliability import Serve, Storage


@pytest.fixture
def journal_dir() -> Iterator[Path]:
    with private_journal_dir() as path:
        yield path


@pytest.fixture
def serve(tmp_path: Path, journal_dir: Path) -> Iterator[Serve]:
    """serve(tenants, principals, storage=..., tokens=...) -> (server, tenancy); the same
    data dir each call, so a second call restarts on the data of the first. Servers
    still running at the end are stopped (SIGTERM, then -9)."""
    started: list[ServerProc] = []

    def start(
        tenants: Sequence[TenantSpec],
        principals: Sequence[PrincipalSpec],
        *,
        storage: Storage | None = None,
        tokens: Mapping[str, str] | None = None,
    ) -> tuple[ServerProc, Tenancy]:
        # A 16 MiB journal (the minimum) unless a test says otherwise: the default 2 GiB
        # would have the server prefault 128 MiB of tmpfs ahead of its first puts.
        settings = {"journal_dir": str(journal_dir), "journal_bytes": 16 << 20, **(storage or {})}
        tenancy = write_tenancy(tmp_path, tenants, principals, storage=settings, tokens=tokens)
        server = ServerProc(tenancy.path, tmp_path / "server.log")
        started.append(server)
        return server, tenancy

    yield start
    for server in started:
        if server.alive():
            with contextlib.suppress(RuntimeError):
                server.terminate(timeout_s=30)
