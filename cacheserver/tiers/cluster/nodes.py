"""The connection to the Redis Cluster: the only module that imports `redis`.

redis-py's cluster client (`RedisCluster`) keeps the slot map and a connection pool per
node; commands go to nodes here, grouped into one pipeline per node, so a call never
spans two nodes and one node's failure touches only its own keys. Failures are results,
not exceptions: a node that does not answer is *down* for `retry_after_ms` (its keys are
answered `FAILED` at once, without a connect attempt), and any sign that the slot map
moved (a refused connection, MOVED, CLUSTERDOWN) asks for a refresh of the map, at most
twice a second. A cluster that cannot be reached at start-up is connected later
(`connect`, called again by the tier's maintenance thread): the server starts anyway.

Block values (`get`) and delete stream entries (`read_stream`) are read off the node's
socket by a reader of their own (`replies`), not by redis-py's: it holds no more than
its caller's bound, whatever a node announces; everything else (scripts, errors on
other commands, MOVED handling on them) stays with redis-py. The socket is that of one of redis-py's
pooled connections, which did the connecting, TLS and AUTH.

Credentials: the password file is read once, at start-up (`credentials`); TLS verifies
the nodes' certificates against `tls_ca` (or the system store).
"""

from __future__ import annotations

import hashlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeAlias, TypeVar

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (
    AskError,
    ClusterDownError,
    MovedError,
    NoScriptError,
    RedisClusterException,
    RedisError,
    TryAgainError,
)
from redis.retry import Retry

from cacheserver.tiers.cluster.config import RedisClusterConfig
from cacheserver.tiers.cluster.credentials import read_password
from cacheserver.tiers.cluster.replies import Failed as Failed
from cacheserver.tiers.cluster.replies import ReadBudget, Replies, StreamEntry

log = logging.getLogger(__name__)
REFRESH_EVERY_S = 0.5
_MAP_MOVED = (MovedError, AskError, ClusterDownError, TryAgainError)
# What a node that is down, slow or wrong raises, here or inside redis-py: its errors (a
# refused or broken connection, a timeout, an error reply), the cluster client's own (no
# node for a slot), the socket's (TLS included), and a reply that is not Redis talking
# (`replies`). Each is a miss for that node's keys, wherever in a command it comes.
_NODE_FAILED = (RedisError, RedisClusterException, OSError, ValueError)
_MOVED_WORDS = frozenset({b"MOVED", b"ASK", b"CLUSTERDOWN", b"TRYAGAIN"})


Command: TypeAlias = tuple[Any, ...]  # the command's arguments, e.g. ("GET", name)
_Read = TypeVar("_Read")


