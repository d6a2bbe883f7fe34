"""The BlockStore service: request checks, policy admission, then the store.

Each handler reads as: principal (from the interceptor) -> `policy.admit` for the named
tenant and action -> validate model and digests -> storage keys from `policy` -> store.
Client digests are turned into keyed storage names before anything else sees them.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc

from cacheserver.config import LimitsConfig
from cacheserver.events import Tier
from cacheserver.memory_tier import Payload
from cacheserver.store import BlockStore
from cacheserver.wire import current_principal
from kvcommon.errors import InvalidArgument, PermissionDenied, ResourceExhausted, Unavailable
from kvcommon.v1 import kvshare_pb2 as pb
from kvcommon.v1 import kvshare_pb2_grpc as pb_grpc
from policy import AccessPolicy, Action
from policy.tickets import TicketBook
from policy.types import ModelName, ModelTag, StorageKey, TenantId, parse_digest, parse_model

_T = TypeVar("_T")

Context = grpc.aio.ServicerContext[Any, Any]
DISK_BATCH_BYTES = 64 << 20  # read at most this much from LMDB per executor hop


@dataclass(frozen=True)
class BulkEndpoint:
    """Where OpenBulk sends callers, and the ticket book that admits them there."""

    tickets: TicketBook
    address: str
    local_address: str = ""  # the same-host listener's abstract socket name; "": none
    local_namespace: str = ""  # where that name is the server's (bulkwire.host_namespace)
    local_owner: str = ""  # the uid the server runs as, for the client's peer check


class BlockStoreService(pb_grpc.BlockStoreServicer):
    def __init__(
        self,
        store: BlockStore,
        policy: AccessPolicy,
        limits: LimitsConfig,
        bulk: BulkEndpoint | None = None,
    ) -> None:
        self._store = store
        self._policy = policy
        self._limits = limits
        self._bulk = bulk

    async def OpenBulk(self, request: pb.OpenBulkRequest, context: Context) -> pb.OpenBulkResponse:
        principal = current_principal.get()
        if self._bulk is None:
            raise Unavailable("this server has no bulk listener; use Get and Put")
        # Either action opens the connection; each request on it is admitted again.
        action = Action.READ if Action.READ in principal.actions else Action.WRITE
        tenant = self._policy.admit(principal, request.tenant, action)
        ticket = self._bulk.tickets.issue(principal, tenant)
        return pb.OpenBulkResponse(
            ticket=ticket,
            address=self._bulk.address,
            local_address=self._bulk.local_address,
            local_namespace=self._bulk.local_namespace,
            local_owner=self._bulk.local_owner,
            ttl_ms=int(self._bulk.tickets.ttl_s * 1000),
            trace_context=True,
        )

    def _keys(
        self, tenant: str, model: str, digests: Sequence[bytes], action: Action
    ) -> tuple[TenantId, list[StorageKey]]:
        tenant_id = self._policy.admit(current_principal.get(), tenant, action)
        model_name = parse_model(model)
        self._limits.check_digest_count(len(digests))
        keys = [
            self._policy.storage_key(tenant_id, model_name, parse_digest(d, i))
            for i, d in enumerate(digests)
        ]
        return tenant_id, keys

    async def Lookup(self, request: pb.LookupRequest, context: Context) -> pb.LookupResponse:
        tenant, keys = self._keys(request.tenant, request.model, request.digests, Action.READ)
        return pb.LookupResponse(present=self._store.lookup(tenant, keys))

    async def Get(self, request: pb.GetRequest, context: Context) -> AsyncIterator[pb.GetFrame]:
        tenant, keys = self._keys(request.tenant, request.model, request.digests, Action.READ)
        frame_bytes = min(
            request.max_frame_bytes or self._limits.get_frame_bytes,
            self._limits.max_message_bytes - (64 << 10),
        )
        loop = asyncio.get_running_loop()
        framer = _Framer(frame_bytes)
        served = 0
        while served < len(keys):
            tier: Tier = "memory"
            with self._store.reading():
                payloads = self._store.read_from_memory(keys[served:])
                if not payloads:
                    tier = "lmdb"
                    payloads = await loop.run_in_executor(
                        None, self._store.read_from_disk, tenant, keys[served:], DISK_BATCH_BYTES
                    )
                # Frames are built lazily, while the stream waits on its client: copy
                # views of journal records now rather than pin them that long.
                payloads = [bytes(p) if isinstance(p, memoryview) else p for p in payloads]
            if not payloads:
                break  # the first miss ends the stream
            for frame in framer.frames(served, payloads):
                yield frame
            served += len(payloads)
            self._store.note_served(tenant, tier, payloads)
        last = framer.flush()
        if last is not None:
            yield last
        self._store.note_get(tenant, len(keys), served)

    async def Put(
        self, request_iterator: AsyncIterator[pb.PutFrame], context: Context
    ) -> pb.PutResponse:
        assembler: _BlockAssembler | None = None
        futures = []
        async for frame in request_iterator:
            if assembler is None:
                if not frame.HasField("header"):
                    raise InvalidArgument("the first Put frame must carry `header` (tenant, model)")
                tenant = self._policy.admit(
                    current_principal.get(), frame.header.tenant, Action.WRITE
                )
                model = parse_model(frame.header.model)
                assembler = _BlockAssembler(
                    tenant, model, self._policy.model_tag(tenant, model), self._limits
                )
            for index, digest, payload in assembler.add(frame.chunks):
                self._policy.check_payload(assembler.tenant, payload, index)
                key = self._policy.storage_key(assembler.tenant, assembler.model, digest)
                # Off the event loop: a journaled put copies the block before it returns.
                submitted = await asyncio.get_running_loop().run_in_executor(
                    None, self._store.submit_put, assembler.tenant, key, payload, assembler.tag
                )
                futures.append((index, asyncio.wrap_future(submitted)))
        if assembler is None:
            raise InvalidArgument("empty Put stream; send a first frame with `header`")
        assembler.finish()
        return await _put_results(futures)

    async def Delete(self, request: pb.DeleteRequest, context: Context) -> pb.DeleteResponse:
        principal = current_principal.get()
        if request.whole_tenant:
            if request.digests:
                raise InvalidArgument("whole_tenant deletes take no digests; send one or the other")
            tenant = self._policy.admit(principal, request.tenant, Action.ADMIN)
            if request.model:  # one model's namespace of the tenant
                tag = self._policy.model_tag(tenant, parse_model(request.model))
                deleted = await _blocking(self._store.delete_tenant, tenant, tag)
                action = "delete_model_namespace"
            else:
                deleted = await _blocking(self._store.delete_tenant, tenant, None)
                action = "delete_tenant"
            self._policy.record_admin(principal, action, tenant=tenant, blocks=deleted)
            return pb.DeleteResponse(deleted=deleted)
        _, keys = self._keys(request.tenant, request.model, request.digests, Action.WRITE)
        return pb.DeleteResponse(deleted=await _blocking(self._store.delete, keys))

    async def Stats(self, request: pb.StatsRequest, context: Context) -> pb.StatsResponse:
        principal = current_principal.get()
        response = pb.StatsResponse()
        for tenant in sorted(self._policy.visible_tenants(principal)):
            blocks, nbytes = self._store.tenant_usage(tenant)
            c = self._store.count(tenant)
            response.tenants.append(
                pb.TenantStats(
                    tenant=tenant,
                    blocks=blocks,
                    bytes=nbytes,
                    quota_bytes=self._policy.quotas_bytes.get(tenant, 0),
                    lookups=c.lookups,
                    lookup_hits=c.lookup_hits,
                    lookup_digests=c.lookup_digests,
                    blocks_served=c.blocks_served,
                    bytes_served=c.bytes_served,
                    blocks_stored=c.blocks_stored,
                    bytes_stored=c.bytes_stored,
                )
            )
        if self._policy.is_admin(principal):
            for name, (blocks, nbytes, budget) in self._store.tier_usage().items():
                response.tiers.append(
                    pb.TierStats(name=name, blocks=blocks, bytes=nbytes, budget_bytes=budget)
                )
            response.integrity_failures = self._store.integrity_failures
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
    """Reassembles Put chunks into whole blocks; a block is released only when complete."""

    def __init__(
        self, tenant: TenantId, model: ModelName, tag: ModelTag, limits: LimitsConfig
    ) -> None:
        self.tenant = tenant
        self.model = model
        self.tag = tag
        self._limits = limits
        self._count = 0
        self._digest: Any = None
        self._expected = 0
        self._parts: list[bytes] = []
        self._received = 0

    def add(self, chunks: Sequence[pb.PutChunk]) -> Iterator[tuple[int, Any, bytes]]:
        for chunk in chunks:
            if chunk.offset == 0 and self._digest is None:
                self._start(chunk)
            elif self._digest is None or chunk.offset != self._received:
                raise InvalidArgument(
                    f"block {self._count}: chunk at offset {chunk.offset}, expected "
                    f"{self._received}; send each block's chunks in order, starting at offset 0"
                )
            self._parts.append(chunk.data)
            self._received += len(chunk.data)
            if self._received > self._expected:
                raise InvalidArgument(
                    f"block {self._count}: more bytes than its block_bytes {self._expected}"
                )
            if self._received == self._expected:
                yield self._complete()

    def _start(self, chunk: pb.PutChunk) -> None:
        self._limits.check_block_bytes(self._count, chunk.block_bytes)
        self._digest = parse_digest(chunk.digest, self._count)
        self._expected = chunk.block_bytes
        self._parts = []
        self._received = 0

    def _complete(self) -> tuple[int, Any, bytes]:
        payload = self._parts[0] if len(self._parts) == 1 else b"".join(self._parts)
        result = (self._count, self._digest, payload)
        self._count += 1
        self._digest = None
        return result

    def finish(self) -> None:
        if self._digest is not None:
            raise InvalidArgument(
                f"block {self._count} ended after {self._received} of "
                f"{self._expected} bytes; nothing of it was stored"
            )


__all__ = ["BlockStoreService", "PermissionDenied"]


async def _blocking(function: Callable[..., _T], *args: Any) -> _T:
    """Run a blocking store call (LMDB I/O, waiting for the writer) off the event loop."""
    return await asyncio.get_running_loop().run_in_executor(None, function, *args)
