"""The block store end to end: real server, real LMDB, real clients.

Tests that move payloads run once per transport (the `transport` fixture: gRPC, the
bulk channel over TCP, the same-host arena), so each path is tested on its own — a
client's default would silently take the arena and leave gRPC framing untested.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from cacheserver.config import StorageConfig
from cacheserver.tiers.lmdb.tier import LmdbTier
from kvcommon.errors import InvalidArgument, PermissionDenied, ResourceExhausted
from replica_agent.client import BlockStoreError
from tests.support.datafiles import flip_stored_byte
from tests.support.servers import Running, ServerProcess, launch, write_config

MiB = 1 << 20
MODEL = "tiny-llama@r1;fp32;L4;H4;D64;B256"


def blocks(n: int, size: int) -> tuple[list[bytes], list[bytes]]:
    return [os.urandom(32) for _ in range(n)], [os.urandom(size) for _ in range(n)]


def test_put_lookup_get_round_trip_of_1mib_blocks(dev_server: Running, transport: str) -> None:
    digests, payloads = blocks(4, MiB)
    with dev_server.client(transport=transport) as client:
        assert client.put("dev", MODEL, digests, payloads) == [True] * 4
        assert client.lookup("dev", MODEL, digests) == 4
        assert client.get("dev", MODEL, digests) == payloads
        # First writer wins: a second put of the same digests stores nothing new.
        assert client.put("dev", MODEL, digests, [os.urandom(MiB)] * 4) == [False] * 4
        assert client.get("dev", MODEL, digests) == payloads


def test_lookup_and_get_stop_at_first_missing_digest(dev_server: Running, transport: str) -> None:
    digests, payloads = blocks(5, 64 << 10)
    with dev_server.client(transport=transport) as client:
        client.put("dev", MODEL, digests[:2] + digests[3:], payloads[:2] + payloads[3:])
        assert client.lookup("dev", MODEL, digests) == 2
        assert client.get("dev", MODEL, digests) == payloads[:2]
        assert client.lookup("dev", MODEL, digests[3:]) == 2  # positive control
        assert client.lookup("dev", MODEL, [os.urandom(32), *digests]) == 0
        assert client.get("dev", MODEL, [os.urandom(32), *digests]) == []


def test_same_digest_under_another_model_is_a_miss(dev_server: Running) -> None:
    digests, payloads = blocks(2, 4096)
    with dev_server.client() as client:
        client.put("dev", MODEL, digests, payloads)
        assert client.lookup("dev", MODEL, digests) == 2
        assert client.lookup("dev", MODEL + "x", digests) == 0
        assert client.get("dev", MODEL + "x", digests) == []


def test_blocks_larger_than_a_frame_and_many_small_blocks_round_trip(
    dev_server: Running, transport: str
) -> None:
    big_digests, big = blocks(2, 9 * MiB + 123)  # spans three 4 MiB gRPC frames
    small_digests, small = blocks(300, 1000)  # many blocks share one frame
    with dev_server.client(transport=transport) as client:
        client.put("dev", MODEL, big_digests + small_digests, big + small)
        assert client.get("dev", MODEL, big_digests + small_digests) == big + small


@pytest.mark.parametrize("bad", [b"", b"x" * 31, b"x" * 33])
def test_digest_not_32_bytes_is_invalid_argument_and_server_keeps_serving(
    dev_server: Running, bad: bytes
) -> None:
    digests, payloads = blocks(1, 100)
    with dev_server.client() as client:
        client.put("dev", MODEL, digests, payloads)
        for call in (
            lambda: client.lookup("dev", MODEL, [bad]),
            lambda: client.get("dev", MODEL, [bad]),
            lambda: client.put("dev", MODEL, [bad], [b"p"]),
            lambda: client.delete("dev", MODEL, [bad]),
        ):
            with pytest.raises(BlockStoreError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert isinstance(info.value, InvalidArgument)
            assert "32 bytes" in info.value.details()
        assert client.get("dev", MODEL, digests) == payloads  # still serving


def test_request_limits_say_which_limit_and_how_to_raise_it(
    start_server: Callable[..., Running], transport: str
) -> None:
    running = start_server(extra="[limits]\nmax_digests_per_call = 8\nmax_block_bytes = 65536\n")
    with running.client("a", transport=transport) as client:
        with pytest.raises(InvalidArgument, match="max_digests_per_call 8; split the call"):
            client.lookup("alpha", MODEL, [os.urandom(32)] * 9)
        with pytest.raises(InvalidArgument, match="over max_block_bytes 65536; raise it"):
            client.put("alpha", MODEL, [os.urandom(32)], [b"x" * 65537])
        with pytest.raises(InvalidArgument, match="model is empty"):
            client.lookup("alpha", "", [os.urandom(32)])
        assert client.put("alpha", MODEL, [os.urandom(32)], [b"x" * 65536]) == [True]


def test_acknowledged_blocks_survive_kill_9(tmp_path: Path) -> None:
    data_dir = tmp_path / "data"
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    token = (data_dir / "dev.token").read_text().strip()
    digests, payloads = blocks(24, 256 << 10)
    from replica_agent.client import BlockClient

    with BlockClient(server.address, token) as client:
        for i in range(0, 24, 4):  # six acknowledged puts
            assert client.put("dev", MODEL, digests[i : i + 4], payloads[i : i + 4]) == [True] * 4
    server.kill9()
    server = ServerProcess("--listen", "127.0.0.1:0", "--data-dir", str(data_dir))
    try:
        with BlockClient(server.address, token) as client:
            assert client.lookup("dev", MODEL, digests) == 24
            assert client.get("dev", MODEL, digests) == payloads
    finally:
        server.terminate()


def test_flipped_bytes_in_the_lmdb_file_are_never_served(tmp_path: Path, transport: str) -> None:
    tenancy = write_config(tmp_path)
    digests, payloads = blocks(3, 256 << 10)
    running = launch(tenancy)
    with running.client("root", transport=transport) as client:
        client.put("alpha", MODEL, digests, payloads)
    running.stop()
    flip_stored_byte(running.data_dir / "lmdb" / "data.mdb", payloads[1][:4096], 1000)
    running = launch(tenancy)
    with running.client("root", transport=transport) as client:
        assert client.lookup("alpha", MODEL, digests) == 3  # the index does not read payloads
        assert client.get("alpha", MODEL, digests) == payloads[:1]  # stops at the corrupt one
        assert client.stats().integrity_failures == 1
        assert client.lookup("alpha", MODEL, digests) == 1  # deleted: a miss from now on
        assert client.put("alpha", MODEL, digests[1:2], payloads[1:2]) == [True]  # rewritable
        assert client.get("alpha", MODEL, digests) == payloads
    running.stop()


def test_writing_3x_the_budgets_keeps_tiers_within_them_and_recent_blocks_survive(
    start_server: Callable[..., Running],
) -> None:
    storage = StorageConfig(memory_budget_bytes=2 * MiB, disk_budget_bytes=4 * MiB)
    running = start_server(storage=storage)
    block = 128 << 10
    digests, payloads = blocks(3 * 4 * MiB // block, block)  # 3x the disk budget
    with running.client("root") as client:
        for i in range(0, len(digests), 8):
            client.put("alpha", MODEL, digests[i : i + 8], payloads[i : i + 8])
            tiers = {t.name: t for t in client.stats().tiers}
            assert tiers["memory"].bytes <= 2 * MiB
            assert tiers["lmdb"].bytes <= 4 * MiB
        recent = 4 * MiB // block
        assert client.get("alpha", MODEL, digests[-recent:]) == payloads[-recent:]
        assert client.lookup("alpha", MODEL, digests[:recent]) == 0
        assert tiers["lmdb"].bytes == 4 * MiB
    running.stop()
    # Freed pages are reused: LMDB's pages stay far below 3x the budget.
    tier = LmdbTier(running.data_dir / "lmdb", map_bytes=1 << 30, sync_writes=False)
    try:
        assert tier.used_file_bytes() < 16 * MiB
    finally:
        tier.close()


def test_lmdb_map_full_is_a_clear_resource_exhausted(
    start_server: Callable[..., Running], transport: str
) -> None:
    # Acknowledged after the LMDB commit (no journal), so the put itself hears of it;
    # with the journal the drain retries and the health probe reports the failure.
    running = start_server(extra="[storage]\nlmdb_map_bytes = 1048576\njournal_bytes = 0\n")
    with running.client("a", transport=transport) as client:
        with pytest.raises(ResourceExhausted, match=r"LMDB map full.*lmdb_map_bytes"):
            client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(2 * MiB)])
        assert client.put("alpha", MODEL, [os.urandom(32)], [b"small"]) == [True]


def test_writes_beyond_the_pending_bound_are_refused_not_queued(
    start_server: Callable[..., Running], transport: str
) -> None:
    running = start_server(extra="[storage]\nmax_pending_write_bytes = 65536\n")
    with running.client("a", transport=transport) as client:
        for _ in range(3):  # positive control, and the bound is released after each commit
            assert client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(60_000)]) == [True]
        with pytest.raises(ResourceExhausted, match="max_pending_write_bytes is 65536"):
            client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(100_000)])
        assert client.put("alpha", MODEL, [os.urandom(32)], [os.urandom(60_000)]) == [True]


def test_an_admin_deletes_one_model_namespace_of_a_tenant(tenant_server: Running) -> None:
    digests, payloads = blocks(3, 4096)
    with tenant_server.client("a") as writer, tenant_server.client("root") as admin:
        writer.put("alpha", MODEL, digests, payloads)
        writer.put("alpha", MODEL + "-other", digests, payloads)
        with pytest.raises(PermissionDenied):
            writer.delete_tenant("alpha", MODEL)  # `write` is not enough
        assert admin.delete_tenant("alpha", MODEL) == 3
        assert writer.lookup("alpha", MODEL, digests) == 0
        assert writer.get("alpha", MODEL + "-other", digests) == payloads  # control: kept
        assert admin.delete_tenant("alpha") == 3
        assert writer.lookup("alpha", MODEL + "-other", digests) == 0


def test_model_tags_survive_a_restart(tmp_path: Path) -> None:
    tenancy = write_config(tmp_path)
    digests, payloads = blocks(2, 4096)
    running = launch(tenancy)
    with running.client("a") as writer:
        writer.put("alpha", MODEL, digests, payloads)
    running.stop()
    running = launch(tenancy)
    try:
        with running.client("root") as admin:
            assert admin.delete_tenant("alpha", MODEL + "-other") == 0
            assert admin.delete_tenant("alpha", MODEL) == 2
    finally:
        running.stop()
