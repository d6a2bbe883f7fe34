"""A 3-node Redis Cluster on loopback (kvshare.bench.redis_cluster), two ways:

- `redis-cluster`: redis-py's cluster client straight to it, what a team would use
  instead of kvshare: SET/GET, MSET/MGET across slots with `*_nonatomic`. redis-py packs
  commands with its own serializer, as the `redis` peer does (see redis_peer).
- `kvshare-cluster`: two `kvshare serve` processes over the same cluster. Blocks are
  put through server A and read through server B, which did not write them and keeps
  no copy (`local_copies = false`): every GET is a cold read from the cluster, through
  kvshare's data path (auth, keyed names, header check, the bulk channel).
- `kvshare-cluster-warm`: the same, but B keeps what it reads (the default): each
  GET cell first reads every block once through B and waits until B holds them, so
  the timed GETs are served from B's local tiers.

A put through A is acknowledged before it reaches the cluster (written behind): before
each GET cell B must find every block put (cold and warm alike); a GET through B that
finds fewer blocks than were put waits until B sees them, then reads again.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import secrets
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvshare.bench import redis_cluster
from kvshare.bench.peers.base import BenchError, ServerProcess
from kvshare.bench.peers.kvshare_peer import MAX_BULK_CONNECTIONS
from kvshare.bench.peers.redis_peer import RedisClient, _zero_copy_connection_class
from kvshare.bench.placement import LOOPBACK, Placement

TENANT = "bench"
MODEL = "kvshare-bench"
SERVING_LINE = r"serving on (\S+):(\d+)"
VISIBLE_TIMEOUT_S = 30.0
KEEP_SETTLE_S = 0.2


def _unavailable(extra: Sequence[str], at: Placement) -> str | None:
    if at.is_two_host:
        return "the cluster systems run on one host only"
    reason = redis_cluster.unavailable_reason()
    if reason is not None:
        return reason
    for module in ("redis", "hiredis", *extra):
        if importlib.util.find_spec(module) is None:
            return f"python package {module} missing (pip install -e '.[bench,cluster]')"
    return None


@dataclass(frozen=True)
class RedisClusterSpec:
    seed: str

    def connect(self) -> RedisClient:
        from redis.cluster import RedisCluster

        # A URL start-up node lets redis-py build each node's pool with this class.
        client = RedisCluster(
            url=f"redis://{self.seed}", connection_class=_zero_copy_connection_class()
        )
        return RedisClient(client, cluster=True)


class RedisClusterSystem:
    name = "redis-cluster"
    is_put_acknowledged = True
    supports_batch_get = True
    supports_lookup = True  # EXISTS, split by slot

    def __init__(self, placement: Placement = LOOPBACK) -> None:
        self._at = placement
        self._cluster: redis_cluster.LocalRedisCluster | None = None

    def unavailable_reason(self) -> str | None:
        return _unavailable((), self._at)

    def start(self, workdir: Path) -> RedisClusterSpec:
        try:
            self._cluster = redis_cluster.LocalRedisCluster(workdir / self.name).start()
        except RuntimeError as error:
            raise BenchError(str(error)) from error
        return RedisClusterSpec(self._cluster.seeds[0])

    def reserve(self, value_bytes: int, count: int) -> None:
        pass

    def clear(self) -> bool:
        if self._cluster is None:
            return False
        self._cluster.flushall()
        return True

    def server_pids(self) -> list[int]:
        return _node_pids(self._cluster)

    def stop(self) -> None:
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None


@dataclass(frozen=True)
class KvshareClusterSpec:
    writer: str  # server A's address: puts
    reader: str  # server B's address: gets
    token: str
    warm: bool

    def connect(self) -> KvshareClusterClient:
        from replica_agent.client import BlockClient

        return KvshareClusterClient(
            BlockClient(self.writer, self.token), BlockClient(self.reader, self.token), self.warm
        )


class KvshareClusterClient:
    def __init__(self, writer: Any, reader: Any, warm: bool) -> None:
        self._writer = writer
        self._reader = reader
        self._warm = warm
        self._put: dict[int, list[bytes]] = {}  # value size -> keys put, in order

    def prepare(self, value_bytes: int, blocks_per_call: int) -> None:
        self._reader.lookup(TENANT, MODEL, [bytes(32)])
        keys = self._put.get(value_bytes, [])
        if not keys:
            return
        # A writes to the cluster behind its acks: a cell starts once the cluster holds
        # every block, or the timed GETs would wait for A's writes (and share the cores
        # with them), which the direct peer's synchronous SETs never leave behind.
        self._visible(keys)
        if not self._warm:
            return
        self._reader.get(TENANT, MODEL, keys)  # B keeps each block it reads, soon after
        deadline = time.monotonic() + VISIBLE_TIMEOUT_S
        while _blocks_held(self._reader) < sum(len(k) for k in self._put.values()):
            if time.monotonic() > deadline:
                raise BenchError("server B did not keep the blocks it read")
            time.sleep(0.05)
        time.sleep(KEEP_SETTLE_S)  # other clients' blocks count too: let B finish ours

    def put(self, keys: Sequence[bytes], values: Sequence[memoryview]) -> None:
        self._writer.put(TENANT, MODEL, list(keys), list(values))
        self._put.setdefault(len(values[0]), []).extend(keys)

    def get(self, keys: Sequence[bytes]) -> Sequence[Any]:
        found: Sequence[Any] = self._reader.get_views(TENANT, MODEL, list(keys))
        if len(found) < len(keys):
            self._visible(keys)
            found = self._reader.get_views(TENANT, MODEL, list(keys))
        return found

    def lookup(self, keys: Sequence[bytes]) -> int:
        """One Lookup through B; where B does not see every key yet (A writes behind
        its acks: only while a cell is prepared), waits until it does and asks again."""
        present = int(self._reader.lookup(TENANT, MODEL, list(keys)))
        if present < len(keys):
            self._visible(keys)
            present = int(self._reader.lookup(TENANT, MODEL, list(keys)))
        return present

    def _visible(self, keys: Sequence[bytes]) -> None:
        """Until B finds every key (A writes to the cluster behind its acks)."""
        deadline = time.monotonic() + VISIBLE_TIMEOUT_S
        while self._reader.lookup(TENANT, MODEL, list(keys)) < len(keys):
            if time.monotonic() > deadline:
                raise BenchError("blocks put through server A never reached server B")
            time.sleep(0.02)

    def close(self) -> None:
        self._writer.close()
        self._reader.close()


def _node_pids(cluster: redis_cluster.LocalRedisCluster | None) -> list[int]:
    if cluster is None:
        return []
    return [node.process.pid for node in cluster.running() if node.process is not None]


def _blocks_held(client: Any) -> int:
    return sum(int(t.blocks) for t in client.stats().tenants if t.tenant == TENANT)


class KvshareClusterSystem:
    is_put_acknowledged = True
    supports_batch_get = True
    supports_lookup = True  # through B

    def __init__(self, *, warm: bool = False, placement: Placement = LOOPBACK) -> None:
        self.name = "kvshare-cluster-warm" if warm else "kvshare-cluster"
        self._warm = warm
        self._at = placement
        self._cluster: redis_cluster.LocalRedisCluster | None = None
        self._servers: list[ServerProcess] = []

    def unavailable_reason(self) -> str | None:
        return _unavailable(("cacheserver.tiers.cluster.tier",), self._at)

    def start(self, workdir: Path) -> KvshareClusterSpec:
        try:
            self._cluster = redis_cluster.LocalRedisCluster(workdir / f"{self.name}-redis").start()
            token = secrets.token_urlsafe(24)
            addresses = [
                self._serve(workdir, role, token, keep=role == "a" or self._warm)
                for role in ("a", "b")
            ]
        except (RuntimeError, BenchError, OSError) as error:
            self.stop()
            raise BenchError(f"{self.name} did not start: {error}") from error
        return KvshareClusterSpec(addresses[0], addresses[1], token, self._warm)

    def _serve(self, workdir: Path, role: str, token: str, *, keep: bool) -> str:
        assert self._cluster is not None
        secret = workdir / f"{self.name}.secret"
        if not secret.exists():
            secret.write_bytes(os.urandom(32))
            secret.chmod(0o600)
        config = workdir / f"{self.name}-{role}.toml"
        nodes = ", ".join(f'"{seed}"' for seed in self._cluster.seeds)
        digest = hashlib.sha256(token.encode()).hexdigest()
        config.write_text(
            f'listen = "127.0.0.1:0"\nsecret_file = "{secret}"\n'
            f'[[tenants]]\nid = "{TENANT}"\n'
            f'[[principals]]\nname = "bench"\ntoken_sha256 = "{digest}"\n'
            f'tenants = ["{TENANT}"]\nactions = ["read", "write", "admin"]\n'
            "requests_per_s = 0\n"  # as kvshare_peer's: the bench's clients are not throttled
            f"[redis_cluster]\nnodes = [{nodes}]\nlocal_copies = {str(keep).lower()}\n"
            f"[bulk]\nmax_arenas = {MAX_BULK_CONNECTIONS}\n"
            f"max_arenas_per_principal = {MAX_BULK_CONNECTIONS}\n"
        )
        argv = [sys.executable, "-m", "kvshare.cli", "serve", "--config", str(config)]
        argv += ["--data-dir", str(workdir / f"{self.name}-{role}-data")]
        server = ServerProcess.launch(argv, workdir / f"{self.name}-{role}.log")
        self._servers.append(server)
        match = server.wait_for_line(SERVING_LINE)
        return f"{match.group(1)}:{match.group(2)}"

    def reserve(self, value_bytes: int, count: int) -> None:
        pass

    def clear(self) -> bool:
        return False  # a fresh cluster and servers per round bound what they hold

    def server_pids(self) -> list[int]:
        """Both kvshare servers and the cluster's nodes: the whole backend of a call."""
        return [server.pid for server in self._servers] + _node_pids(self._cluster)

    def stop(self) -> None:
        for server in self._servers:
            server.stop()
        self._servers = []
        if self._cluster is not None:
            self._cluster.stop()
            self._cluster = None
