"""grpc.health.v1 follows the LMDB tier: NOT_SERVING while it cannot write, then back.

The tier is made really unwritable: its data dir is a 16 MiB tmpfs, filled to ENOSPC
with a filler file. Needs root and mount (skipped with the reason otherwise).
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from cacheserver.config import StorageConfig, TelemetryConfig
from cacheserver.server import SERVICE_NAME
from cacheserver.store.journal import sizing
from kvcommon.errors import KvshareError
from tests.support.servers import launch, write_config
from tests.support.tmpfs import small_tmpfs

MODEL = "obs/model@r1;fp32;L2;H2;D8;B4;tp0/1"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    with small_tmpfs(tmp_path / "disk", 16, "to put the data dir on a small tmpfs") as where:
        yield where


def fill(path: Path) -> None:
    """Write until the file system is full (ENOSPC)."""
    chunk = b"\0" * (256 << 10)
    with path.open("wb", buffering=0) as filler:
        try:
            while True:
                filler.write(chunk)
        except OSError:
            pass
        try:  # the last partial chunk's worth of space
            while True:
                filler.write(b"\0" * 4096)
        except OSError:
            pass


def wait_for(
    check: grpc.UnaryUnaryMultiCallable[Any, Any], status: int, timeout_s: float = 10
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        answers = [
            check(health_pb2.HealthCheckRequest(service=s)).status for s in ("", SERVICE_NAME)
        ]
        if answers == [status, status]:
            return
        assert time.monotonic() < deadline, f"health stayed {answers}, expected {status}"
        time.sleep(0.05)


@pytest.mark.parametrize("journal", [True, False], ids=["journal", "write-through"])
def test_health_is_not_serving_while_the_lmdb_tier_is_full_then_recovers(
    tmp_path: Path, small_disk: Path, journal: bool
) -> None:
    tenancy = write_config(tmp_path)
    storage = StorageConfig(
        memory_budget_bytes=1 << 20,
        disk_budget_bytes=4 << 20,
        journal_bytes=(64 << 20) if journal else 0,
    )
    filler = small_disk / "filler"
    with (
        launch(
            tenancy,
            data_dir=small_disk / "data",
            storage=storage,
            telemetry=TelemetryConfig(health_interval_ms=100),
        ) as running,
        grpc.insecure_channel(running.address) as channel,
    ):
        check = health_pb2_grpc.HealthStub(channel).Check  # no credentials: exempt
        wait_for(check, SERVING)

        fill(filler)
        wait_for(check, NOT_SERVING)
        digest, payload = os.urandom(32), os.urandom(1 << 20)
        with running.client("a", bulk=False) as client:
            if journal:  # acknowledged from the journal (tmpfs); LMDB takes it later
                assert client.put("alpha", MODEL, [digest], [payload]) == [True]
            else:
                with pytest.raises(KvshareError):
                    client.put("alpha", MODEL, [digest], [payload])  # really full

        filler.unlink()
        wait_for(check, SERVING)
        if journal:  # the drain got through once there was room: on disk, served
            deadline = time.monotonic() + 10
            while running.store.undrained_blocks:
                assert time.monotonic() < deadline, "the journaled block never reached LMDB"
                time.sleep(0.05)
            with running.client("a", bulk=False) as client:
                assert client.get("alpha", MODEL, [digest]) == [payload]
        with running.client("a", bulk=False) as client:
            assert client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(1 << 20)]) == [True]


def test_a_full_journal_file_system_refuses_puts_instead_of_crashing(
    tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal is mapped into the server: a page tmpfs cannot back would SIGBUS the
    whole process (this test's, the server being embedded) instead of failing a put.
    A journal larger than the free space is refused at start (journal/sizing.py), but
    others may take the space after: here the start sees room that is not there."""
    monkeypatch.setattr(sizing, "free_bytes", lambda path: 1 << 40)
    tenancy = write_config(tmp_path)
    storage = StorageConfig(
        journal_bytes=64 << 20,  # four times the 16 MiB file system under it
        journal_dir=str(small_disk),
        drain_idle_ms=600_000,  # nothing is drained, so nothing is reused
    )
    stored: list[tuple[bytes, bytes]] = []
    with launch(tenancy, storage=storage) as running, running.client("a") as client:
        with pytest.raises(KvshareError, match="no space for the put journal"):
            for _ in range(32):
                digest, payload = os.urandom(32), os.urandom(1 << 20)
                assert client.put("alpha", MODEL, [digest], [payload]) == [True]
                stored.append((digest, payload))
        assert 8 <= len(stored) < 16  # positive control: the journal took what fit
        digests = [d for d, _ in stored]
        assert client.get("alpha", MODEL, digests) == [p for _, p in stored]
