"""Bugs the reliability campaign found (model-based test, fuzzing, fault injection),
one focused regression test each, against a real `kvshare serve`.

Each is fixed at its cause; the list, with the fix, is in docs/reliability.md. A bug
found later that cannot be fixed at once gets its test here marked xfail(strict) (CI
stays green while the bug is there and turns red, XPASS, once it is fixed) and, for the
model-based test, an entry in `store_machine.KNOWN_BUGS`."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.reliability.harness import PrincipalSpec, TenantSpec
from replica_agent.client import BlockClient
from tests.support.reliability import Serve

MODEL = "rel/bugs@r1;L2"
BLOCK = 6 << 10
QUOTA = 3 * BLOCK  # three blocks
BETA = [TenantSpec("beta", QUOTA)]
OWNER = [PrincipalSpec("b", ("beta",), ("read", "write"))]
DIGESTS = [bytes([i]) * 32 for i in range(4)]
PAYLOADS = [bytes([i]) * BLOCK for i in range(4)]


def _usage(client: BlockClient) -> tuple[int, int]:
    (beta,) = client.stats().tenants
    return beta.blocks, beta.bytes


def _present(client: BlockClient) -> int:
    return sum(len(client.get("beta", MODEL, [d])) for d in DIGESTS)


def test_one_put_call_over_the_quota_leaves_the_tenant_within_it(serve: Serve) -> None:
    """Without the journal, a put call whose later block evicts an earlier block of the
    same call commits as one batch: the evicted block must not be written with it
    (IndexedTiers.plan's superseded jobs), or the tenant ends over its quota."""
    server, tenancy = serve(BETA, OWNER, storage={"journal_bytes": 0})
    with BlockClient(server.address, tenancy.tokens["b"]) as client:
        assert client.put("beta", MODEL, DIGESTS, PAYLOADS) == [True] * 4
        # positive control: the last block of the call is there
        assert client.get("beta", MODEL, DIGESTS[3:]) == PAYLOADS[3:]
        assert _present(client) == 3
        assert _usage(client) == (3, QUOTA)


@pytest.mark.slow
def test_replay_after_kill_9_keeps_the_tenant_within_its_quota(serve: Serve) -> None:
    """The journal replay after kill -9 commits its records as one batch: a record a
    later one of the batch evicts must not be stored (the same fix as above)."""
    storage = {"drain_idle_ms": 600_000}  # nothing reaches LMDB before the kill
    server, tenancy = serve(BETA, OWNER, storage=storage)
    with BlockClient(server.address, tenancy.tokens["b"]) as client:
        assert client.put("beta", MODEL, DIGESTS, PAYLOADS) == [True] * 4
        assert _usage(client) == (3, QUOTA)  # the journaled path evicts correctly
    server.kill9()
    server, _ = serve(BETA, OWNER, storage=storage, tokens=tenancy.tokens)
    with BlockClient(server.address, tenancy.tokens["b"]) as client:
        assert client.get("beta", MODEL, DIGESTS[3:]) == PAYLOADS[3:]  # replayed
        assert _present(client) == 3
        assert _usage(client) == (3, QUOTA)


# -- found by benchmarks/fuzz.py ----------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("authenticated", [True, False], ids=["token", "no-token"])
def test_a_malformed_request_gets_a_contract_status_and_no_traceback(
    serve: Serve, authenticated: bool
) -> None:
    """Bytes that are not a protobuf message are decoded after the auth wrapper (so a
    stranger's garbage costs no parsing), and refused with a contract status, without a
    traceback in the log."""
    import grpc

    from benchmarks.reliability.fuzz_wire import raw_bytes

    server, tenancy = serve(BETA, OWNER)
    metadata = (("authorization", f"Bearer {tenancy.tokens['b']}"),) if authenticated else ()
    with grpc.insecure_channel(server.address) as channel:
        lookup = channel.unary_unary("/kvshare.v1.BlockStore/Lookup", raw_bytes, raw_bytes)
        with pytest.raises(grpc.RpcError) as refused:
            lookup(b"\xff\xff\xff", metadata=metadata, timeout=10)
    expected = (
        grpc.StatusCode.INVALID_ARGUMENT if authenticated else grpc.StatusCode.UNAUTHENTICATED
    )
    assert refused.value.code() == expected
    assert "Traceback" not in server.log_path.read_text()


def _hostile_bulk_get(script: bytes, *, local: bool) -> BaseException | None:
    """A BulkChannel.get against a server that answers `script`: what it raised."""
    from benchmarks.reliability.fuzz_wire import HostileServer, hostile_ticket
    from replica_agent.bulk import BulkChannel

    hostile = HostileServer()
    hostile.script = script
    hostile.arena = (1 << 20, True)
    ticket = hostile_ticket(hostile, local=local)
    channel = BulkChannel(lambda _t, _d: ticket, timeout_s=5)
    try:
        channel.get("t", "m", [bytes(32)])
    except BaseException as error:  # what the caller would have to handle
        return error
    finally:
        channel.close()
    return None


@pytest.mark.parametrize(
    ("script", "local", "refusal"),
    [
        # TCP: handshake OK, GET OK, then a block of 2^63 + 5 bytes
        (bytes([0, 0]) + (2**63 + 5).to_bytes(8, "big"), False, "announced a"),
        # same host: ARENA_REPLY OK, GET OK, then LOCAL_GET announcing 2^32 - 1 blocks
        (
            bytes([0]) + (1 << 20).to_bytes(8, "big") + bytes([0]) + b"\xff\xff\xff\xff\x00",
            True,
            "more blocks than asked",
        ),
    ],
    ids=["tcp-size-2^63", "arena-count-2^32"],
)
def test_a_hostile_bulk_reply_ends_in_an_error_the_client_handles(
    script: bytes, local: bool, refusal: str
) -> None:
    """Sizes and counts a hostile server announces are checked before
    anything is allocated for them; the client raises a store error (DATA_LOSS), which
    its caller turns into a miss."""
    from benchmarks.reliability.fuzz_wire import HANDLED
    from replica_agent.errors import BlockStoreError

    raised = _hostile_bulk_get(script, local=local)
    assert isinstance(raised, HANDLED), repr(raised)
    assert isinstance(raised, BlockStoreError), repr(raised)
    assert raised.code().name == "DATA_LOSS"
    assert refusal in raised.details()  # refused by the check meant for it


# -- found by benchmarks/faults.py ---------------------------------------------------------

ALPHA = [TenantSpec("alpha", 0), TenantSpec("beta", 0)]
BOTH = [
    PrincipalSpec("a", ("alpha",), ("read", "write")),
    PrincipalSpec("b", ("beta",), ("read", "write")),
    PrincipalSpec("root", ("alpha", "beta"), ("read", "admin")),
]


@pytest.mark.slow
def test_blocks_acknowledged_while_the_lmdb_map_is_full_survive_kill_9(
    serve: Serve, journal_dir: Path
) -> None:
    """With the journal on and LMDB's map full, puts are acknowledged into the journal
    until it fills. After kill -9, LMDB still cannot take them: the start must fail with
    what to change and keep the journal (it used to drop them and start a new one), and
    a start with a bigger map replays every acknowledged block."""
    import os

    storage = {"lmdb_map_bytes": 8 << 20, "disk_budget_bytes": 1 << 30}
    server, tenancy = serve(ALPHA, BOTH, storage=storage)
    acked = []
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        for _ in range(200):  # until refused: the map, then the journal, fill up
            digest = os.urandom(32)
            try:
                client.put("alpha", MODEL, [digest], [digest * 8192])
            except Exception:
                break
            acked.append(digest)
        assert len(acked) > 40  # positive control: the journal took more than LMDB could
        assert client.lookup("alpha", MODEL, acked) == len(acked)
    server.kill9()
    (ring,) = journal_dir.glob("*.journal")
    with pytest.raises(RuntimeError) as failed:  # the same map: the start fails
        serve(ALPHA, BOTH, storage=storage, tokens=tenancy.tokens)
    assert "server exited (2)" in str(failed.value)
    (line,) = [x for x in str(failed.value).splitlines() if "kvshare serve: error:" in x]
    assert "acknowledged blocks" in line and "raise [storage] lmdb_map_bytes" in line
    assert ring.exists()  # kept for the next start
    bigger = {**storage, "lmdb_map_bytes": 64 << 20}
    server, _ = serve(ALPHA, BOTH, storage=bigger, tokens=tenancy.tokens)
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        assert client.get("alpha", MODEL, acked) == [d * 8192 for d in acked]


def test_a_corrupt_journal_record_is_counted(serve: Serve, journal_dir: Path) -> None:
    """A journal record whose payload fails its checksum at replay is never served, and
    is counted in integrity_failures like a corrupt block read from LMDB."""
    import os

    from benchmarks.reliability.fault_scenarios2 import _flip_near

    storage = {"drain_idle_ms": 600_000}  # the blocks stay in the journal only
    server, tenancy = serve(ALPHA, BOTH, storage=storage)
    digests = [os.urandom(32) for _ in range(2)]
    payloads = [d * 2048 for d in digests]
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        client.put("alpha", MODEL, digests, payloads)
    server.kill9()
    (ring,) = journal_dir.glob("*.journal")
    assert _flip_near(ring, payloads[0][:64], 1000)
    server, _ = serve(ALPHA, BOTH, storage=storage, tokens=tenancy.tokens)
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        assert client.get("alpha", MODEL, digests[1:]) == payloads[1:]  # positive control
        assert client.get("alpha", MODEL, digests[:1]) == []  # never served
    with BlockClient(server.address, tenancy.tokens["root"]) as admin:
        assert admin.stats().integrity_failures == 1


@pytest.mark.slow
def test_a_stalled_bulk_get_does_not_stop_another_tenants_puts(serve: Serve) -> None:
    """A bulk GET left unread does not keep the journal from wrapping
    (transfer deadlines): another tenant's puts go on."""
    import os

    from benchmarks.reliability.fault_scenarios import MODEL as AGENT_MODEL
    from benchmarks.reliability.fault_scenarios2 import _agent

    server, tenancy = serve(ALPHA, BOTH, storage={"journal_bytes": 16 << 20})
    big = [os.urandom(32) for _ in range(8)]
    with BlockClient(server.address, tenancy.tokens["a"]) as client:
        # 8 x 1 MiB, under the model the agent script asks for
        client.put("alpha", AGENT_MODEL, big, [d * (1 << 15) for d in big])
    stalled = _agent(server.address, tenancy.tokens["a"], "get", b"".join(big))
    try:
        with BlockClient(server.address, tenancy.tokens["b"]) as other:
            for _ in range(40):  # 40 MiB through a 16 MiB journal: it must wrap
                digest = os.urandom(32)
                assert other.put("beta", MODEL, [digest], [digest * (1 << 15)]) == [True]
                assert other.get("beta", MODEL, [digest]) == [digest * (1 << 15)]
    finally:
        stalled.kill()
        stalled.wait(30)


@pytest.mark.slow
def test_a_put_refused_for_a_full_map_says_what_to_change(serve: Serve) -> None:
    """With the journal on, a put refused because LMDB cannot take more (its map is
    full) names the map, not the journal: more journal space would only postpone it."""
    import os

    from replica_agent.client import BlockStoreError

    storage = {"lmdb_map_bytes": 8 << 20, "disk_budget_bytes": 1 << 30}
    server, tenancy = serve(ALPHA, BOTH, storage=storage)
    with (
        BlockClient(server.address, tenancy.tokens["a"]) as client,
        pytest.raises(BlockStoreError) as refused,
    ):
        for _ in range(200):
            digest = os.urandom(32)
            client.put("alpha", MODEL, [digest], [digest * 8192])
    assert refused.value.code().name == "RESOURCE_EXHAUSTED"
    assert "lmdb_map_bytes" in refused.value.details()
    assert "journal_bytes" not in refused.value.details()
