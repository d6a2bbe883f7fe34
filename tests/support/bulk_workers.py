"""A server with bulk worker processes ([bulk] workers): its worker assembly, whether a
worker served, and a pair of TCP bulk clients of which the second is the worker's."""

from __future__ import annotations

import os
import time

from cacheserver.transport.bulk.readworkers import WorkerAssembly
from replica_agent.client import BlockClient
from tests.support.servers import Running

MODEL = "workers/model"


def assembly(running: Running) -> WorkerAssembly:
    workers = running.server.server.workers if running.server.server else None
    assert workers is not None, "the server was started with [bulk] workers > 1"
    return workers


def served_by_workers(running: Running, before: int, timeout_s: float = 3.0) -> bool:
    """Whether a worker reported serving something since `before` reports."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if assembly(running).processes.reports > before:
            return True
        time.sleep(0.05)
    return False


def pair(running: Running, who: str) -> tuple[BlockClient, BlockClient]:
    """Two TCP bulk clients of `who`; the second connection opened is the worker's."""
    first = running.client(who, transport="bulk-tcp")
    second = running.client(who, transport="bulk-tcp")
    tenant = "beta" if who == "b" else "alpha"
    # A GET opens the connection that every later call of the thread uses (a lookup
    # first would open a lookup-only one).
    assert first.get(tenant, MODEL, [os.urandom(32)]) == []
    assert second.get(tenant, MODEL, [os.urandom(32)]) == []
    return first, second


def wait_in_lmdb(running: Running) -> None:
    """Journaled puts reach LMDB once the server pauses (sooner while workers hand
    reads back); wait until none is left."""
    deadline = time.monotonic() + 10
    while running.store.undrained_blocks and time.monotonic() < deadline:
        time.sleep(0.01)
