"""The gRPC face of the store: protobuf framing around the request core.

Each handler decodes its request, calls the core's `begin` and one verb with the
caller's principal (set by the interceptor, `cacheserver.transport.grpc.wire`), and
frames the result. No policy, naming or tier decision lives here: those are the core's,
shared with the bulk channel. Errors are `KvshareError`s, turned into statuses by the
interceptor (anything else: INTERNAL with a request id).

Blocking work (LMDB reads, waiting for the disk writer) runs on `HandlerThreads`,
never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any

import grpc

from cacheserver.blocks import BytesSource, Payload
from cacheserver.config import LimitsConfig
from cacheserver.core.requests import RequestCore
from cacheserver.core.transfers import PutStream
from cacheserver.core.values import Announced, Begun, Verb
from cacheserver.reload import ReloadOutcome
from cacheserver.transport.grpc.threads import HandlerThreads
from cacheserver.transport.grpc.wire import current_principal
from kvcommon.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from policy.identity import Principal, pem_certificate_fingerprint

Context = grpc.aio.ServicerContext[Any, Any]
# The server's live reload for a principal (who must have `admin`).
Reload = Callable[[Principal], Awaitable[ReloadOutcome]]
FRAME_SLACK_BYTES = 64 << 10  # protobuf framing around a frame's payload bytes


class BlockStoreService(pb_grpc.BlockStoreServicer):
    def __init__(
        self, core: RequestCore, limits: LimitsConfig, *, reload: Reload | None = None
    ) -> None:
        """`limits`: the ones the gRPC server was built with: its max_message_bytes
        bounds every Get frame (get_frame_bytes is the core's, live: `RequestCore.limits`).
        `reload`: the server's live reload for an admin (cacheserver.server.Server
        .reload_for); None: Reload is refused."""
        self._core = core
        self._limits = limits
        self._threads = HandlerThreads()
        self._reload = reload

    def close(self) -> None:
        self._threads.close()

    async def Reload(self, request: pb.ReloadRequest, context: Context) -> pb.ReloadResponse:
        if self._reload is None:
            raise Unavailable("this server has no live reload; restart it to change its config")
        outcome = await self._reload(current_principal.get())
        return pb.ReloadResponse(
            applied=outcome.applied, message=outcome.message, generation=outcome.generation
        )

    async def OpenBulk(self, request: pb.OpenBulkRequest, context: Context) -> pb.OpenBulkResponse:
        # The sealed-payload channel's secret may only ever cross TLS.
        sealed_channel = request.sealed_channel and _over_tls(context)
        offer = self._core.open_bulk(
            current_principal.get(),
            request.tenant,
            sealed_channel=sealed_channel,
            peer_certificate=_peer_certificate(context),
        )
        endpoint = offer.endpoint
        return pb.OpenBulkResponse(
            ticket=offer.ticket,
            address=endpoint.address,
            local_address=endpoint.local_address,
            local_namespace=offer.local_binding,
            ttl_ms=int(endpoint.tickets.ttl_s * 1000),
            trace_context=True,
            channel_secret=offer.channel_secret,
            aligned_payloads=True,
            sealed_batches=True,
        )

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        begun = self._begin(Verb.LOOKUP, request.tenant, len(request.digests))
        if self._core.lookup_blocks:  # it may ask the shared tier: off the event loop
            present = await self._threads.read(
                self._core.lookup, begun, request.model, request.digests
            )
        else:
            present = self._core.lookup(begun, request.model, request.digests)
        return pb.LookupResponse(present=present)

    async def Get(self, request: pb.GetRequest, context: Context) -> AsyncIterator[pb.GetFrame]:
        begun = self._begin(Verb.GET, request.tenant, len(request.digests))
        frame_bytes = min(
            request.max_frame_bytes or self._core.limits.get_frame_bytes,
            self._limits.max_message_bytes - FRAME_SLACK_BYTES,
        )
        framer = _Framer(frame_bytes)
        # Each batch is copied before it is framed: about two frames of it at a time,
        # so a client that stops reading holds that much server memory, not its whole
        # prefix.
        reply = self._core.get(begun, request.model, request.digests, batch_bytes=2 * frame_bytes)
        async with self._threads.get_stream(reply.tenant):
            with reply:
                while (served := await self._threads.read(reply.next_served)) is not None:
                    # Frames go out while the stream waits on its client: copy views of
                    # journal records now and let go of them, rather than pin them.
                    payloads = [
                        bytes(p) if isinstance(p, memoryview) else p for p in served.payloads
                    ]
                    reply.release()
                    for frame in framer.frames(served.first_index, payloads):
                        yield frame
        last = framer.flush()
        if last is not None:
            yield last

    async def Put(
        self, request_iterator: AsyncIterator[pb.PutFrame], context: Context
    ) -> pb.PutResponse:
        stream: PutStream | None = None
        assembler = _BlockAssembler()
        futures = []
        try:
            async for frame in request_iterator:
                if stream is None:
                    if not frame.HasField("header"):
                        raise InvalidArgument(
                            "the first Put frame must carry `header` (tenant, model)"
                        )
                    begun = self._begin(Verb.PUT, frame.header.tenant, 0)
                    stream = self._core.put(begun, frame.header.model)
                elif frame.HasField("header"):
                    raise InvalidArgument("only the first Put frame may carry `header`")
                for block, payload in assembler.add(frame.chunks, stream):
                    # Off the event loop: a journaled put copies the block before it returns.
                    submitted = await self._threads.write(
                        stream.tenant, stream.store, block, BytesSource(payload)
                    )
                    futures.append((block.index, asyncio.wrap_future(submitted)))
            if stream is None:
                raise InvalidArgument("empty Put stream; send a first frame with `header`")
            assembler.finish()
        finally:
            if stream is not None:
                stream.close()  # a partial block's receive budget
        return await _put_results(futures)

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        if request.whole_tenant:
            if request.digests:
                raise InvalidArgument("whole_tenant deletes take no digests; send one or the other")
            begun = self._begin(Verb.DELETE_NAMESPACE, request.tenant, 0)
            deleted = await self._threads.write(
                begun.tenant, self._core.delete_namespace, begun, request.model
            )
            return pb.DeleteResponse(deleted=deleted)
        begun = self._begin(Verb.DELETE, request.tenant, len(request.digests))
        deleted = await self._threads.write(
            begun.tenant, self._core.delete, begun, request.model, request.digests
        )
        return pb.DeleteResponse(deleted=deleted)

    async def Stats(self, request: pb.StatsRequest, context: Context) -> pb.StatsResponse:
        stats = self._core.stats(current_principal.get())
        response = pb.StatsResponse(integrity_failures=stats.integrity_failures)
        for view in stats.tenants:
            c = view.counts
            response.tenants.append(
                pb.TenantStats(
                    tenant=view.tenant,
                    blocks=view.blocks,
                    bytes=view.bytes,
                    quota_bytes=view.quota_bytes,
                    lookups=c.lookups,
                    lookup_hits=c.lookup_hits,
                    lookup_digests=c.lookup_digests,
                    blocks_served=c.blocks_served,
                    bytes_served=c.bytes_served,
                    blocks_stored=c.blocks_stored,
                    bytes_stored=c.bytes_stored,
                )
            )
        for name, (blocks, nbytes, budget) in stats.tiers.items():
            response.tiers.append(
                pb.TierStats(name=name, blocks=blocks, bytes=nbytes, budget_bytes=budget)
            )
        return response

    def _begin(self, verb: Verb, tenant: str, count: int) -> Begun:
        return self._core.begin(current_principal.get(), verb, tenant, count)


async def _put_results(futures: Sequence[tuple[int, asyncio.Future[bool]]]) -> pb.PutResponse:
    outcomes = await asyncio.gather(*(f for _, f in futures), return_exceptions=True)
    response = pb.PutResponse()
    refused: BaseException | None = None
    for (index, _), outcome in zip(futures, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            refused = refused or outcome
            continue
        response.results.append(
            pb.PutResult(
                index=index,
                outcome=pb.PUT_OUTCOME_STORED if outcome else pb.PUT_OUTCOME_ALREADY_PRESENT,
            )
        )
    if refused is not None:
        stored = len(response.results)
        if isinstance(refused, ResourceExhausted):
            raise ResourceExhausted(f"{refused} ({stored} of {len(futures)} blocks were stored)")
        raise refused
    return response


class _Framer:
    """Packs payloads into GetFrames of about `frame_bytes`; a block may span frames."""

    def __init__(self, frame_bytes: int) -> None:
        self._frame_bytes = max(frame_bytes, 64 << 10)
        self._frame = pb.GetFrame()
        self._filled = 0

    def frames(self, first_index: int, payloads: Sequence[Payload]) -> Iterator[pb.GetFrame]:
        for i, payload in enumerate(payloads):
            offset = 0
            while offset < len(payload) or (offset == 0 and not payload):
                take = min(len(payload) - offset, self._frame_bytes - self._filled)
                whole = offset == 0 and take == len(payload)
                data = payload if whole else payload[offset : offset + take]
                if isinstance(data, bytearray):  # protobuf takes bytes only
                    data = bytes(data)
                self._frame.chunks.add(
                    index=first_index + i, block_bytes=len(payload), offset=offset, data=data
                )
                offset += take
                self._filled += take
                if self._filled >= self._frame_bytes:
                    yield self._take()
                if not payload:
                    break

    def _take(self) -> pb.GetFrame:
        frame, self._frame, self._filled = self._frame, pb.GetFrame(), 0
        return frame

    def flush(self) -> pb.GetFrame | None:
        return self._take() if self._frame.chunks else None


class _BlockAssembler:
    """Reassembles Put chunks into whole blocks; a block is released only when complete.

    A block is announced to the put (admission: digest, count, size, room in the
    tenant's quota and in the receive budget) from its first chunk, before any of its
    bytes are kept: what a stream holds in server memory while its blocks arrive is
    bounded, per tenant and in total (cacheserver.core.admission)."""

    def __init__(self) -> None:
        self._block: Announced | None = None  # the block arriving now
        self._parts: list[bytes] = []
        self._received = 0
        self._count = 0  # blocks completed

    def add(
        self, chunks: Sequence[pb.PutChunk], stream: PutStream
    ) -> Iterator[tuple[Announced, bytes]]:
        for chunk in chunks:
            if self._block is None and chunk.offset == 0:
                self._block = stream.announce(chunk.digest, chunk.block_bytes, hold=True)
                self._parts, self._received = [], 0
            elif self._block is None or chunk.offset != self._received:
                raise InvalidArgument(
                    f"block {self._count}: chunk at offset {chunk.offset}, expected "
                    f"{self._received}; send each block's chunks in order, starting at offset 0"
                )
            expected = self._block.size
            if not chunk.data and self._received < expected:
                raise InvalidArgument(
                    f"block {self._count}: an empty chunk; every chunk carries bytes"
                )
            self._parts.append(chunk.data)
            self._received += len(chunk.data)
            if self._received > expected:
                raise InvalidArgument(
                    f"block {self._count}: more bytes than its block_bytes {expected}"
                )
            if self._received == expected:
                yield self._complete()

    def _complete(self) -> tuple[Announced, bytes]:
        assert self._block is not None
        payload = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        result = (self._block, payload)
        self._count += 1
        self._block = None
        return result

    def finish(self) -> None:
        if self._block is not None:
            raise InvalidArgument(
                f"block {self._count} ended after {self._received} of "
                f"{self._block.size} bytes; nothing of it was stored"
            )


def _peer_certificate(context: Context) -> bytes:
    """The SHA-256 of the caller's verified client certificate (mutual TLS), else b""."""
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    return pem_certificate_fingerprint(pems[0]) if pems else b""


def _over_tls(context: Context) -> bool:
    """Whether this call came over TLS (gRPC's transport security, not a header)."""
    return context.auth_context().get("transport_security_type") == [b"ssl"]
