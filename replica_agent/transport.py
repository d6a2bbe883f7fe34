"""What moves a client call: the one interface of `BlockClient`'s transports.

As in httpx, where a client builds requests and a transport moves them, `BlockClient`
builds a call and hands it to a `Transport`; a transport moves it and knows nothing of
the others. Three implement this interface:

- `GrpcCalls` (grpc_calls.py): every call, over gRPC;
- `BulkChannel` (bulk.py): lookups, reads and puts over the server's bulk channel. Each
  of its connections is TCP or TLS (bulk_connect.py), the sealed-payload channel
  (bulk_sealed.py) or, on the server's host, the same-host arena (bulk_samehost.py: its
  connections, reads and puts), chosen when the connection opens, and the channel sends
  each call to its connection's kind; anything else is `UseGrpc`;
- `Fallback` (fallback.py): the other two behind one rule, the only place that decides
  which of them carries a call, and what happens when one fails.

A transport raises the server's answers as `BlockStoreError` (replica_agent.errors),
which go to the caller as they are. When its path broke below the policy layer it
raises what the fallback rule handles (fallback.PATH_FAILURES): an `OSError` or
`ConnectionClosed` (kvcommon.bulkwire), `UseGrpc` for a call it cannot carry, and
`NoBulkListener` when the server offers no bulk channel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Protocol, TypeVar

from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.deadline import CallDeadline

Payload = bytes | bytearray | memoryview
View = bytes | memoryview  # a block as read: bytes (gRPC) or a view of a reused buffer
# Where a read's blocks are fed as their bytes arrive (`Transport.read`'s `pieces`):
# called with a block's index and size before any of its bytes, it returns what takes
# them, piece by piece, in order, or None for a block the reader takes whole (a small
# one: feeding costs more than it saves). Called again for an index whose read started
# over (the bulk channel broke and the call went over gRPC): the pieces start over too.
PieceSink = Callable[[int, int], Callable[[memoryview], None] | None]


class UseGrpc(Exception):
    """This call cannot be framed on the bulk channel; send it over gRPC."""


class NoBulkListener(Exception):
    """The server offers no bulk channel (an older server, or none configured)."""


class Transport(Protocol):
    """What moves a call. Each call runs within `deadline`, the whole call's budget."""

    def lookup(
        self, tenant: str, model: str, digests: Sequence[bytes], deadline: CallDeadline
    ) -> int:
        """How many leading digests are stored."""
        ...

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
        """The leading present payloads, each as soon as it arrived. `keep` False: a
        view may be valid only until the next one is asked for; True: until this
        thread's next call. `pieces`: every block's bytes are fed there before the
        block is yielded, as they arrive where the transport receives a block in
        pieces (the sealed channel), else whole (`fed_whole`)."""
        ...

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[Payload],
        deadline: CallDeadline,
    ) -> list[bool]:
        """Store blocks; per block True if newly stored."""
        ...

    def delete(self, request: pb.DeleteRequest, deadline: CallDeadline) -> int: ...

    def stats(self, deadline: CallDeadline) -> pb.StatsResponse: ...


B = TypeVar("B", bytes, memoryview)


def fed_whole(blocks: Iterator[B], pieces: PieceSink | None) -> Iterator[B]:
    """`blocks`, each fed whole to `pieces` before it is yielded: how a transport that
    has a block only once all of it arrived honours `pieces`. Without `pieces`,
    `blocks` itself (no generator between a read and its caller)."""
    return blocks if pieces is None else _fed_whole(blocks, pieces)


def _fed_whole(blocks: Iterator[B], pieces: PieceSink) -> Iterator[B]:
    for index, block in enumerate(blocks):
        feed = pieces(index, len(block))
        if feed is not None:
            feed(memoryview(block))
        yield block
