"""Run a real server in a background thread of this process (tests, `kvshare demo`).

Same `Server` as `kvshare serve`, on its own event loop in a daemon thread, so a
caller gets the real gRPC stack, real LMDB and real policy with one `with` block.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from types import TracebackType

from cacheserver.config import ServerConfig
from cacheserver.server import Server, TlsFiles
from cacheserver.telemetry import ServerTelemetry


class EmbeddedServer:
    def __init__(
        self,
        config: ServerConfig,
        tls: TlsFiles | None = None,
        telemetry: ServerTelemetry | None = None,
    ) -> None:
        self.config = config
        self._tls = tls
        self._telemetry = telemetry
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="kvshare-server", daemon=True
        )
        self.server: Server | None = None
        self.address = ""

    def start(self) -> str:
        self._thread.start()
        future: Future[str] = asyncio.run_coroutine_threadsafe(self._start(), self._loop)
        try:
            self.address = future.result(timeout=60)
        except BaseException:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            raise
        return self.address

    async def _start(self) -> str:
        self.server = Server(self.config, self._tls, self._telemetry)
        return await self.server.start()

    def stop(self, grace_s: float = 1.0) -> None:
        """Stop the server and its loop; stopping again does nothing."""
        if self._loop.is_closed():
            return
        if self.server is not None:
            asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self._loop).result(60)
            self.server = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> EmbeddedServer:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
