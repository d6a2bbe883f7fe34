"""The replica side's one saver: seal and store save jobs through the store gate.

Used by the transformers agent, the vLLM connector and the SGLang backend. A job is the
blocks of one save, already copied out of the engine's cache (so the engine may reuse
its memory at once); the saver seals each block (with a sealer) and stores the job in
Puts of at most `put_bytes` each, through `StoreGate`. Every outcome follows the
gate's table (replica_agent/gate.py): a save that cannot be stored is dropped and
counted (`blocks_dropped`, `saves_dropped`, telemetry reason), never raised.

Two ways in:
- `reserve` + `submit`: write-behind, on one saver thread. The queue is bounded in jobs
  (`max_jobs`) and in bytes (`max_bytes`; None where the caller bounds the bytes itself,
  as the agent's snapshot pool does); past a bound a save is dropped ("queue_full"),
  never waited for. With the breaker open a job is dropped ("breaker_open") without a
  call. `close` flushes the queue within a time limit; what is left is counted
  (`blocks_unflushed`) and dropped.
- `store`: the same on the caller's thread, for an engine that already calls from a
  background thread and needs each block's result (SGLang's `batch_set`).

The saver thread makes no device calls of its own. A job is handed to it once its
`is_ready()` is true, checked on the engine's threads (`submit`, `collect`, `flush`):
the agent's jobs wait there for their device copies, because an event query on another
thread could break a CUDA graph the engine captures meanwhile. What a job's `encoded`
does on the saver thread is its engine's choice (vllm_store's waits for its copy there:
vLLM captures its graphs before it serves).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from policy.sealing import sealed_bytes
from replica_agent.gate import StoreClient, StoreGate
from replica_agent.telemetry import Context, DropReason

if TYPE_CHECKING:
    from policy.sealing import BlockSealer
    from replica_agent.client import Payload

log = logging.getLogger(__name__)
# A Put holds its payloads in memory, and the server refuses more pending bytes than
# its max_pending_write_bytes (1 GiB by default): a large save goes in several Puts.
DEFAULT_PUT_BYTES = 64 << 20
JOIN_AFTER_CLOSE_S = 1.0  # a Put still running when `close` gives up is cut by the client
KEPT_SEAL_BUFFERS = 2  # the saver thread's and one caller's of `store`


def _ready() -> bool:
    return True


def _nothing() -> None:
    return None


@dataclass(frozen=True)
class SaveJob:
    tenant: str
    model: str  # the store namespace of the blocks
    digests: tuple[bytes, ...]
    encoded: Callable[[int], Payload]  # block i, codec-encoded (header and payload)
    nbytes: int  # what the job holds, for the byte bound
    parent: Context | None = None  # the trace context of the engine's save call
    is_ready: Callable[[], bool] = _ready  # may the saver read `encoded` (engine threads)
    wait_ready: Callable[[], None] = _nothing  # block until it may (engine threads)
    release: Callable[[], None] = _nothing  # give the job's buffers back (any thread)

    @property
    def blocks(self) -> int:
        return len(self.digests)


class Saver:
    def __init__(
        self,
        client: StoreClient,
        gate: StoreGate,
        sealer: BlockSealer | None,
        *,
        max_jobs: int | None = None,
        max_bytes: int | None = None,
        put_bytes: int = DEFAULT_PUT_BYTES,
    ) -> None:
        if max_jobs is not None and max_jobs < 1:
            raise ValueError(f"save_queue_jobs is {max_jobs}; allow at least one save job")
        self.client, self.gate, self.sealer = client, gate, sealer
        self.max_jobs, self.max_bytes, self.put_bytes = max_jobs, max_bytes, put_bytes
        self._pending = threading.Condition()
        self._jobs = 0  # reserved and not yet finished
        self._bytes = 0
        self._blocks = 0
        self._closing = False
        self._in_flight: deque[SaveJob] = deque()  # not ready for the saver thread yet
        self._ready: queue.SimpleQueue[SaveJob | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._seal_buffers = _SealBuffers(KEPT_SEAL_BUFFERS)

    # -- write-behind --------------------------------------------------------------------

    def reserve(self, blocks: int, nbytes: int) -> bool:
        """Room for one more job (then `submit` or `cancel` it); False (and the save
        counted as dropped) when the queue is full."""
        with self._pending:
            full = self.max_jobs is not None and self._jobs >= self.max_jobs
            over = self.max_bytes is not None and self._bytes + nbytes > self.max_bytes
            if not (full or over or self._closing):
                self._jobs += 1
                self._bytes += nbytes
                self._blocks += blocks
                return True
        self.dropped(blocks, "queue_full")
        return False

    def cancel(self, blocks: int, nbytes: int, reason: DropReason) -> None:
        """Give back a reservation whose job was not made (counted as dropped)."""
        self._finished(blocks, nbytes)
        self.dropped(blocks, reason)

    def submit(self, job: SaveJob) -> None:
        """Queue a reserved job; it is stored once `job.is_ready()`."""
        with self._pending:
            self._in_flight.append(job)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvshare-saver", daemon=True)
                self._thread.start()
        self.gate.count(saves_queued=1, blocks_queued=job.blocks)
        self.collect()

    def collect(self) -> None:
        """Hand jobs that are ready to the saver thread, in order (engine threads)."""
        with self._pending:
            while self._in_flight and self._in_flight[0].is_ready():
                self._ready.put(self._in_flight.popleft())

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued job was attempted; False when `timeout_s` ran out."""
        with self._pending:
            waiting, self._in_flight = list(self._in_flight), deque()
        for job in waiting:
            job.wait_ready()
            self._ready.put(job)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._pending:
            while self._jobs > 0:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._pending.wait(left)
        return True

    @property
    def jobs(self) -> int:
        return self._jobs

    def close(self, timeout_s: float | None = None) -> None:
        """Flush within `timeout_s`, then drop what is left (counted as unflushed)."""
        if not self.flush(timeout_s):
            with self._pending:
                unflushed = self._blocks
            self.gate.count(blocks_unflushed=unflushed)
            log.warning(
                "%d blocks were still queued for the store after %.1f s; dropped",
                unflushed,
                timeout_s,
            )
        with self._pending:
            self._closing = True
            thread = self._thread
        if thread is not None:
            self._ready.put(None)
            thread.join(timeout=JOIN_AFTER_CLOSE_S)

    def _run(self) -> None:
        while (job := self._ready.get()) is not None:
            try:
                if not self._closing:
                    self.store(job)
            except Exception:  # a bug must not kill the saver: later saves still run
                self.dropped(job.blocks, "error")
                log.exception("save failed unexpectedly; dropped")
            finally:
                job.release()
                self._finished(job.blocks, job.nbytes)

    def _finished(self, blocks: int, nbytes: int) -> None:
        with self._pending:
            self._jobs -= 1
            self._bytes -= nbytes
            self._blocks -= blocks
            self._pending.notify_all()

    # -- storing ---------------------------------------------------------------------------

    def store(self, job: SaveJob) -> int:
        """Seal and store `job` now, in Puts of at most `put_bytes`; how many leading
        blocks were stored (or already there). The first Put that fails, or the breaker
        open, drops the rest of the job, never waited for."""
        count = job.blocks
        per_put = max(1, self.put_bytes // max(1, job.nbytes // max(1, count)))
        saved = 0
        reason: DropReason | None = None
        with self.gate.telemetry.span("kvshare.agent.save", job.tenant, job.parent) as span:
            for start in range(0, count, per_put):
                if not self.gate.allow():
                    reason = "breaker_open"
                    break
                end = min(count, start + per_put)
                stored = None
                with self.gate.settled("put"):
                    stored = self._put(job, start, end)
                if stored is None:
                    reason = "error"
                    break
                saved = end
            self.gate.count(blocks_saved=saved)
            self.gate.telemetry.saved(span, job.tenant, saved)
        if reason is not None:
            self.dropped(count - saved, reason)
        return saved

    def _put(self, job: SaveJob, start: int, end: int) -> list[bool]:
        digests = job.digests[start:end]
        encoded = [job.encoded(index) for index in range(start, end)]
        if self.sealer is None:
            return self.client.put(job.tenant, job.model, digests, encoded)
        # Each block sealed straight into a buffer kept for the next Put (one copy; seal
        # would make a fresh ciphertext and copy it again behind the header).
        sizes = [sealed_bytes(memoryview(plaintext).nbytes) for plaintext in encoded]
        buffer = self._seal_buffers.take(sum(sizes))
        try:
            payloads: list[Payload] = []
            offset = 0
            for digest, plaintext, size in zip(digests, encoded, sizes, strict=True):
                out = buffer[offset : offset + size]
                payloads.append(
                    self.sealer.seal_into(job.tenant, job.model, digest, plaintext, out)
                )
                offset += size
            return self.client.put(job.tenant, job.model, digests, payloads)
        finally:
            self._seal_buffers.give_back(buffer)

    def dropped(self, blocks: int, reason: DropReason) -> None:
        """Count a save (of `blocks` blocks) that will not be stored."""
        self.gate.count(saves_dropped=1, blocks_dropped=blocks)
        self.gate.telemetry.save_dropped(reason)


class _SealBuffers:
    """Where Puts' blocks are sealed: one buffer per Put in progress (the saver thread's,
    and those of callers of `store`), at most `keep` kept for later Puts. A buffer only
    ever holds ciphertext, and a Put sends only the part it sealed."""

    def __init__(self, keep: int) -> None:
        self._keep = keep
        self._free: list[memoryview] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            fits = [buffer for buffer in self._free if buffer.nbytes >= nbytes]
            if fits:  # the smallest that fits (largest first)
                self._free.remove(fits[-1])
                return fits[-1]
        return memoryview(bytearray(nbytes))

    def give_back(self, buffer: memoryview) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda kept: kept.nbytes, reverse=True)
            del self._free[self._keep :]  # the largest are kept