class ClusterNodes:
    def __init__(self, config: RedisClusterConfig) -> None:
        self.config = config
        self._password = read_password(config)  # now: a bad file stops the start-up
        self._client: RedisCluster | None = None
        self._lock = threading.Lock()  # _down
        self._refreshing = threading.Lock()
        self._down: dict[str, float] = {}  # node name -> monotonic time it may be tried
        self._refresh_wanted = False
        self._refreshed_at = 0.0
        self._scripts: dict[str, bytes] = {}  # sha1 -> source
        self.last_error = "not connected yet"

    # -- connection ---------------------------------------------------------------------

    def connect(self) -> bool:
        """Connect if not connected; True when connected. Never raises."""
        if self._client is not None:
            return True
        timeout_s = self.config.timeout_ms / 1000
        options: dict[str, Any] = {
            "username": self.config.username or None,
            "password": self._password,
            "socket_timeout": timeout_s,
            "socket_connect_timeout": min(timeout_s, 1.0),
        }
        if self.config.tls:  # certificates verified, host names checked
            options["ssl"] = True
            options["ssl_cert_reqs"] = "required"
            options["ssl_check_hostname"] = True
            options["ssl_ca_certs"] = str(self.config.tls_ca) if self.config.tls_ca else None
        try:
            client = RedisCluster(
                startup_nodes=[ClusterNode(n.host, n.port) for n in self.config.nodes],
                require_full_coverage=False,  # a node down: its slots miss, the rest serve
                retry=Retry(NoBackoff(), 1),
                **options,
            )
        except (RedisError, RedisClusterException, OSError) as error:
            self.last_error = f"cannot reach the cluster ({type(error).__name__})"
            return False
        with self._lock:
            self._client = client
            self._down.clear()
        self.last_error = ""
        log.info("connected to the Redis Cluster (%d nodes)", len(client.get_nodes()))
        return True

    @property
    def is_connected(self) -> bool:
        return self._client is not None

    def close(self) -> None:
        client, self._client = self._client, None
        if client is not None:
            client.close()

    def register(self, source: str) -> str:
        """A script's SHA-1, by which `script` runs it (loaded into a node when needed)."""
        body = source.encode()
        sha = hashlib.sha1(body, usedforsecurity=False).hexdigest()
        self._scripts[sha] = body
        return sha

    # -- commands -----------------------------------------------------------------------

    def run(self, commands: Sequence[tuple[bytes, Command]]) -> list[Any]:
        """Each command (routed by the key given beside it) on its node, one pipeline
        per node; a result per command, `Failed` where it failed."""
        return self._each_node(
            [key for key, _ in commands],
            lambda client, node, indices: self._on_node(
                client, node, [commands[i][1] for i in indices]
            ),
        )

    def get(
        self, names: Sequence[bytes], max_bytes: int, budget_bytes: int | None = None
    ) -> list[bytearray | Failed | None]:
        """The values of `names` (None: no such key; `Failed`: its node is down or
        answered an error, the value is over `max_bytes`, or `budget_bytes` was spent on
        values before it), one pipeline per node, each value received into a buffer of
        its own size (module docstring). A value over either is read past, never held:
        what a node announces is not trusted with the server's memory."""
        budget = None if budget_bytes is None else ReadBudget(budget_bytes)
        return self._each_node(
            names,
            lambda client, node, indices: self._get_on_node(
                client, node, [names[i] for i in indices], max_bytes, budget
            ),
        )

    def _each_node(
        self,
        keys: Sequence[bytes],
        on_node: Callable[[RedisCluster, ClusterNode, list[int]], list[Any]],
    ) -> list[Any]:
        """`on_node(client, node, indices)` once per node, for the indices of `keys`
        that node holds; its answers, each in the place of its key. Nodes come in the
        order of their first key (a read's budget goes to its first block first)."""
        results: list[Any] = [Failed("not connected")] * len(keys)
        client = self._client
        if client is None:
            return results
        for node, indices in self._by_node(client, keys, results):
            for index, answer in zip(indices, on_node(client, node, indices), strict=True):
                results[index] = answer
        self.refresh_if_wanted()
        return results

    def _by_node(
        self, client: RedisCluster, keys: Sequence[bytes], results: list[Any]
    ) -> Iterable[tuple[ClusterNode, list[int]]]:
        """The indices of `keys` grouped by the node that holds them; a key whose slot
        has no node, or whose node is down, gets its `Failed` in `results` here."""
        by_node: dict[str, tuple[ClusterNode, list[int]]] = {}
        now = time.monotonic()
        for index, key in enumerate(keys):
            try:
                node = client.get_node_from_key(key)
            except (RedisClusterException, RedisError):
                results[index] = Failed("slot not covered")
                continue
            if self._down.get(node.name, 0.0) > now:
                results[index] = Failed("node down")
                continue
            by_node.setdefault(node.name, (node, []))[1].append(index)
        return by_node.values()

    def _get_on_node(
        self,
        client: RedisCluster,
        node: ClusterNode,
        names: list[bytes],
        max_bytes: int,
        budget: ReadBudget | None,
    ) -> list[bytearray | Failed | None]:
        answers = self._read_own(
            client,
            node,
            [("GET", n) for n in names],
            lambda replies: [replies.value(max_bytes, budget) for _ in names],
        )
        if isinstance(answers, Failed):
            return [answers] * len(names)
        if any(isinstance(a, Failed) and a.reason.encode() in _MOVED_WORDS for a in answers):
            self._refresh_wanted = True
        return answers

    def read_stream(
        self, stream: bytes, position: bytes, count: int, block_ms: int, max_entry_bytes: int
    ) -> list[StreamEntry] | Failed:
        """`XREAD COUNT count BLOCK block_ms` of `stream` after `position`, read by
        `Replies.stream_entries`: an entry over `max_entry_bytes` comes with fields
        None, read past and never held (a writer to Redis chooses what is there)."""
        client = self._client
        if client is None:
            return Failed("not connected")
        results: list[Any] = [None]
        for node, _ in self._by_node(client, [stream], results):
            command = ("XREAD", "COUNT", count, "BLOCK", block_ms, "STREAMS", stream, position)
            answer = self._read_own(
                client, node, [command], lambda replies: replies.stream_entries(max_entry_bytes)
            )
            break
        else:
            return Failed(results[0].reason)  # no node for its slot, or the node is down
        if isinstance(answer, Failed) and answer.reason.encode() in _MOVED_WORDS:
            self._refresh_wanted = True
        return answer

    def _read_own(
        self,
        client: RedisCluster,
        node: ClusterNode,
        commands: list[Command],
        read: Callable[[Replies], _Read],
    ) -> _Read | Failed:
        """`commands` sent on one of the node's pooled connections, their replies read
        by `read` off its socket (module docstring); `Failed` when the node failed.

        Taking the connection is where a dead node shows first: redis-py's pool
        connects a new one, or checks a pooled one and reconnects it when the node has
        closed it, and raises when the node refuses or does not answer. A miss too."""
        try:
            pool = client.get_redis_connection(node).connection_pool
            connection = pool.get_connection()  # given back by the pool when it raises
        except _NODE_FAILED as error:
            self._node_failed(node, error)
            return Failed("node down")
        try:
            connection.send_packed_command(connection.pack_commands(commands))
            sock = connection._get_socket()  # connected by the send above
            if sock is None:
                raise redis.ConnectionError("the connection has no socket")
            return read(Replies(sock))
        except _NODE_FAILED as error:
            connection.disconnect()  # a reply half read: the connection is unusable
            self._node_failed(node, error)
            return Failed("node down")
        except BaseException:
            connection.disconnect()
            raise
        finally:
            pool.release(connection)

    def call(self, key: bytes, *command: Any) -> Any:
        """One command on the node of `key`: its result, or `Failed`."""
        return self.run([(key, command)])[0]

    def script(self, sha: str, keys: Sequence[bytes], args: Iterable[Any]) -> Any:
        """A registered script on the node of its keys (all in one slot)."""
        return self.call(keys[0], "EVALSHA", sha, len(keys), *keys, *args)

    def _on_node(
        self, client: RedisCluster, node: ClusterNode, commands: list[Command]
    ) -> list[Any]:
        try:
            answers = self._pipeline(client, node, commands)
            missing = {
                c[1] for c, a in zip(commands, answers, strict=True) if isinstance(a, NoScriptError)
            }
            if missing:  # a restarted or promoted node: load the scripts, then once more
                connection = client.get_redis_connection(node)
                for sha in missing:
                    connection.execute_command("SCRIPT", "LOAD", self._scripts[sha])
                answers = self._pipeline(client, node, commands)
        except _NODE_FAILED as error:
            self._node_failed(node, error)
            return [Failed("node down")] * len(commands)
        out: list[Any] = []
        for answer in answers:
            if isinstance(answer, Exception):
                if isinstance(answer, _MAP_MOVED):
                    self._refresh_wanted = True
                out.append(Failed(type(answer).__name__))
            else:
                out.append(answer)
        return out

    def _pipeline(
        self, client: RedisCluster, node: ClusterNode, commands: list[Command]
    ) -> list[Any]:
        connection = client.get_redis_connection(node)
        if len(commands) == 1:
            try:
                return [connection.execute_command(*commands[0])]
            except redis.ResponseError as error:
                return [error]
        pipe = connection.pipeline(transaction=False)
        for command in commands:
            pipe.execute_command(*command)
        return list(pipe.execute(raise_on_error=False))

    def _node_failed(self, node: ClusterNode, error: Exception) -> None:
        with self._lock:
            first = self._down.get(node.name, 0.0) <= time.monotonic()
            self._down[node.name] = time.monotonic() + self.config.retry_after_ms / 1000
        self._refresh_wanted = True
        self.last_error = f"node {node.name} failed ({type(error).__name__})"
        if first:
            log.warning("Redis node %s failed (%s); its blocks are misses", node.name, error)

    def refresh_if_wanted(self) -> None:
        now = time.monotonic()
        if not self._refresh_wanted or now - self._refreshed_at < REFRESH_EVERY_S:
            return
        self.refresh()

    def refresh(self) -> None:
        """Read the slot map again (a failover moved slots to a replica)."""
        client = self._client
        if client is None or not self._refreshing.acquire(blocking=False):
            return
        try:
            self._refreshed_at = time.monotonic()
            self._refresh_wanted = False
            client.nodes_manager.initialize()
        except (RedisError, RedisClusterException, OSError):
            self._refresh_wanted = True
        finally:
            self._refreshing.release()

    # -- state --------------------------------------------------------------------------

    def node_of(self, key: bytes) -> str | None:
        """The `host:port` of the node that holds `key`'s slot now (None: unknown)."""
        client = self._client
        if client is None:
            return None
        try:
            return str(client.get_node_from_key(key).name)
        except (RedisClusterException, RedisError):
            return None

    def primaries(self) -> list[ClusterNode]:
        client = self._client
        return [] if client is None else list(client.get_primaries())

    def problem(self) -> str | None:
        """Why some of the cluster cannot be used now (for health), or None. Pings
        every primary of the slot map; blocking."""
        client = self._client
        if client is None:
            return self.last_error or "not connected"
        failing = []
        for node in client.get_primaries():
            try:
                client.get_redis_connection(node).ping()
                with self._lock:
                    self._down.pop(node.name, None)
            except _NODE_FAILED as error:
                self._node_failed(node, error)
                failing.append(node.name)
        self.refresh_if_wanted()
        if failing:
            return f"Redis node(s) {', '.join(failing)} do not answer"
        return None
