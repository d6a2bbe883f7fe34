"""Redis as a peer: Debian's `redis-server` on a free loopback port, redis-py with hiredis.

`redis-unix` is the same server reached over a Unix socket instead: Redis's fastest
transport on one host, the fair peer of kvshare's same-host transport.

It is what a team would reach for first. The server runs with persistence off (`--save
''`, `--appendonly no`), which is the fastest Redis can be and keeps no acknowledged
write across a crash (kvshare's blocks do survive one). redis-py returns a fresh
`bytes` per GET; that allocation is part of what a Redis client costs.

The client is redis-py at its best: hiredis parses replies (the default once hiredis is
installed), but commands are packed by redis-py's own serializer, which sends a large
value as its own buffer; hiredis's packer copies it into one string first, which
measured here 2.5x slower for 2 MiB SETs.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshare.bench.peers.base import BenchError, ServerProcess, free_loopback_port, wait_for_port
from kvshare.bench.placement import LOOPBACK, Placement

REDIS_SERVER = "redis-server"


@dataclass(frozen=True)
class RedisClientSpec:
    host: str
    port: int
    unix_socket: str | None = None  # set: connect over this Unix socket instead

    def connect(self) -> RedisClient:
        import redis

        if self.unix_socket is not None:
            pool = redis.ConnectionPool(
                path=self.unix_socket, connection_class=_zero_copy_connection_class(unix=True)
            )
        else:
            pool = redis.ConnectionPool(
                host=self.host, port=self.port, connection_class=_zero_copy_connection_class()
            )
        return RedisClient(redis.Redis(connection_pool=pool))


def _zero_copy_connection_class(*, unix: bool = False) -> type[Any]:
    import redis
    from redis.connection import PythonRespSerializer

    base = redis.UnixDomainSocketConnection if unix else redis.Connection

    class ZeroCopyPackingConnection(base):  # type: ignore[misc, valid-type]
        def _construct_command_packer(self, packer: Any) -> Any:
            return PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    return ZeroCopyPackingConnection


class RedisClient:
    """One Redis, or (`cluster`) a Redis Cluster through redis-py's cluster client,
    whose multi-key calls split by slot (`mset_nonatomic`, `mget_nonatomic`)."""

    def __init__(self, connection: Any, *, cluster: bool = False) -> None:
        self._redis = connection
        self._mset = connection.mset_nonatomic if cluster else connection.mset
        self._mget = connection.mget_nonatomic if cluster else connection.mget

    def prepare(self, value_bytes: int, blocks_per_call: int) -> None:
        self._redis.ping()

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        if len(keys) == 1:
            self._redis.set(keys[0], values[0])
        else:
            self._mset(dict(zip(keys, values, strict=True)))

    def get(self, keys: Sequence[bytes]) -> list[bytes]:
        found = [self._redis.get(keys[0])] if len(keys) == 1 else self._mget(keys)
        leading = []
        for value in found:
            if value is None:
                break
            leading.append(value)
        return leading

    def lookup(self, keys: Sequence[bytes]) -> int:
        """`EXISTS k1 ... kn`: one command, the count of keys held (a cluster client
        splits it by slot, as it does MGET)."""
        return int(self._redis.exists(*keys))

    def close(self) -> None:
        self._redis.close()


class RedisSystem:
    is_put_acknowledged = True
    supports_batch_get = True  # MGET
    supports_lookup = True  # EXISTS k1 ... kn

    def __init__(self, *, unix: bool = False, placement: Placement = LOOPBACK) -> None:
        self.name = "redis-unix" if unix else "redis"
        self._unix = unix
        self._at = placement
        self._server: ServerProcess | None = None
        self._spec: RedisClientSpec | None = None

    def unavailable_reason(self) -> str | None:
        if self._unix and self._at.is_two_host:
            return "a Unix socket does not cross hosts (redis is the two-host peer)"
        if shutil.which(REDIS_SERVER) is None:
            return "redis-server not found (Debian: apt-get install -y redis-server)"
        try:
            import hiredis  # noqa: F401
            import redis  # noqa: F401
        except ImportError as error:
            return f"python package {error.name} missing (pip install -e '.[bench]')"
        return None

    def start(self, workdir: Path) -> RedisClientSpec:
        host = self._at.server_host
        for _ in range(3):  # a free port can be taken between probe and bind
            port = free_loopback_port()
            argv = [
                REDIS_SERVER,
                "--port",
                str(port),
                "--bind",
                host,
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(workdir),
                # Protected mode refuses clients off loopback when there is no password;
                # the two-host server's only network is the benchmark's own veth.
                "--protected-mode",
                "no" if self._at.is_two_host else "yes",
                "--maxmemory-policy",
                "noeviction",
            ]
            socket_path = workdir / "redis.sock"
            if self._unix:
                argv += ["--unixsocket", str(socket_path), "--unixsocketperm", "700"]
            log_path = workdir / "redis-server.log"
            server = ServerProcess.launch(self._at.server_command(argv), log_path)
            try:
                wait_for_port(host, port, 30.0, server.process)
            except BenchError:
                server.stop()
                continue
            self._server = server
            self._spec = RedisClientSpec(host, port, str(socket_path) if self._unix else None)
            return self._spec
        raise BenchError(f"redis-server did not start on a free port of {host} in 3 tries")

    def reserve(self, value_bytes: int, count: int) -> None:
        pass

    def clear(self) -> bool:
        if self._spec is None:
            return False
        client = self._spec.connect()
        try:
            client._redis.flushall()
        finally:
            client.close()
        return True

    def server_pids(self) -> list[int]:
        return [] if self._server is None else [self._server.pid]

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop()
            self._server = None
