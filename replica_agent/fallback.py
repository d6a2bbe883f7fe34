"""The client's one fallback rule.

`BlockClient` hands every call to a `Fallback`, a transport (replica_agent.transport)
made of two others: gRPC (`GrpcCalls`: every call) and the server's bulk channel
(`BulkChannel`: lookups, reads and puts over TCP, TLS, the sealed-payload channel or
the same-host arena; anything else is `UseGrpc`). It is the one place that decides,
for every call (lookup, get, get_views, iter_views, put, delete, stats):

- which transport: the bulk channel while it is up, else gRPC;
- when to fall back: a call the bulk channel cannot frame (`UseGrpc`) goes over gRPC,
  this call only; a connection that fails (refused, reset, closed mid-frame: an
  `OSError` or `ConnectionClosed`) sends this call over gRPC with what is left of its
  deadline, counted in `ClientStats.bulk_fallbacks`; a server without a bulk channel
  (`NoBulkListener`) turns it off for good. The server's own answers (policy errors,
  OpenBulk's statuses) are raised whatever the transport: gRPC would answer the same;
- when to back off: after a failed connection the bulk channel is off for a window that
  doubles up to `max_backoff_s` while failures repeat (one warning per window), and is
  tried again after it. The same-host arena has a window of its own (`same_host`):
  after it was refused or failed, the bulk channel uses TCP for a while;
- when to forgive: a call that gRPC carried (a fallback in the same call, a call made
  while the bulk channel is in its window, or a call only gRPC carries) and that finds
  the server unreachable (UNAVAILABLE, DEADLINE_EXCEEDED) ends both windows. The server
  was down or restarting, not the channel at fault, so the bulk channel is used again
  as soon as the server is back; an engine's scheduler, which only looks up, would
  otherwise pay gRPC's per-call cost for up to a minute after every restart;
- when to give up: the deadline (replica_agent.deadline) is the whole call's. When the
  bulk channel used all of it (a stalled reply) there is no fallback: the call ends
  DEADLINE_EXCEEDED at its deadline, and the window sends the next calls over gRPC.
  A read that failed after its first block was handed out cannot fall back either (the
  caller holds part of the answer): it ends UNAVAILABLE (DEADLINE_EXCEEDED when out of
  time), and the caller keeps what it already has.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvcommon import bulkwire as w
from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.deadline import CallDeadline
from replica_agent.errors import BlockStoreError, store_error
from replica_agent.transport import (
    NoBulkListener,
    Payload,
    PieceSink,
    Transport,
    UseGrpc,
    View,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# What a transport raises when its path broke below the policy layer (or, UseGrpc and
# NoBulkListener, when it cannot carry the call): the fallback rule's to handle. Anything
# else (BlockStoreError: the server's answer) goes to the caller as it is.
PATH_FAILURES = (OSError, w.ConnectionClosed, NoBulkListener, UseGrpc)
# gRPC's statuses for a server it could not reach (down, restarting, or too slow).
UNREACHABLE = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED"})


@dataclass
class ClientStats:
    bulk_fallbacks: int = 0  # calls sent over gRPC because the bulk channel failed
    same_host_connections: int = 0  # bulk connections that got the same-host arena
    same_host_fallbacks: int = 0  # same-host connections refused or failed: TCP instead


class Backoff:
    """Off for a while after a failure, doubling while failures repeat."""

    def __init__(self, first_s: float, max_s: float) -> None:
        self._first_s, self._max_s = first_s, max_s
        self._delay_s = 0.0
        self._until = 0.0
        self._lock = threading.Lock()

    def allowed(self) -> bool:
        return time.monotonic() >= self._until

    def failed(self) -> bool:
        """Start (or extend) the off window; True when this opens a new window."""
        with self._lock:
            now = time.monotonic()
            if now < self._until:
                return False
            self._delay_s = min(self._max_s, max(self._first_s, 2 * self._delay_s))
            self._until = now + self._delay_s
            return True

    def succeeded(self) -> None:
        self._delay_s = 0.0

    def forgive(self) -> None:
        """The failure was not the channel's (the whole server was unreachable): no
        window, so the channel is tried first as soon as the server answers again."""
        with self._lock:
            self._delay_s = self._until = 0.0


class Fallback:
    """The bulk channel when it is up, else gRPC: the module docstring's rule, for
    every call. `use(bulk)` adds the bulk channel; without it every call goes over
    gRPC. A `Transport` itself."""

    def __init__(
        self,
        grpc: Transport,
        stats: ClientStats,
        *,
        first_backoff_s: float,
        max_backoff_s: float,
        same_host_retry_s: float,
    ) -> None:
        self._grpc = grpc
        self._bulk: Transport | None = None
        self.counters = stats
        self.bulk_backoff = Backoff(first_backoff_s, max_backoff_s)
        self.same_host_backoff = Backoff(same_host_retry_s, same_host_retry_s)

    def use(self, bulk: Transport) -> None:
        self._bulk = bulk

    # -- the same-host arena's window (the bulk channel asks and tells) ----------------

    def same_host_allowed(self) -> bool:
        return self.same_host_backoff.allowed()

    def same_host_failed(self) -> None:
        self.counters.same_host_fallbacks += 1
        self.same_host_backoff.failed()

    def same_host_opened(self) -> None:
        self.counters.same_host_connections += 1

    # -- calls ------------------------------------------------------------------------

    def lookup(
        self, tenant: str, model: str, digests: Sequence[bytes], deadline: CallDeadline
    ) -> int:
        return self._call(deadline, lambda t: t.lookup(tenant, model, digests, deadline))

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
        """The leading present payloads. The bulk channel's first block (or its end) is
        received here, where a broken connection can still fall back; the rest as the
        caller asks. `pieces`: as `Transport.read` (a block a broken bulk read had
        started is fed again from its start, over gRPC)."""
        # `_bulk_now` written out, and no helper for the first block: the hot path.
        bulk = self._bulk
        if bulk is not None and self.bulk_backoff.allowed():
            try:
                rest = bulk.read(
                    tenant, model, digests, keep=keep, deadline=deadline, pieces=pieces
                )
                first = next(rest, None)
            except PATH_FAILURES as error:
                self._bulk_failed(error, deadline)
            else:
                self.bulk_backoff.succeeded()
                return _then(first, rest, deadline)
        fallback = self._grpc.read(
            tenant, model, digests, keep=keep, deadline=deadline, pieces=pieces
        )
        return self._forgiving(fallback)

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[Payload],
        deadline: CallDeadline,
    ) -> list[bool]:
        """Puts are idempotent: one the bulk channel dropped may go over gRPC."""
        return self._call(deadline, lambda t: t.put(tenant, model, digests, payloads, deadline))

    def delete(self, request: pb.DeleteRequest, deadline: CallDeadline) -> int:
        return self._call(deadline, lambda t: t.delete(request, deadline))

    def stats(self, deadline: CallDeadline) -> pb.StatsResponse:
        return self._call(deadline, lambda t: t.stats(deadline))

    # -- the rule ---------------------------------------------------------------------

    def _call(self, deadline: CallDeadline, call: Callable[[Transport], T]) -> T:
        """`call` on the bulk channel while it is up, else (or when it failed) on gRPC."""
        bulk = self._bulk_now()
        if bulk is not None:
            try:
                result = call(bulk)
            except PATH_FAILURES as error:
                self._bulk_failed(error, deadline)
            else:
                self.bulk_backoff.succeeded()
                return result
        try:
            return call(self._grpc)
        except BlockStoreError as error:
            self._unreachable(error)
            raise

    def _forgiving(self, fallback: Iterator[View]) -> Iterator[View]:
        """A read over gRPC: its errors come as the caller asks for blocks."""
        try:
            yield from fallback
        except BlockStoreError as error:
            self._unreachable(error)
            raise

    def _bulk_now(self) -> Transport | None:
        bulk = self._bulk
        return bulk if bulk is not None and self.bulk_backoff.allowed() else None

    def _bulk_failed(self, error: Exception, deadline: CallDeadline) -> None:
        """The bulk path broke below the policy layer: this call goes over gRPC with
        what is left of `deadline`, or ends DEADLINE_EXCEEDED when nothing is."""
        if isinstance(error, UseGrpc):
            return  # this call only; nothing is wrong with the channel
        if isinstance(error, NoBulkListener):
            log.info("the server has no bulk channel; using gRPC")
            self._bulk = None
            return
        if self.bulk_backoff.failed():
            log.warning(
                "bulk channel failed (%s); using gRPC, retrying the bulk channel later",
                type(error).__name__,
            )
        if deadline.is_spent():  # a fallback now would only add to the stall
            raise deadline.exceeded() from None
        self.counters.bulk_fallbacks += 1

    def _unreachable(self, error: BlockStoreError) -> None:
        """gRPC could not reach the server: whatever failed before was the server, not
        the channel (module docstring)."""
        if error.code().name in UNREACHABLE:
            self.bulk_backoff.forgive()
            self.same_host_backoff.forgive()


def _then(first: View | None, rest: Iterator[View], deadline: CallDeadline) -> Iterator[View]:
    """`first`, then the rest of a bulk read; a connection lost mid-stream is an
    UNAVAILABLE error, a reply too slow for the deadline DEADLINE_EXCEEDED (the caller
    keeps what it already has)."""
    if first is None:
        return
    yield first
    try:
        yield from rest
    except (OSError, w.ConnectionClosed) as error:
        if deadline.is_spent():
            raise deadline.exceeded() from None
        raise store_error("UNAVAILABLE", f"bulk transfer broke: {error}") from None
