"""The client's fallback rule (replica_agent.fallback), case by case, with transports
that answer as told. End to end against a real server: tests/e2e/test_client_fallback.py."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.deadline import CallDeadline
from replica_agent.errors import BlockStoreError, store_error
from replica_agent.fallback import ClientStats, Fallback
from replica_agent.transport import NoBulkListener, Payload, PieceSink, UseGrpc, View

MODEL = "m"
DIGESTS = [b"d" * 32]
KINDS = ["lookup", "read", "put", "delete"]


class Scripted:
    """A transport whose next calls raise what `errors` holds (then answer); it counts
    the calls it got. A read's error can come before its first block or after it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.calls = 0
        self.errors: list[Exception] = []
        self.mid_stream: Exception | None = None

    def _answer(self) -> None:
        self.calls += 1
        if self.errors:
            raise self.errors.pop(0)

    def lookup(
        self, tenant: str, model: str, digests: Sequence[bytes], deadline: CallDeadline
    ) -> int:
        self._answer()
        return 1

    def read(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool,
        deadline: CallDeadline,
        pieces: PieceSink | None = None,
    ) -> Iterator[View]:
        self._answer()
        yield self.name.encode()
        if self.mid_stream is not None:
            raise self.mid_stream
        yield self.name.encode()

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[Payload],
        deadline: CallDeadline,
    ) -> list[bool]:
        self._answer()
        return [True]

    def delete(self, request: pb.DeleteRequest, deadline: CallDeadline) -> int:
        if self.name == "bulk":
            raise UseGrpc("no delete")
        self._answer()
        return 1

    def stats(self, deadline: CallDeadline) -> pb.StatsResponse:
        raise AssertionError("not called here")


def make(budget_s: float | None = 10.0) -> tuple[Fallback, Scripted, Scripted, CallDeadline]:
    grpc, bulk = Scripted("grpc"), Scripted("bulk")
    rule = Fallback(
        grpc, ClientStats(), first_backoff_s=600, max_backoff_s=600, same_host_retry_s=600
    )
    rule.use(bulk)
    return rule, grpc, bulk, CallDeadline(budget_s)


def run(rule: Fallback, kind: str, deadline: CallDeadline) -> object:
    if kind == "lookup":
        return rule.lookup("t", MODEL, DIGESTS, deadline)
    if kind == "read":
        return list(rule.read("t", MODEL, DIGESTS, keep=True, deadline=deadline))
    if kind == "put":
        return rule.put("t", MODEL, DIGESTS, [b"v"], deadline)
    return rule.delete(pb.DeleteRequest(tenant="t"), deadline)


@pytest.mark.parametrize("kind", ["lookup", "read", "put"])
def test_a_broken_connection_falls_back_and_opens_the_window(kind: str) -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [ConnectionResetError()]
    run(rule, kind, deadline)
    assert (bulk.calls, grpc.calls, rule.counters.bulk_fallbacks) == (1, 1, 1)
    run(rule, kind, deadline)  # inside the window: gRPC at once, not counted again
    assert (bulk.calls, grpc.calls, rule.counters.bulk_fallbacks) == (1, 2, 1)
    assert not rule.bulk_backoff.allowed()


@pytest.mark.parametrize("kind", ["lookup", "read", "put"])
@pytest.mark.parametrize("status", ["UNAVAILABLE", "DEADLINE_EXCEEDED"])
def test_a_fallback_that_finds_the_server_unreachable_forgives_the_channel(
    kind: str, status: str
) -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [w.ConnectionClosed("closed mid-frame")]
    grpc.errors = [store_error(status, "down")]
    with pytest.raises(BlockStoreError):
        run(rule, kind, deadline)
    assert rule.bulk_backoff.allowed()  # the server was down, not the channel
    run(rule, kind, deadline)
    assert (bulk.calls, grpc.calls) == (2, 1)  # the bulk channel again at once


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_in_the_window_that_finds_the_server_unreachable_ends_it(kind: str) -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [ConnectionRefusedError()]
    run(rule, "read", deadline)  # gRPC answered: the channel's own failure
    assert not rule.bulk_backoff.allowed()
    rule.same_host_failed()
    assert not rule.same_host_allowed()
    grpc.errors = [store_error("UNAVAILABLE", "down")]
    with pytest.raises(BlockStoreError):
        run(rule, kind, deadline)
    assert rule.bulk_backoff.allowed() and rule.same_host_allowed()


@pytest.mark.parametrize("kind", KINDS)
def test_the_servers_other_answers_keep_the_window(kind: str) -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [ConnectionRefusedError()]
    run(rule, "read", deadline)
    grpc.errors = [store_error("PERMISSION_DENIED", "no")]
    with pytest.raises(BlockStoreError):
        run(rule, kind, deadline)
    assert not rule.bulk_backoff.allowed()  # positive control of the test above


@pytest.mark.parametrize("kind", ["lookup", "read", "put"])
def test_a_policy_error_on_the_bulk_channel_is_raised_not_retried(kind: str) -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [store_error("PERMISSION_DENIED", "no")]
    with pytest.raises(BlockStoreError, match="PERMISSION_DENIED"):
        run(rule, kind, deadline)
    assert grpc.calls == 0 and rule.bulk_backoff.allowed()


@pytest.mark.parametrize("kind", KINDS)
def test_a_call_the_channel_cannot_carry_goes_over_grpc_and_leaves_it_on(kind: str) -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [UseGrpc("model")]
    run(rule, kind, deadline)
    assert grpc.calls == 1 and rule.counters.bulk_fallbacks == 0
    assert rule.bulk_backoff.allowed()


def test_a_server_without_a_bulk_channel_turns_it_off_for_good() -> None:
    rule, grpc, bulk, deadline = make()
    bulk.errors = [NoBulkListener("old server")]
    for kind in KINDS:
        run(rule, kind, deadline)
    assert bulk.calls == 1 and grpc.calls == 4
    assert rule.counters.bulk_fallbacks == 0


@pytest.mark.parametrize("kind", ["lookup", "read", "put"])
def test_a_bulk_failure_that_spent_the_deadline_gives_up_without_a_fallback(kind: str) -> None:
    rule, grpc, bulk, _ = make()
    deadline = CallDeadline(10.0)
    deadline.at = 0.0  # spent (the bulk channel stalled it away)
    bulk.errors = [TimeoutError()]
    with pytest.raises(BlockStoreError, match="DEADLINE_EXCEEDED"):
        run(rule, kind, deadline)
    assert grpc.calls == 0 and not rule.bulk_backoff.allowed()


def test_a_read_that_broke_after_its_first_block_ends_unavailable() -> None:
    rule, grpc, bulk, deadline = make()
    bulk.mid_stream = ConnectionResetError()
    got: list[View] = []
    with pytest.raises(BlockStoreError, match="UNAVAILABLE"):
        for view in rule.read("t", MODEL, DIGESTS, keep=True, deadline=deadline):
            got.append(view)
    assert got == [b"bulk"] and grpc.calls == 0  # the caller keeps what it has


def test_after_its_window_the_channel_is_tried_again() -> None:
    rule, grpc, bulk, deadline = make()
    rule.bulk_backoff = type(rule.bulk_backoff)(0.0, 600)  # a window of 0 s, then doubling
    bulk.errors = [ConnectionResetError()]
    run(rule, "lookup", deadline)
    run(rule, "lookup", deadline)  # the 0 s window has passed: the channel answers
    assert (bulk.calls, grpc.calls) == (2, 1)
