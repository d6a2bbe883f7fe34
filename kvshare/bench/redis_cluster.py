"""A Redis Cluster on this host's loopback, for the benchmark and the tests.

Debian's `redis-server` started once per node with `--cluster-enabled yes`, joined with
`redis-cli --cluster create ... --cluster-yes`: N primaries, each with R replicas. Nodes
run with persistence off and `noeviction` (a full node refuses writes instead of
evicting blocks that another tenant's quota accounts for), and with
`cluster-require-full-coverage no`, so a node that dies takes only its own slots down.
"""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

REDIS_SERVER = "redis-server"
REDIS_CLI = "redis-cli"
BUS_PORT_OFFSET = 10000  # Redis Cluster's node-to-node port


def unavailable_reason() -> str | None:
    for program, package in ((REDIS_SERVER, "redis-server"), (REDIS_CLI, "redis-tools")):
        if shutil.which(program) is None:
            return f"{program} not found (Debian: apt-get install -y {package})"
    return None


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _pick_port(taken: set[int]) -> int:
    for _ in range(200):
        port = random.randint(20000, 50000)
        if port not in taken and _free(port) and _free(port + BUS_PORT_OFFSET):
            return port
    raise RuntimeError("no free loopback port pair for a Redis Cluster node")


@dataclass(frozen=True)
class ClusterAccess:
    """TLS (a CA and the nodes' certificate and key) and an ACL user, both optional."""

    ca: Path | None = None
    cert: Path | None = None
    key: Path | None = None
    # The certificate nodes present to each other on the cluster bus (which always
    # checks peers): one for client authentication, signed by `ca`.
    peer_cert: Path | None = None
    peer_key: Path | None = None
    username: str = ""
    password: str = ""
    key_pattern: str = "*"  # the ACL user's keys, e.g. "kvshare:*"

    def server_args(self, port: int) -> list[str]:
        args = ["--port", str(port)]
        if self.ca is not None:
            args = ["--port", "0", "--tls-port", str(port), "--tls-cluster", "yes"]
            args += ["--tls-replication", "yes", "--tls-auth-clients", "no"]
            args += ["--tls-cert-file", str(self.cert), "--tls-key-file", str(self.key)]
            args += ["--tls-ca-cert-file", str(self.ca)]
            if self.peer_cert is not None:
                args += ["--tls-client-cert-file", str(self.peer_cert)]
                args += ["--tls-client-key-file", str(self.peer_key)]
        if self.username:
            rule = [self.username, "on", f">{self.password}", f"~{self.key_pattern}", "&*"]
            args += ["--user", *rule, "+@all", "--user", "default", "off"]
            args += ["--masteruser", self.username, "--masterauth", self.password]
        return args

    def cli_args(self) -> list[str]:
        args = ["--tls", "--cacert", str(self.ca)] if self.ca is not None else []
        if self.username:
            args += ["--user", self.username, "--pass", self.password, "--no-auth-warning"]
        return args


@dataclass
class RedisNode:
    port: int
    directory: Path
    access: ClusterAccess = field(default_factory=ClusterAccess)
    process: subprocess.Popen[bytes] | None = None
    log: IO[bytes] | None = field(default=None, repr=False)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str, timeout_s: float = 10) -> str:
        done = subprocess.run(
            [REDIS_CLI, "-p", str(self.port), *self.access.cli_args(), *args],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        return done.stdout


class LocalRedisCluster:
    def __init__(
        self,
        workdir: Path,
        *,
        primaries: int = 3,
        replicas: int = 0,
        node_timeout_ms: int = 1000,
        access: ClusterAccess | None = None,
    ) -> None:
        self.workdir = workdir
        self.access = access or ClusterAccess()
        self.primaries = primaries
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes: list[RedisNode] = []

    @property
    def seeds(self) -> list[str]:
        return [node.address for node in self.nodes]

    def start(self, timeout_s: float = 60) -> LocalRedisCluster:
        taken: set[int] = set()
        for index in range((1 + self.replicas) * self.primaries):
            port = _pick_port(taken)
            taken.add(port)
            node = RedisNode(port, self.workdir / f"redis-{index}", self.access)
            node.directory.mkdir(parents=True, exist_ok=True)
            self.nodes.append(node)
            self._launch(node)
        for node in self.nodes:
            self._wait_listening(node, timeout_s)
        create = [REDIS_CLI, *self.access.cli_args(), "--cluster", "create", *self.seeds]
        create += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(
            create, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if done.returncode != 0:
            self.stop()
            raise RuntimeError(f"redis-cli --cluster create failed: {done.stdout[-400:]}")
        self.wait_healthy(timeout_s)
        return self

    def _launch(self, node: RedisNode) -> None:
        argv = [
            REDIS_SERVER,
            *self.access.server_args(node.port),
            "--bind", "127.0.0.1",
            "--cluster-enabled", "yes",
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-require-full-coverage", "no",
            "--cluster-replica-validity-factor", "0",  # a replica may always take over
            "--save", "",
            "--appendonly", "no",
            "--maxmemory-policy", "noeviction",
            "--dir", str(node.directory),
        ]  # fmt: skip
        node.log = (node.directory / "redis.log").open("ab")
        node.process = subprocess.Popen(
            argv, stdout=node.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
        )

    def _wait_listening(self, node: RedisNode, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if "PONG" in node.cli("ping", timeout_s=5):
                return
            time.sleep(0.05)
        raise RuntimeError(f"redis-server on port {node.port} did not start")

    def wait_healthy(self, timeout_s: float = 30, nodes: list[RedisNode] | None = None) -> None:
        """Until every running node says the cluster is ok."""
        deadline = time.monotonic() + timeout_s
        for node in nodes if nodes is not None else self.running():
            while "cluster_state:ok" not in node.cli("cluster", "info"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the cluster is not ok on node {node.port}")
                time.sleep(0.1)

    def running(self) -> list[RedisNode]:
        return [n for n in self.nodes if n.process is not None and n.process.poll() is None]

    def primary_nodes(self) -> list[RedisNode]:
        return [n for n in self.running() if "role:master" in n.cli("info", "replication")]

    def kill(self, node: RedisNode) -> None:
        """SIGKILL: what a crashed host looks like to the cluster."""
        if node.process is not None:
            node.process.send_signal(signal.SIGKILL)
            node.process.wait(timeout=10)

    def wait_promoted(self, dead: RedisNode, timeout_s: float = 30) -> None:
        """Until a replica of `dead` has taken over its slots (all slots ok again)."""
        deadline = time.monotonic() + timeout_s
        survivors = self.running()
        while time.monotonic() < deadline:
            if all(self._promoted_in(n, dead) for n in survivors):
                return
            time.sleep(0.1)
        raise RuntimeError(f"no replica took over from node {dead.port}")

    @staticmethod
    def _promoted_in(view: RedisNode, dead: RedisNode) -> bool:
        """Whether `view` sees `dead` failed, owning no slot, and every slot served."""
        for line in view.cli("cluster", "nodes").splitlines():
            fields = line.split()
            is_dead = len(fields) >= 8 and fields[1].split("@")[0] == dead.address
            if is_dead and ("fail" not in fields[2].split(",") or len(fields) > 8):
                return False
        return "cluster_slots_ok:16384" in view.cli("cluster", "info")

    def flushall(self) -> None:
        for node in self.primary_nodes():
            node.cli("flushall")

    def stop(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                node.process.terminate()
                try:
                    node.process.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    node.process.kill()
                    node.process.wait(timeout=10)
            if node.log is not None:
                node.log.close()
                node.log = None

    def __enter__(self) -> LocalRedisCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
