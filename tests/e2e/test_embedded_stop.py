"""A bug found while writing the vLLM suite, left to the server refactor's owner:
`EmbeddedServer.stop` is not idempotent (cacheserver/embedded.py, `stop`: a second call
runs `call_soon_threadsafe` on the loop the first call closed and raises RuntimeError
"Event loop is closed"). Strict xfail: it fails the suite once `stop` is fixed, so this
marker is removed with the fix."""

from __future__ import annotations

from pathlib import Path

import pytest

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer


@pytest.mark.xfail(strict=True, raises=RuntimeError, reason="EmbeddedServer.stop twice raises")
def test_stopping_an_embedded_server_twice_is_harmless(tmp_path: Path) -> None:
    server = EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data"))
    server.start()
    server.stop()
    server.stop()
