"""Threads for the gRPC handlers' blocking work: reads apart from writes, and a share
of the writers per tenant.

gRPC handlers run on one event loop and hand blocking work (LMDB reads, a put waiting
for room in the journal or the writer's backlog, a delete waiting for the disk writer)
to threads. On one shared pool, a tenant whose puts wait for room held every thread,
and another tenant's read from disk waited seconds behind them (issue 15, F4). Here
reads have their own threads, and one tenant's writes hold at most half the writers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from policy.types import TenantId

_T = TypeVar("_T")
THREADS = 8  # of each kind


class Workers:
    def __init__(self, threads: int = THREADS) -> None:
        self._reads = ThreadPoolExecutor(threads, thread_name_prefix="kvshare-read")
        self._writes = ThreadPoolExecutor(threads, thread_name_prefix="kvshare-write")
        self._per_tenant = max(1, threads // 2)
        self._gates: dict[TenantId, asyncio.Semaphore] = {}

    async def read(self, function: Callable[..., _T], *args: Any) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._reads, function, *args)

    async def write(self, tenant: TenantId, function: Callable[..., _T], *args: Any) -> _T:
        gate = self._gates.get(tenant)
        if gate is None:
            gate = self._gates[tenant] = asyncio.Semaphore(self._per_tenant)
        async with gate:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(self._writes, function, *args)

    def close(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)
        self._writes.shutdown(wait=False, cancel_futures=True)
