"""The health check follows the store: NOT_SERVING while the LMDB tier cannot take writes.

A probe runs every `health_interval_ms` on an executor thread (it does disk I/O): a
tiny LMDB write transaction, a free-space check, and any real commit that failed since
the last probe (`BlockStore.probe`). Both the overall status ("") and the BlockStore
service follow it, so a load balancer stops sending work to a store whose disk is full
and sends it again, without a restart, once the probe passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class HealthMonitor:
    def __init__(
        self,
        servicer: health.aio.HealthServicer,
        services: Sequence[str],
        probe: Callable[[], str | None],
        interval_s: float,
        on_change: Callable[[bool], None] = lambda serving: None,
    ) -> None:
        self._servicer = servicer
        self._services = tuple(services)
        self._probe = probe
        self._interval_s = interval_s
        self._on_change = on_change
        self._task: asyncio.Task[None] | None = None
        self.problem: str | None = None

    async def start(self) -> None:
        """Set the first status from a probe, then keep probing in the background."""
        await self._check()
        await self._publish(quiet=self.problem is None)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            before = self.problem
            try:
                await self._check()
            except Exception:  # a bug in the probe must not stop health checking
                log.exception("health probe failed unexpectedly")
                self.problem = "the health probe failed"
            if (before is None) != (self.problem is None):
                await self._publish()

    async def _check(self) -> None:
        loop = asyncio.get_running_loop()
        self.problem = await loop.run_in_executor(None, self._probe)

    async def _publish(self, *, quiet: bool = False) -> None:
        serving = self.problem is None
        if serving and not quiet:
            log.info("health: SERVING again")
        elif not serving:
            log.warning("health: NOT_SERVING (%s)", self.problem)
        for name in self._services:
            await self._servicer.set(name, SERVING if serving else NOT_SERVING)
        self._on_change(serving)
