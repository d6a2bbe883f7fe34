"""Fault scenarios of the Redis Cluster tier (see fault_scenarios.py for the common
parts): two `kvshare serve` processes over a real 3-node Redis Cluster on loopback
(kvshare.bench.redis_cluster), as docs/scale-out.md deploys them."""

from __future__ import annotations

import os
import threading
import time
from collections import Counter

from benchmarks.reliability.fault_scenarios import MODEL, PRINCIPALS, TENANTS, Env, Outcome
from benchmarks.reliability.harness import (
    ServerProc,
    Tenancy,
    count_internal_errors,
    write_tenancy,
)
from kvshare.bench.redis_cluster import LocalRedisCluster, RedisNode, unavailable_reason
from replica_agent.client import BlockClient
from replica_agent.errors import BlockStoreError

KiB = 1 << 10
STORED = 48  # blocks put through the first server, over all three nodes
ABSENT = 16  # digests never stored: each read of one goes to its node, every time
LOAD_BEFORE_S = 1.0  # reads through the second server before the node goes...
LOAD_AFTER_S = 3.0  # ...and after (past several retry_after_ms windows)
TRANSPORTS = ("grpc", "bulk-tcp")
READERS_PER_TRANSPORT = 2


def _servers(env: Env, cluster: LocalRedisCluster) -> tuple[list[ServerProc], Tenancy]:
    """Two servers of one config (tenants, principals, secret, the cluster), each with
    its own data dir; `local_copies = false`, so every read of a block the other server
    wrote goes to the cluster, however often it was read before."""
    secret = env.directory / "server.secret"
    secret.write_bytes(os.urandom(32))
    secret.chmod(0o600)
    nodes = ", ".join(f'"{seed}"' for seed in cluster.seeds)
    storage = {"journal_dir": str(env.journal_dir)}
    servers, tokens = [], None
    tenancy = None
    for index in range(2):
        directory = env.directory / f"server{index}"
        tenancy = write_tenancy(directory, TENANTS, PRINCIPALS, storage=storage, tokens=tokens)
        tokens = tenancy.tokens
        text = tenancy.path.read_text()
        tenancy.path.write_text(
            f'secret_file = "{secret}"\n{text}'
            f"[redis_cluster]\nnodes = [{nodes}]\nlocal_copies = false\n"
        )
        server = ServerProc(tenancy.path, directory / "server.log")
        env.servers.append(server)
        servers.append(server)
    assert tenancy is not None
    return servers, tenancy


def _client(address: str, token: str, transport: str) -> BlockClient:
    """gRPC only, or the bulk channel over TCP (as from another host)."""
    if transport == "grpc":
        return BlockClient(address, token, bulk=False)
    return BlockClient(address, token, same_host=False)


def _shut_down(node: RedisNode) -> bool:
    """`redis-cli -p PORT shutdown nosave`, as an operator stops a node."""
    node.cli("shutdown", "nosave")
    assert node.process is not None
    node.process.wait(timeout=10)
    return "PONG" not in node.cli("ping")


def redis_node_shutdown(env: Env) -> Outcome:
    """A Redis node shut down (`redis-cli shutdown nosave`) under two servers that hold
    pooled connections to it: the second server, which never held the blocks, is read
    through gRPC and the bulk channel by several clients, before and while the node goes
    and for a few seconds after; each reads blocks it read before (on every node) and
    digests never stored. Passes when no call fails and no server logs an internal
    error, no block comes back with other bytes, the dead node's blocks are misses and
    the others' still hit, digests never stored stay misses, and puts through both
    servers are acknowledged after the shutdown."""
    reason = unavailable_reason()
    if reason is not None:
        return Outcome(None, f"needs Redis: {reason}")
    cluster = LocalRedisCluster(env.directory / "redis").start()
    try:
        return _run(env, cluster)
    finally:
        cluster.stop()


