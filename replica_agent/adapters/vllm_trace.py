"""When each stage of a request's load from the store happened (the vLLM connector).

Each side of the connector (the scheduler's and each worker's) marks the stages it
sees, by vLLM's request id, on `time.monotonic()` (one clock for every process of a
host, so the sides' marks line up). Scheduler: `looked_up` (its first answer offered
tokens), `sync` or `async` (the mode it was given), `allocated` (vLLM allocated its
blocks), `scheduled` (the step that prefills it). Worker: `queued` (handed to the
loader thread), `load_started`, `load_finished`, `reported` (`get_finished` told
vLLM). `kvshare.demo.vllm_engine` adds `submitted` and `first_token` and prints the
whole line per request (benchmarks/vllm_ttft.py); docs/vllm.md reads them.

Only request ids and times are kept: no tokens, digests or tenants. The record is
bounded: past `max_requests` the oldest request's marks go, so a connector whose marks
nobody takes holds a fixed amount of memory.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

DEFAULT_MAX_REQUESTS = 1024


class LoadTimeline:
    def __init__(self, max_requests: int = DEFAULT_MAX_REQUESTS) -> None:
        self._max_requests = max_requests
        self._marks: OrderedDict[str, dict[str, float]] = OrderedDict()
        self._lock = threading.Lock()  # the loader thread marks too

    def mark(self, request_id: str, stage: str) -> None:
        """The first time `stage` happened to `request_id` (later marks are ignored)."""
        now = time.monotonic()
        with self._lock:
            marks = self._marks.get(request_id)
            if marks is None:
                if len(self._marks) >= self._max_requests:
                    self._marks.popitem(last=False)
                marks = self._marks[request_id] = {}
            marks.setdefault(stage, now)

    def mark_known(self, request_id: str, stage: str) -> None:
        """`mark`, for a request already marked (a later stage of a load)."""
        with self._lock:
            known = request_id in self._marks
        if known:
            self.mark(request_id, stage)

    def take(self) -> dict[str, dict[str, float]]:
        """Every request's marks so far; the record starts empty again."""
        with self._lock:
            marks, self._marks = self._marks, OrderedDict()
        return dict(marks)
