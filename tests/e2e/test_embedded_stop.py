"""`EmbeddedServer.stop` is idempotent: a second call (a fixture's teardown after a
test stopped the server itself) used to raise RuntimeError "Event loop is closed"."""

from __future__ import annotations

from pathlib import Path

from cacheserver.config import ServerConfig
from cacheserver.embedded import EmbeddedServer


def test_stopping_an_embedded_server_twice_is_harmless(tmp_path: Path) -> None:
    server = EmbeddedServer(ServerConfig(listen="127.0.0.1:0", data_dir=tmp_path / "data"))
    server.start()
    server.stop()
    server.stop()
    assert server.server is None
