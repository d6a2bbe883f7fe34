"""A start that fails lets go of what the server opened before it: the store's threads,
its journal, LMDB and the data dir's lock (cacheserver.server.Server.start)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from pathlib import Path

import pytest

from cacheserver.config import load_config
from cacheserver.server import Server
from kvcommon.errors import ConfigError
from tests.support.servers import write_config

STORE_THREADS = ("kvshare-fsync", "kvshare-prefault", "kvshare-writer")


def store_threads(before: set[threading.Thread]) -> list[str]:
    """The store threads started since `before` that are still alive."""
    started = set(threading.enumerate()) - before
    return sorted(t.name for t in started if t.name.startswith(STORE_THREADS))


def test_a_start_that_fails_stops_the_stores_threads_and_frees_the_data_dir(
    tmp_path: Path,
) -> None:
    before = set(threading.enumerate())
    config = load_config(write_config(tmp_path).path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        busy = dataclasses.replace(config, listen=f"127.0.0.1:{port}")
        server = Server(busy)
        assert store_threads(before) == list(STORE_THREADS)  # up before the listen
        with pytest.raises(ConfigError, match="port is in use"):
            asyncio.run(server.start())
        assert store_threads(before) == []
    # Control: the data dir's lock is free, and a server on it starts and stops.
    again = Server(config)

    async def start_and_stop() -> str:
        address = await again.start()
        await again.stop(grace_s=0)
        return address

    assert asyncio.run(start_and_stop()).startswith("127.0.0.1:")
    assert store_threads(before) == []
