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

from collections.abc import Iterator, Sequence
from typing import Protocol

from kvcommon.v1 import kvshare_pb2 as pb
from replica_agent.deadline import CallDeadline

Payload = bytes | bytearray | memoryview
View = bytes | memoryview  # a block as read: bytes (gRPC) or a view of a reused buffer


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
    ) -> Iterator[View]:
        """The leading present payloads, each as soon as it arrived. `keep` False: a
        view may be valid only until the next one is asked for; True: until this
        thread's next call."""
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
