"""Write-behind: snapshotted blocks wait here until one saver thread seals and stores them.

Bounds: at most `max_jobs` jobs between `reserve` and the end of their store call, and
their bytes live in the snapshot pool, which is bounded in bytes
(replica_agent/device_snapshot.py). Nothing here blocks the caller of `save`.

The saver thread makes no device calls. A job whose device-to-host copies are still
queued is "in flight"; the threads that call the agent (`collect`, from `save`, `load`,
`match` and `flush`) check it with an event query and hand it on once done. CUDA forbids
such calls from other threads while an engine thread captures a CUDA graph in the default
(global) mode, so doing them on the saver thread could break the engine's capture.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from replica_agent.telemetry import Context

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SaveJob:
    tenant: str
    digests: tuple[bytes, ...]
    encoded: list[memoryview]  # codec-encoded blocks, valid until `release`
    parent: Context | None  # the trace context of the `save` call
    is_copied: Callable[[], bool]  # device copies done (agent threads only)
    wait_copied: Callable[[], None]  # block until they are (agent threads only)
    release: Callable[[], None]  # give the buffers back (any thread)


class WriteBehind:
    def __init__(
        self, store: Callable[[SaveJob], None], on_error: Callable[[], None], max_jobs: int
    ) -> None:
        if max_jobs < 1:
            raise ValueError(f"save_queue_jobs is {max_jobs}; allow at least one save job")
        self._store, self._on_error, self.max_jobs = store, on_error, max_jobs
        self._lock = threading.Lock()
        self._in_flight: deque[SaveJob] = deque()  # device copies may still be queued
        self._jobs = 0  # reserved and not yet finished
        self._ready: queue.Queue[SaveJob | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kvshare-saver", daemon=True)
        self._thread.start()

    def reserve(self) -> bool:
        """Room for one more job (then `submit` or `cancel` it); False when full."""
        with self._lock:
            if self._jobs >= self.max_jobs:
                return False
            self._jobs += 1
            return True

    def cancel(self) -> None:
        with self._lock:
            self._jobs -= 1

    def submit(self, job: SaveJob) -> None:
        with self._lock:
            self._in_flight.append(job)
        self.collect()

    def collect(self) -> None:
        """Hand jobs whose copies are done to the saver thread (agent threads only)."""
        with self._lock:
            while self._in_flight and self._in_flight[0].is_copied():
                self._ready.put(self._in_flight.popleft())

    def flush(self) -> None:
        """Wait for every submitted job's copies, then for its store call."""
        with self._lock:
            waiting, self._in_flight = list(self._in_flight), deque()
        for job in waiting:
            job.wait_copied()
            self._ready.put(job)
        self._ready.join()

    @property
    def jobs(self) -> int:
        return self._jobs

    def close(self) -> None:
        self.flush()
        self._ready.put(None)
        self._thread.join()

    def _run(self) -> None:
        while True:
            job = self._ready.get()
            try:
                if job is None:
                    return
                self._store(job)
            except Exception:  # a bug must not kill the saver: later saves still run
                self._on_error()
                log.exception("save failed unexpectedly; dropped")
            finally:
                if job is not None:
                    job.release()
                    self.cancel()
                self._ready.task_done()
