"""The gRPC face of the store: protobuf framing around the request core.

Each handler reads its request, calls one `RequestCore` method with the caller's
principal (set by the interceptor, `cacheserver.transport.grpc.wire`), and frames the result. No
policy, naming or tier decision lives here: those are the core's, shared with the bulk
listener. Errors are `KvshareError`s, turned into statuses by the interceptor.

Blocking work (LMDB reads, waiting for the disk writer) runs on the default executor,
never on the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any, TypeVar

import grpc

from cacheserver.blocks import BytesSource
from cacheserver.core.requests import AdmittedPut, RequestCore
from cacheserver.events import NoEvents
from cacheserver.store.backlog import WriteBacklog
from cacheserver.tiers import Payload
from cacheserver.transport.grpc.wire import current_principal
from cacheserver.transport.grpc.workers import Workers
from kvcommon.errors import InvalidArgument, ResourceExhausted
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from policy import Action
from policy.identity import pem_certificate_fingerprint
from policy.types import StorageKey

_T = TypeVar("_T")
Context = grpc.aio.ServicerContext[Any, Any]
FRAME_SLACK_BYTES = 64 << 10  # protobuf framing around a frame's payload bytes


class BlockStoreService(pb_grpc.BlockStoreServicer):
    def __init__(self, core: RequestCore, receive_bytes: int) -> None:
        """`receive_bytes`: the most bytes of blocks a Put stream may hold while they
        arrive, over all tenants (one tenant: half); see `_BlockAssembler`."""
        self._core = core
        self._workers = Workers()
        self._receiving = WriteBacklog(receive_bytes, NoEvents(), hurry=lambda: None)

    def close(self) -> None:
        self._workers.close()

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
        )

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        admitted = self._core.admit(
            current_principal.get(), Action.READ, request.tenant, request.model, request.digests
        )
        if self._core.store.lookup_blocks:  # issue 17: it may ask the Redis Cluster
            return pb.LookupResponse(present=await self._workers.read(self._core.lookup, admitted))
        return pb.LookupResponse(present=self._core.lookup(admitted))

    async def Get(self, request: pb.GetRequest, context: Context) -> AsyncIterator[pb.GetFrame]:
        admitted = self._core.admit(
            current_principal.get(), Action.READ, request.tenant, request.model, request.digests
        )
        limits = self._core.limits
        frame_bytes = min(
            request.max_frame_bytes or limits.get_frame_bytes,
            limits.max_message_bytes - FRAME_SLACK_BYTES,
        )
        framer = _Framer(frame_bytes)
        # Each batch is copied before it is framed: about two frames of it at a time,
        # so a client that stops reading holds that much server memory, not its whole
        # prefix (issue 15, F6).
        batch_bytes = 2 * frame_bytes
        async with self._workers.get_stream(admitted.tenant):
            with self._core.read(admitted) as reading:
                while True:
                    batch = await self._workers.read(reading.next_batch, batch_bytes)
                    if batch is None:
                        break
                    # Frames go out while the stream waits on its client: copy views of
                    # journal records now and let go of them, rather than pin them.
                    payloads = [
                        bytes(p) if isinstance(p, memoryview) else p for p in batch.payloads
                    ]
                    reading.release()
                    for frame in framer.frames(reading.served - len(payloads), payloads):
                        yield frame
        last = framer.flush()
        if last is not None:
            yield last

    async def Put(
        self, request_iterator: AsyncIterator[pb.PutFrame], context: Context
    ) -> pb.PutResponse:
        put: AdmittedPut | None = None
        assembler = _BlockAssembler(self._receiving)
        futures = []
        try:
            async for frame in request_iterator:
                if put is None:
                    if not frame.HasField("header"):
                        raise InvalidArgument(
                            "the first Put frame must carry `header` (tenant, model)"
                        )
                    put = self._core.admit_put(
                        current_principal.get(), frame.header.tenant, frame.header.model
                    )
                elif frame.HasField("header"):
                    raise InvalidArgument("only the first Put frame may carry `header`")
                for index, key, payload in assembler.add(frame.chunks, put, self._core):
                    # Off the event loop: a journaled put copies the block before it returns.
                    submitted = await self._workers.write(
                        put.tenant, self._core.put, put, index, key, BytesSource(payload)
                    )
                    assembler.handed_over(put, len(payload))
                    futures.append((index, asyncio.wrap_future(submitted)))
            if put is None:
                raise InvalidArgument("empty Put stream; send a first frame with `header`")
            assembler.finish()
        finally:
            if put is not None:
                assembler.abandon(put)
        return await _put_results(futures)

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        principal = current_principal.get()
        if request.whole_tenant:
            if request.digests:
                raise InvalidArgument("whole_tenant deletes take no digests; send one or the other")
            tenant = self._core.admit_tenant(principal, request.tenant, Action.ADMIN)
            deleted = await self._workers.write(
                tenant, self._core.delete_namespace, principal, request.tenant, request.model
            )
            return pb.DeleteResponse(deleted=deleted)
        admitted = self._core.admit(
            principal, Action.WRITE, request.tenant, request.model, request.digests
        )
        deleted = await self._workers.write(admitted.tenant, self._core.delete, admitted)
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

    A block's declared size is admitted (the core's name_block: digest, count, size,
    room in the tenant's quota) from its first chunk, and taken from the stream's
    receive budget, before any of its bytes are kept: what a stream holds in server
    memory while its blocks arrive is bounded, per tenant and in total (issue 15, F6)."""

    def __init__(self, budget: WriteBacklog) -> None:
        self._budget = budget
        self._held = 0  # bytes taken from the budget: the block arriving now
        self._count = 0
        self._key = StorageKey(b"")
        self._expected = -1  # -1: between blocks
        self._parts: list[bytes] = []
        self._received = 0

    def add(
        self, chunks: Sequence[pb.PutChunk], put: AdmittedPut, core: RequestCore
    ) -> Iterator[tuple[int, StorageKey, bytes]]:
        for chunk in chunks:
            if self._expected < 0 and chunk.offset == 0:
                self._key = core.name_block(put, self._count, chunk.digest, chunk.block_bytes)
                self._budget.reserve(put.tenant, chunk.block_bytes, 0.0)
                self._held = chunk.block_bytes
                self._expected = chunk.block_bytes
                self._parts, self._received = [], 0
            elif self._expected < 0 or chunk.offset != self._received:
                raise InvalidArgument(
                    f"block {self._count}: chunk at offset {chunk.offset}, expected "
                    f"{self._received}; send each block's chunks in order, starting at offset 0"
                )
            if not chunk.data and self._received < self._expected:
                raise InvalidArgument(
                    f"block {self._count}: an empty chunk; every chunk carries bytes"
                )
            self._parts.append(chunk.data)
            self._received += len(chunk.data)
            if self._received > self._expected:
                raise InvalidArgument(
                    f"block {self._count}: more bytes than its block_bytes {self._expected}"
                )
            if self._received == self._expected:
                yield self._complete()

    def _complete(self) -> tuple[int, StorageKey, bytes]:
        payload = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        result = (self._count, self._key, payload)
        self._count += 1
        self._expected = -1
        return result

    def handed_over(self, put: AdmittedPut, nbytes: int) -> None:
        """The store has the complete block: its bytes leave the receive budget."""
        self._budget.release(put.tenant, nbytes)
        self._held -= nbytes

    def abandon(self, put: AdmittedPut) -> None:
        """The stream ended (well or not): give back what a partial block held."""
        if self._held:
            self._budget.release(put.tenant, self._held)
            self._held = 0

    def finish(self) -> None:
        if self._expected >= 0:
            raise InvalidArgument(
                f"block {self._count} ended after {self._received} of "
                f"{self._expected} bytes; nothing of it was stored"
            )


def _peer_certificate(context: Context) -> bytes:
    """The SHA-256 of the caller's verified client certificate (mutual TLS), else b""."""
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    return pem_certificate_fingerprint(pems[0]) if pems else b""


def _over_tls(context: Context) -> bool:
    """Whether this call came over TLS (gRPC's transport security, not a header)."""
    return context.auth_context().get("transport_security_type") == [b"ssl"]
