"""Client processes: each owns one connection and times the calls of one cell at a time.

Clients run in spawned processes so one interpreter's GIL never caps several clients.
The parent sends a plan, every client sets up untimed ("prepare"), then all start at
one shared instant ("run") and report their call latencies. Each client writes under
its own keys and reads back only what it wrote, checking a stamp in every value so a
system that returns the wrong block cannot score.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import multiprocessing
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from types import TracebackType
from typing import Any

from kvcommon.memtune import tune_allocator
from kvshare.bench.buffers import STAMP_BYTES, random_value, read_stamp, stamp
from kvshare.bench.netns import Host
from kvshare.bench.peers.base import BenchClient, BenchError, ClientSpec
from kvshare.bench.stats import LOOKUP_OP, CellOutcome

START_DELAY_S = 0.05  # lets every client reach the shared start instant
REPLY_SLACK_S = 120.0  # beyond the plan's own time: a stuck client fails the cell


@dataclass(frozen=True)
class CellPlan:
    op: str  # "put" | "get" | "lookup" (of blocks_per_call present blocks of value_bytes)
    value_bytes: int
    blocks_per_call: int
    max_calls: int
    max_seconds: float
    min_calls: int


class _ClientState:
    def __init__(self, client: BenchClient, worker_index: int) -> None:
        self.client = client
        self._prefix = f"{os.urandom(8).hex()}/{worker_index}/".encode()
        self._values: dict[int, mmap.mmap] = {}
        self.stored: dict[int, list[bytes]] = {}

    def value(self, value_bytes: int) -> memoryview:
        if value_bytes not in self._values:
            self._values[value_bytes] = random_value(value_bytes, seed=value_bytes)
        return memoryview(self._values[value_bytes])[:value_bytes]

    def new_key(self, value_bytes: int, index: int) -> bytes:
        return hashlib.sha256(self._prefix + f"{value_bytes}/{index}".encode()).digest()

    def put_one(self, value_bytes: int, latencies: list[int] | None = None) -> None:
        """PUT the next key of this size, its value stamped with the key's index."""
        keys = self.stored.setdefault(value_bytes, [])
        key = self.new_key(value_bytes, len(keys))
        value = self.value(value_bytes)
        stamp(value, len(keys))
        begin = time.perf_counter_ns()
        self.client.put([key], [value])
        if latencies is not None:
            latencies.append(time.perf_counter_ns() - begin)
        keys.append(key)

    def prepare(self, plan: CellPlan) -> None:
        self.client.prepare(plan.value_bytes, plan.blocks_per_call)
        self.value(plan.value_bytes)
        if plan.op in ("get", LOOKUP_OP):
            while len(self.stored.get(plan.value_bytes, [])) < plan.blocks_per_call:
                self.put_one(plan.value_bytes)
            keys = self.stored[plan.value_bytes][: plan.blocks_per_call]
            if plan.op == LOOKUP_OP:
                self.check_lookup(self.client.lookup(keys), len(keys))
                return
            found = self.client.get(keys)
            self.check(found, plan.value_bytes, 0, len(keys))
            expected = self.value(plan.value_bytes)[STAMP_BYTES:]
            if bytes(memoryview(found[0])[STAMP_BYTES:]) != bytes(expected):
                raise BenchError("GET returned different bytes than were PUT")

    def check(
        self, found: Sequence[memoryview | bytes], value_bytes: int, first: int, count: int
    ) -> None:
        if len(found) != count:
            raise BenchError(f"GET returned {len(found)} of {count} blocks (a miss or eviction)")
        for offset, value in enumerate(found):
            if len(value) != value_bytes or read_stamp(value) not in (None, first + offset):
                raise BenchError("GET returned a value of another key or size")

    @staticmethod
    def check_lookup(present: int, count: int) -> None:
        if present != count:
            raise BenchError(f"LOOKUP found {present} of {count} blocks just written")

    def run(self, plan: CellPlan, start_at_s: float) -> CellOutcome:
        time.sleep(max(0.0, start_at_s - time.perf_counter()))
        latencies: list[int] = []
        started = time.perf_counter()
        deadline = started + plan.max_seconds
        calls = 0
        while calls < plan.max_calls and (calls < plan.min_calls or time.perf_counter() < deadline):
            if plan.op == "put":
                self.put_one(plan.value_bytes, latencies)
            elif plan.op == LOOKUP_OP:
                self._timed_lookup(plan, calls, latencies)
            else:
                self._timed_get(plan, calls, latencies)
            calls += 1
        return CellOutcome(started, time.perf_counter(), calls, tuple(latencies))

    def _timed_get(self, plan: CellPlan, call: int, latencies: list[int]) -> None:
        stored = self.stored[plan.value_bytes]
        groups = len(stored) // plan.blocks_per_call
        first = (call % groups) * plan.blocks_per_call
        keys = stored[first : first + plan.blocks_per_call]
        begin = time.perf_counter_ns()
        found = self.client.get(keys)
        latencies.append(time.perf_counter_ns() - begin)
        self.check(found, plan.value_bytes, first, len(keys))

    def _timed_lookup(self, plan: CellPlan, call: int, latencies: list[int]) -> None:
        """One existence check of `blocks_per_call` present blocks (the same ones each
        call: a scheduler asks about the prefix a new request shares)."""
        keys = self.stored[plan.value_bytes][: plan.blocks_per_call]
        begin = time.perf_counter_ns()
        present = self.client.lookup(keys)
        latencies.append(time.perf_counter_ns() - begin)
        self.check_lookup(present, len(keys))


