"""Who waits for a load from the store: the loading request alone, or the whole batch.

vLLM lets a connector answer each request's lookup with `load_async`:

- synchronous: the load runs in `start_load_kv`, before the forward pass of the step
  that schedules the request. The request is scheduled in the step its lookup was
  answered, and every request in that batch waits for the load.
- asynchronous: the request waits outside the batch (WAITING_FOR_REMOTE_KVS) while the
  worker's loader thread places its blocks; vLLM schedules it in the step after the
  worker reports the load. Running requests keep decoding, but the loader shares the
  CPU and the interpreter's lock with the engine's own loop.

`"load_mode": "auto"` (the default) decides per request, at its lookup: synchronous
when no other request is in the engine's batch (nobody else waits for the load, and
the request starts in the same step), asynchronous when others are (their inter-token
latency does not grow by the load). Measured on vLLM's CPU backend (docs/vllm.md): on
the demo's workload, where a round-robin replica mostly serves one request at a time,
async-always raised TTFT p50 2.1x over recomputing, because the engine's loop spun
through empty steps holding the interpreter's lock while the loader thread waited for
it at every socket read; "sync" and "auto" lower it. Beside a decoding request,
"auto" loads asynchronously, as "async" does.

The batch is the scheduler side's view: the requests the last step scheduled, less
those vLLM has since reported finished. A request is never counted as its own other.
"""

from __future__ import annotations

from collections.abc import Iterable

AUTO, ASYNC, SYNC = "auto", "async", "sync"
LOAD_MODES = (AUTO, ASYNC, SYNC)


class LoadModes:
    def __init__(self, mode: str) -> None:
        if mode not in LOAD_MODES:
            raise ValueError(f"load mode must be one of {list(LOAD_MODES)}, not {mode!r}")
        self.mode = mode
        self._in_batch: set[str] = set()

    @property
    def uses_loader(self) -> bool:
        """Whether any load may be asynchronous (the worker then runs a loader thread)."""
        return self.mode != SYNC

    def observe_batch(self, request_ids: Iterable[str]) -> None:
        """The requests this step scheduled (vLLM calls the planner once per step)."""
        self._in_batch = set(request_ids)

    def finished(self, request_id: str) -> None:
        self._in_batch.discard(request_id)

    def is_async(self, request_id: str) -> bool:
        """Whether `request_id`'s load, if it has one, should run asynchronously now."""
        if self.mode != AUTO:
            return self.mode == ASYNC
        return bool(self._in_batch - {request_id})