def _run(env: Env, cluster: LocalRedisCluster) -> Outcome:
    (writer, reader), tenancy = _servers(env, cluster)
    token = tenancy.tokens["a"]
    digests = [os.urandom(32) for _ in range(STORED)]
    payloads = {d: os.urandom(16 * KiB) for d in digests}
    absent = [os.urandom(32) for _ in range(ABSENT)]
    with BlockClient(writer.address, token, bulk=False) as client:
        if client.put("alpha", MODEL, digests, [payloads[d] for d in digests]) != [True] * STORED:
            return Outcome(False, "the puts before the fault were not all acknowledged")
        # Written behind: wait until the reader finds every block in the cluster.
        with BlockClient(reader.address, token, bulk=False) as check:
            deadline = time.monotonic() + 30
            while check.lookup("alpha", MODEL, digests) != STORED:
                if time.monotonic() > deadline:
                    return Outcome(False, "the blocks did not reach the cluster")
                time.sleep(0.1)
    # Every block read once through the reader, over each transport: it holds pooled
    # connections to every node before the fault.
    for transport in TRANSPORTS:
        with _client(reader.address, token, transport) as client:
            if client.get("alpha", MODEL, digests) != [payloads[d] for d in digests]:
                return Outcome(False, "the reader did not find every block before the fault")
    tally: Counter[str] = Counter()
    failures: Counter[str] = Counter()
    lock = threading.Lock()
    gone, stop = threading.Event(), threading.Event()

    def read(transport: str) -> None:
        with _client(reader.address, token, transport) as client:
            while not stop.is_set():
                for digest in (*digests, *absent):
                    phase = "after" if gone.is_set() else "before"  # (or during)
                    try:
                        got = client.get("alpha", MODEL, [digest])
                    except BlockStoreError as error:
                        with lock:
                            failures[error.code().name] += 1
                        continue
                    if digest in payloads and got == [payloads[digest]]:
                        outcome = "hit"
                    elif got == []:
                        outcome = "miss" if digest in payloads else "absent"
                    else:
                        outcome = "wrong"
                    with lock:
                        tally[f"{phase} {outcome}"] += 1
                with lock:
                    tally["fallbacks"] = tally["fallbacks"] + client.transport_stats.bulk_fallbacks
                    client.transport_stats.bulk_fallbacks = 0

    threads = [
        threading.Thread(target=read, args=(transport,), daemon=True)
        for transport in TRANSPORTS
        for _ in range(READERS_PER_TRANSPORT)
    ]
    for thread in threads:
        thread.start()
    time.sleep(LOAD_BEFORE_S)  # pooled connections to every node, in use
    victim = cluster.nodes[1]
    refused = _shut_down(victim)
    gone.set()
    time.sleep(LOAD_AFTER_S)
    stop.set()
    for thread in threads:
        thread.join(timeout=60)
    puts_ok = True
    for server in (writer, reader):
        for transport in TRANSPORTS:
            with _client(server.address, token, transport) as client:
                more = [os.urandom(32) for _ in range(4)]
                try:
                    acknowledged = client.put("alpha", MODEL, more, [os.urandom(4 * KiB)] * 4)
                except BlockStoreError as error:
                    failures[error.code().name] += 1
                    acknowledged = []
                puts_ok = puts_ok and acknowledged == [True] * 4
    logged = sum(count_internal_errors(server.log_path) for server in (writer, reader))
    calls = sum(v for k, v in tally.items() if k != "fallbacks") + sum(failures.values())
    passed = (
        refused
        and not failures
        and logged == 0
        and tally["before wrong"] + tally["after wrong"] == 0
        and tally["after miss"] > 0
        and tally["after hit"] > 0
        and puts_ok
        and tally["fallbacks"] == 0
    )
    detail = (
        f"{calls} single-block GETs through the second server (gRPC and bulk over TCP, "
        f"{len(threads)} clients): {sum(failures.values())} failed {dict(failures)}; "
        f"before or during the shutdown {tally['before hit']} hits, "
        f"{tally['before miss']} misses; "
        f"after it {tally['after hit']} hits, {tally['after miss']} misses (the dead node's "
        f"blocks); never-stored digests {tally['before absent'] + tally['after absent']} "
        f"misses; {tally['before wrong'] + tally['after wrong']} wrong; "
        f"{tally['fallbacks']} bulk fallbacks; {logged} internal errors logged; "
        f"puts after it acknowledged: {puts_ok}; its port refused: {refused}"
    )
    return Outcome(passed, detail)