def worker_main(spec: ClientSpec, worker_index: int, conn: Connection, namespace: str = "") -> None:
    """Entry point of a client process: serve plans from the parent until told to stop.
    `namespace`: the client host's network namespace, where this process must be."""
    tune_allocator()  # the same allocator settings for every system's clients
    try:
        if namespace:
            Host(namespace, "").require_current()
        state = _ClientState(spec.connect(), worker_index)
    except Exception as error:
        conn.send(("error", f"connect failed: {type(error).__name__}: {error}"))
        return
    conn.send(("ok", None))
    try:
        while True:
            message = conn.recv()
            try:
                if message[0] == "stop":
                    break
                if message[0] == "prepare":
                    state.prepare(message[1])
                    conn.send(("ok", None))
                elif message[0] == "run":
                    conn.send(("ok", state.run(message[1], message[2])))
                elif message[0] == "forget":
                    state.stored.clear()
                    conn.send(("ok", None))
            except Exception as error:  # reported to the parent, which fails the cell
                conn.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        state.client.close()


class WorkerPool:
    """`count` client processes connected to one server."""

    def __init__(self, spec: ClientSpec, count: int, namespace: str = "") -> None:
        context = multiprocessing.get_context("spawn")
        self._conns: list[Connection] = []
        self._processes: list[Any] = []
        for index in range(count):
            parent_end, child_end = context.Pipe()
            process = context.Process(
                target=worker_main,
                args=(spec, index, child_end, namespace),
                daemon=True,
                name=f"kvshare-bench-client-{index}",
            )
            process.start()
            child_end.close()
            self._conns.append(parent_end)
            self._processes.append(process)
        self._gather(timeout_s=REPLY_SLACK_S)

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def prepare_cell(self, plan: CellPlan) -> None:
        """Every client's untimed set-up of `plan` (values written, buffers sized)."""
        self._broadcast(("prepare", plan))
        self._gather(timeout_s=REPLY_SLACK_S)

    def time_cell(self, plan: CellPlan) -> list[CellOutcome]:
        """The timed part of a prepared cell: all clients start at one instant; returns
        once every client reported (nothing else runs meanwhile: the timed part is
        what the server's CPU is read around)."""
        start_at_s = time.perf_counter() + START_DELAY_S
        self._broadcast(("run", plan, start_at_s))
        replies = self._gather(timeout_s=START_DELAY_S + plan.max_seconds + REPLY_SLACK_S)
        return [reply for reply in replies if isinstance(reply, CellOutcome)]

    def forget(self) -> None:
        """The server dropped its values: clients stop reading keys they wrote before."""
        self._broadcast(("forget",))
        self._gather(timeout_s=REPLY_SLACK_S)

    def _broadcast(self, message: tuple[Any, ...]) -> None:
        for conn in self._conns:
            conn.send(message)

    def _gather(self, timeout_s: float) -> list[Any]:
        deadline = time.monotonic() + timeout_s
        replies = []
        errors = []
        for conn in self._conns:
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                raise BenchError(f"a client process did not answer within {timeout_s:.0f} s")
            try:
                status, payload = conn.recv()
            except EOFError as error:
                raise BenchError("a client process exited unexpectedly") from error
            if status == "error":
                errors.append(str(payload))
            replies.append(payload)
        if errors:
            raise BenchError(errors[0])
        return replies

    def close(self) -> None:
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.send(("stop",))
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
                process.join(timeout=5)
        for conn in self._conns:
            conn.close()
