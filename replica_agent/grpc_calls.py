"""The client's gRPC transport (replica_agent.transport): one method per RPC, errors
mapped once.

Used for every call that moves no payload (Lookup, Delete, Stats, OpenBulk), and for
Get and Put when the bulk channel is off or unavailable. Each call carries the caller's
trace context (W3C `traceparent`), so the server's span joins the caller's trace.

Every call has a gRPC deadline: `timeout_s` from its start, or what is left of the
`CallDeadline` of a BlockClient call it is part of (OpenBulk for a bulk call, or the
fallback after the bulk channel failed). gRPC applies it to the whole call, a Get
stream's last frame included, however slowly the frames come.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from kvcommon.hostport import bulk_dial_address
from kvcommon.tracing import outgoing_metadata
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from replica_agent.deadline import CallDeadline
from replica_agent.errors import from_rpc_error, store_error
from replica_agent.transport import NoBulkListener, Payload, PieceSink, fed_whole

# No kvshare block comes near this (the server's max_block_bytes defaults to 128 MiB; a
# 256-token block of a 70B model is 80 MiB): bigger is a broken or hostile server, whose
# size must never become an allocation.
MAX_BLOCK_BYTES = 1 << 30


@dataclass(frozen=True)
class Ticket:
    """What OpenBulk answered: a one-time ticket and where to present it."""

    ticket: bytes
    address: str  # "host:port" of the TCP (or TLS) listener, as this client dials it
    traced: bool  # the listener reads requests that carry a trace context
    local_address: str = ""  # the same-host listener's name; "": none
    # where that listener counts, bound to this ticket (policy.tickets.local_binding)
    local_binding: str = ""
    # The sealed-payload channel's secret (replica_agent.bulk_sealed); b"": TLS as usual.
    channel_secret: bytes = field(default=b"", repr=False)
    # The listener pads GET replies asked for with ALIGNED (kvcommon.bulkwire).
    aligned: bool = False
    # The listener answers sealed-channel GETs asked for with BATCHED (kvcommon.bulkwire).
    sealed_batches: bool = False


class GrpcCalls:
    """Every call over gRPC; a `Transport`, and OpenBulk's tickets for the bulk channel."""

    def __init__(
        self,
        channel: grpc.Channel,
        target: str,
        token: str | Callable[[], str],
        timeout_s: float | None,
        frame_bytes: int,
        *,
        sealed_channel: bool = False,
    ) -> None:
        """`sealed_channel`: ask OpenBulk for the sealed-payload channel (BlockClient).
        `token`: the bearer token, or what gives the one to send now (a rotated token
        file: replica_agent.credentials.TokenFile), asked on every call."""
        self._stub = pb_grpc.BlockStoreStub(channel)
        self._sealed_channel = sealed_channel
        self._target = target
        self._token = token if callable(token) else lambda: token
        self._sent: tuple[str, tuple[tuple[str, str], ...]] = ("", ())
        self.timeout_s = timeout_s
        self.frame_bytes = frame_bytes

    def _auth(self) -> tuple[tuple[str, str], ...]:
        """The authorization metadata of the current token (built once per token)."""
        token = self._token()
        sent, metadata = self._sent
        if token != sent:
            metadata = (("authorization", f"Bearer {token}"),)
            self._sent = (token, metadata)
        return metadata

    def _timeout_s(self, deadline: CallDeadline | None) -> float | None:
        """A call's gRPC timeout: what is left of `deadline`, else `timeout_s`."""
        return self.timeout_s if deadline is None else deadline.grpc_timeout_s()

    def _call(self, method: Any, request: Any, deadline: CallDeadline | None = None) -> Any:
        timeout = self._timeout_s(deadline)
        try:
            return method(request, timeout=timeout, metadata=self._auth() + outgoing_metadata())
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None

    def open_bulk(self, tenant: str, deadline: CallDeadline | None = None) -> Ticket:
        timeout = self._timeout_s(deadline)
        try:
            response = self._stub.OpenBulk(
                pb.OpenBulkRequest(tenant=tenant, sealed_channel=self._sealed_channel),
                timeout=timeout,
                metadata=self._auth() + outgoing_metadata(),
            )
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.UNIMPLEMENTED:
                raise NoBulkListener("the server predates the bulk channel") from None
            raise from_rpc_error(error) from None
        return Ticket(
            response.ticket,
            bulk_dial_address(response.address, self._target),
            response.trace_context,
            response.local_address,
            response.local_namespace,
            # Used only where it was asked for: over TLS (BlockClient), by a caller that
            # opens every block it reads.
            response.channel_secret if self._sealed_channel else b"",
            response.aligned_payloads,
            response.sealed_batches,
        )

    def lookup(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        deadline: CallDeadline | None = None,
    ) -> int:
        request = pb.LookupRequest(tenant=tenant, model=model, digests=digests)
        return int(self._call(self._stub.Lookup, request, deadline).present)

    def read(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        *,
        keep: bool = True,
        deadline: CallDeadline | None = None,
        pieces: PieceSink | None = None,
    ) -> Iterator[bytes]:
        """The leading present payloads, each yielded as soon as its last byte arrives,
        so a caller can copy block i to the device while block i+1 is on the wire.
        Each is fresh bytes, kept whatever `keep` says; fed whole to `pieces` first."""
        request = pb.GetRequest(
            tenant=tenant, model=model, digests=digests, max_frame_bytes=self.frame_bytes
        )
        timeout = self._timeout_s(deadline)
        call = self._stub.Get(request, timeout=timeout, metadata=self._auth() + outgoing_metadata())
        try:
            yield from fed_whole(_assembled(call), pieces)
        except grpc.RpcError as error:
            raise from_rpc_error(error) from None
        finally:
            call.cancel()  # a consumer that stops early frees the stream at once

    def put(
        self,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        payloads: Sequence[Payload],
        deadline: CallDeadline | None = None,
    ) -> list[bool]:
        frames = _put_frames(tenant, model, digests, payloads, self.frame_bytes)
        response = self._call(self._stub.Put, frames, deadline)
        stored = [False] * len(digests)
        for result in response.results:
            stored[result.index] = result.outcome == pb.PUT_OUTCOME_STORED
        return stored

    def delete(self, request: pb.DeleteRequest, deadline: CallDeadline | None = None) -> int:
        return int(self._call(self._stub.Delete, request, deadline).deleted)

    def stats(self, deadline: CallDeadline | None = None) -> pb.StatsResponse:
        response: pb.StatsResponse = self._call(self._stub.Stats, pb.StatsRequest(), deadline)
        return response


