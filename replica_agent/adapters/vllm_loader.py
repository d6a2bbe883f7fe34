"""Asynchronous loads for the vLLM connector: store blocks placed off the forward path.

vLLM keeps a request that loads asynchronously out of the batch (WAITING_FOR_REMOTE_KVS)
until a worker reports it in `get_finished`; every other request keeps decoding. One
thread per worker runs the loads in the order they were planned, each through the same
`WorkerStore.load` as a synchronous load (the gate's deadline, breaker and outcome
table; open, decode, then write), so the two modes differ only in who waits.

Invariants:
- A load's failed blocks are recorded before its request is marked done, under one
  lock. vLLM asks `get_finished` and then `get_block_ids_with_load_errors` in the same
  step, so a failure is reported no later than its request's completion: the scheduler
  truncates the request's computed tokens before it admits the request again.
- Every submitted load is reported done exactly once, failed or not, even when the
  load raises: vLLM frees a request's blocks only after that report. (After `close`
  nothing is reported: the engine is shutting down.)
- Host memory stays bounded: the queue holds plans (ids and digests, no data) and the
  thread holds at most the one store block it is writing.
- On CUDA the thread writes on its own stream and waits for it before reporting, so
  the blocks are in place when the request is next scheduled on the default stream.
- A cancelled load (its request was aborted while the load was queued) is skipped and
  reported done at once: vLLM frees the request's blocks after that report, and no
  thread writes into them afterwards. A load already running completes first.
- `wait_settled` lets a step with no forward pass give the thread the interpreter's
  lock: the engine's loop otherwise spins through empty steps holding it, and the
  thread waits for it at every socket read (docs/vllm.md, the timeline).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import torch

from replica_agent.adapters.vllm_metadata import LoadPlan
from replica_agent.adapters.vllm_trace import LoadTimeline

log = logging.getLogger(__name__)
_STOP = None


class AsyncLoader:
    def __init__(
        self,
        load: Callable[[LoadPlan], list[int]],
        device: torch.device,
        timeline: LoadTimeline | None = None,
    ) -> None:
        self._load = load
        self._device = device
        self._timeline = timeline if timeline is not None else LoadTimeline()
        self._plans: queue.SimpleQueue[LoadPlan | None] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # a load ended
        self._pending: set[str] = set()  # submitted, not yet done
        self._cancelled: set[str] = set()  # of _pending: skip the load
        self._done: set[str] = set()
        self._failed_block_ids: set[int] = set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvshare-vllm-load", daemon=True)
        self._thread.start()

    def submit(self, plan: LoadPlan) -> None:
        with self._lock:
            self._pending.add(plan.request_id)
        self._timeline.mark(plan.request_id, "queued")
        self._plans.put(plan)

    def cancel(self, request_ids: list[str]) -> None:
        """Skip the loads of these requests that have not started (finished requests)."""
        with self._lock:
            self._cancelled.update(self._pending.intersection(request_ids))

    @property
    def is_busy(self) -> bool:
        with self._lock:
            return bool(self._pending)

    def wait_settled(self, timeout_s: float) -> None:
        """Wait until a load ends or `timeout_s` passes (returns at once when idle)."""
        with self._settled:
            if self._pending and not self._done:
                self._settled.wait(timeout_s)

    def take_finished(self) -> set[str]:
        """Requests whose loads ended since the last call (loaded or not)."""
        with self._lock:
            done, self._done = self._done, set()
        return done

    def take_failed_block_ids(self) -> set[int]:
        with self._lock:
            failed, self._failed_block_ids = self._failed_block_ids, set()
        return failed

    def close(self, timeout_s: float) -> None:
        """Stop: loads still queued are dropped (the engine is going away, nobody waits
        for them); the one in flight ends within the client's deadline, waited for up to
        `timeout_s` (the thread is a daemon: the process may exit under it)."""
        self._stopping.set()
        self._plans.put(_STOP)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        is_cuda = self._device.type == "cuda"
        stream = torch.cuda.Stream(self._device) if is_cuda else None  # type: ignore[no-untyped-call]
        while (plan := self._plans.get()) is not _STOP:
            if self._stopping.is_set():
                continue
            with self._lock:
                cancelled = plan.request_id in self._cancelled
            failed: list[int] = []
            if not cancelled:
                self._timeline.mark(plan.request_id, "load_started")
                try:
                    failed = self._placed(plan, stream)
                except Exception:  # a bug below the gate: recompute the request's blocks
                    log.exception("an asynchronous load failed; its blocks are recomputed")
                    failed = list(plan.block_ids)
                self._timeline.mark(plan.request_id, "load_finished")
            with self._settled:
                self._failed_block_ids.update(failed)
                self._done.add(plan.request_id)
                self._pending.discard(plan.request_id)
                self._cancelled.discard(plan.request_id)
                self._settled.notify_all()

    def _placed(self, plan: LoadPlan, stream: torch.cuda.Stream | None) -> list[int]:
        if stream is None:
            return self._load(plan)
        with torch.cuda.stream(stream):
            failed = self._load(plan)
        stream.synchronize()
        return failed
