"""The put journal across real crashes: acknowledged blocks not yet in LMDB survive
kill -9 of `kvshare serve`, and deletes stay deleted.

`drain_idle_ms` is set far beyond the test, so nothing moves into LMDB on its own:
what the restarted server serves can only have come from replaying the journal (the
test checks LMDB itself was empty at the crash)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from cacheserver.tiers.lmdb.tier import LmdbTier
from replica_agent.client import BlockClient
from tests.support.servers import ServerProcess, write_config

MODEL = "tiny-llama@r1;fp32;L4;H4;D64;B256"
HOLD_BACK = "[storage]\ndrain_idle_ms = 600000\n"


def _blocks_in_lmdb(data_dir: Path) -> int:
    tier = LmdbTier(data_dir / "lmdb", map_bytes=1 << 30, sync_writes=False)
    try:
        return sum(1 for _ in tier.scan())
    finally:
        tier.close()


def _serve(config: Path) -> ServerProcess:
    return ServerProcess("--config", str(config))


@pytest.mark.slow
def test_acknowledged_blocks_only_in_the_journal_survive_kill_9(tmp_path: Path) -> None:
    tenancy = write_config(tmp_path, extra=HOLD_BACK)
    digests = [os.urandom(32) for _ in range(24)]
    payloads = [os.urandom(256 << 10) for _ in range(24)]
    server = _serve(tenancy.path)
    try:
        for bulk in (True, False):  # the bulk channel receives in place; gRPC copies in
            with BlockClient(server.address, tenancy.tokens["a"], bulk=bulk) as client:
                half = slice(0, 12) if bulk else slice(12, 24)
                for i in range(half.start, half.stop, 4):
                    got = client.put("alpha", MODEL, digests[i : i + 4], payloads[i : i + 4])
                    assert got == [True] * 4
    finally:
        server.kill9()
    assert _blocks_in_lmdb(tmp_path / "data") == 0  # every one of them was journal-only

    server = _serve(tenancy.path)
    try:
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            assert client.lookup("alpha", MODEL, digests) == 24
            assert client.get("alpha", MODEL, digests) == payloads
    finally:
        server.terminate()
    assert _blocks_in_lmdb(tmp_path / "data") == 24  # replayed into LMDB, then stopped cleanly


@pytest.mark.slow
def test_a_deleted_block_stays_deleted_after_kill_9(tmp_path: Path) -> None:
    tenancy = write_config(tmp_path, extra=HOLD_BACK)
    digests = [os.urandom(32) for _ in range(4)]
    payloads = [os.urandom(64 << 10) for _ in range(4)]
    server = _serve(tenancy.path)
    try:
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            assert client.put("alpha", MODEL, digests, payloads) == [True] * 4
            assert client.delete("alpha", MODEL, digests[2:]) == 2
            # positive control for the next assertion: the others are still there
            assert client.lookup("alpha", MODEL, digests[:2]) == 2
    finally:
        server.kill9()

    server = _serve(tenancy.path)
    try:
        with BlockClient(server.address, tenancy.tokens["a"]) as client:
            assert client.get("alpha", MODEL, digests[:2]) == payloads[:2]
            assert client.lookup("alpha", MODEL, digests[2:3]) == 0
            assert client.lookup("alpha", MODEL, digests[3:]) == 0
    finally:
        server.terminate()


def test_a_clean_stop_leaves_no_journal_behind(tmp_path: Path) -> None:
    journal_dir = tmp_path / "journal"
    tenancy = write_config(tmp_path, extra=f'[storage]\njournal_dir = "{journal_dir}"\n')
    server = _serve(tenancy.path)
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        assert client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(4096)]) == [True]
    assert len(list(journal_dir.iterdir())) == 1  # positive control: it was in use
    code, _ = server.terminate()
    assert code == 0
    assert list(journal_dir.iterdir()) == []