def _assembled(frames: Iterator[pb.GetFrame]) -> Iterator[bytes]:
    """The blocks of a Get stream's chunks. Chunks that do not continue their block
    exactly, or a stream that ends inside a block, are DATA_LOSS: a malformed reply is
    a store failure (the gate's breaker counts it), not a shorter prefix."""
    assembled, filled = 0, 0
    partial: bytearray | None = None
    for frame in frames:
        for chunk in frame.chunks:
            if chunk.index != assembled:
                raise store_error("DATA_LOSS", "server sent blocks out of order")
            if partial is None:
                if chunk.offset != 0:
                    raise store_error("DATA_LOSS", "server sent a chunk without its start")
                if len(chunk.data) == chunk.block_bytes:
                    assembled += 1
                    yield chunk.data  # a whole block in one chunk: no copy
                    continue
                partial, filled = bytearray(_checked_size(chunk.block_bytes)), 0
            end = filled + len(chunk.data)
            if chunk.offset != filled or chunk.block_bytes != len(partial) or end > len(partial):
                raise store_error("DATA_LOSS", "server sent a chunk that does not fit its block")
            partial[filled:end] = chunk.data
            filled = end
            if filled == len(partial):
                assembled += 1
                yield bytes(partial)
                partial = None
    if partial is not None:
        raise store_error("DATA_LOSS", "the server's stream ended inside a block")


def _checked_size(size: int) -> int:
    if size > MAX_BLOCK_BYTES:
        raise store_error("DATA_LOSS", f"the server announced a {size}-byte block")
    return size


def _put_frames(
    tenant: str,
    model: str,
    digests: Sequence[bytes],
    payloads: Sequence[Payload],
    frame_bytes: int,
) -> Iterator[pb.PutFrame]:
    frame = pb.PutFrame(header=pb.PutHeader(tenant=tenant, model=model))
    filled = 0
    for digest, payload in zip(digests, payloads, strict=True):
        view = memoryview(payload).cast("B")
        offset = 0
        while True:
            take = min(len(view) - offset, frame_bytes - filled)
            data = (
                payload
                if take == len(view) and isinstance(payload, bytes)
                else bytes(view[offset : offset + take])
            )
            frame.chunks.add(
                digest=digest if offset == 0 else b"",
                block_bytes=len(view),
                offset=offset,
                data=data,
            )
            offset += take
            filled += take
            if filled >= frame_bytes:
                yield frame
                frame, filled = pb.PutFrame(), 0
            if offset >= len(view):
                break
    if frame.chunks or frame.HasField("header"):
        yield frame
