"""Threads for the gRPC handlers' blocking work — reads apart from writes, a share of
the writers per tenant — and a bound on the Get streams each tenant keeps open.

gRPC handlers run on one event loop and hand blocking work (LMDB reads, a put waiting
for room in the journal or the writer's backlog, a delete waiting for the disk writer)
to threads. On one shared pool, a tenant whose puts wait for room held every thread,
and another tenant's read from disk waited seconds behind them. Here reads have their
own threads, and one tenant's writes hold at most half the writers.

A Get stream copies a batch of blocks (about two frames) before it frames them, and
gRPC keeps the frames it was handed until the client's flow-control window takes
them: a client that stops reading holds roughly that much server memory per stream. So
one tenant keeps at most `GET_STREAMS_PER_TENANT` streams sending at once (and all
tenants `GET_STREAMS`); more wait, holding nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from policy.types import TenantId

_T = TypeVar("_T")
THREADS = 8  # of each kind
GET_STREAMS = 16
GET_STREAMS_PER_TENANT = 4  # a replica reads on one stream per thread


class HandlerThreads:
    """The gRPC handlers' threads (reads, and writes per tenant) and Get-stream slots."""

    def __init__(self, threads: int = THREADS) -> None:
        self._reads = ThreadPoolExecutor(threads, thread_name_prefix="kvshare-read")
        self._writes = ThreadPoolExecutor(threads, thread_name_prefix="kvshare-write")
        self._per_tenant = max(1, threads // 2)
        self._gates: dict[TenantId, asyncio.Semaphore] = {}
        self._streams: asyncio.Semaphore | None = None  # made on the server's loop
        self._tenant_streams: dict[TenantId, asyncio.Semaphore] = {}

    async def read(self, function: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._reads, function, *args)

    async def write(self, tenant: TenantId, function: Callable[..., _T], *args: Any) -> _T:
        gate = self._gates.get(tenant)
        if gate is None:
            gate = self._gates[tenant] = asyncio.Semaphore(self._per_tenant)
        async with gate:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._writes, function, *args)

    @contextlib.asynccontextmanager
    async def get_stream(self, tenant: TenantId) -> AsyncIterator[None]:
        """A slot for one Get stream of `tenant` (waits for one)."""
        if self._streams is None:
            self._streams = asyncio.Semaphore(GET_STREAMS)
        gate = self._tenant_streams.get(tenant)
        if gate is None:
            gate = self._tenant_streams[tenant] = asyncio.Semaphore(GET_STREAMS_PER_TENANT)
        async with gate, self._streams:
            yield

    def close(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)
