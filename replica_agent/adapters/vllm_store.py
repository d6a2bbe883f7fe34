"""The worker side of the vLLM connector: store blocks in and out of vLLM's paged cache.

Invariants:
- Inference never fails and never waits long because of the store. Every call goes
  through `StoreGate`: a deadline (the client's `timeout_s`), a circuit breaker, and
  every error turned into a miss. A load that cannot complete names the vLLM blocks it
  could not fill (`LoadResult.failed_block_ids`), so vLLM recomputes exactly those.
- Nothing unverified reaches the cache: with a keyring each payload is opened (AEAD,
  bound to tenant, model namespace and digest) and then decoded against the expected
  layout before a single element is written; the first block that fails ends the load.
- Saves are write-behind: the new blocks are copied out of the paged cache when vLLM
  says the step is done (`wait_for_save`), and sealed and sent by one saver thread from
  a queue bounded in bytes; past the bound a save is dropped (a future miss), never
  waited for. `close` flushes the queue within a deadline, so an engine that serves
  one request and exits still leaves its blocks.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from policy.sealing import BlockSealer
from replica_agent.adapters.store_gate import StoreGate, verified
from replica_agent.adapters.vllm_layout import (
    PagedLayout,
    kernel_block_ids,
    to_kernel_blocks,
    to_store_blocks,
)
from replica_agent.adapters.vllm_plan import LoadPlan, SavePlan
from replica_agent.client import BlockClient
from replica_agent.codec import decode_block, encode_block
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import DropReason

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PagedCache:
    """One worker's KV cache: per-layer tensors in model order, and their layout."""

    layers: tuple[torch.Tensor, ...]
    layout: PagedLayout
    vllm_block_tokens: int  # tokens per scheduler block (a multiple of the kernel block)

    @property
    def kernel_ratio(self) -> int:
        return self.vllm_block_tokens // self.layout.block_tokens

    @property
    def device(self) -> torch.device:
        return self.layers[0].device


@dataclass
class _Progress:
    blocks: int = 0  # store blocks written into the cache so far


@dataclass(frozen=True)
class _SaveJob:
    tenant: str
    digests: tuple[bytes, ...]
    blocks: torch.Tensor  # [n, *spec.block_shape] on the host
    nbytes: int
    ready: torch.cuda.Event | None  # the device-to-host copy is done when this fires


class WorkerStore:
    def __init__(
        self,
        client: BlockClient,
        spec: ModelSpec,
        *,
        sealer: BlockSealer | None,
        gate: StoreGate,
        save_queue_bytes: int,
    ) -> None:
        self.client = client
        self.spec = spec
        self.model = spec.wire_model()
        self.sealer = sealer
        self.gate = gate
        self.stats = gate.stats
        self.save_queue_bytes = save_queue_bytes
        self._queued_bytes = 0
        self._pending = threading.Condition()
        self._jobs: queue.SimpleQueue[_SaveJob | None] = queue.SimpleQueue()
        self._saver = threading.Thread(target=self._save_loop, name="kvshare-saver", daemon=True)
        self._saver.start()

    # -- load --------------------------------------------------------------------------

    def load(self, cache: PagedCache, plan: LoadPlan) -> list[int]:
        """Fill the plan's vLLM blocks from the store; the vLLM block ids not filled."""
        per_block = self.spec.block_tokens // cache.vllm_block_tokens
        skip_vllm_blocks = plan.skip_tokens // cache.vllm_block_tokens
        progress = _Progress()
        if plan.digests and self.gate.allow():
            with self.gate.telemetry.span("kvshare.agent.load", plan.tenant):
                try:
                    self._fetch_into(cache, plan, per_block, skip_vllm_blocks, progress)
                    self.gate.breaker.record_success()
                except Exception as error:  # a broken stream ends the load, never the step
                    self.gate.failed("get", error)
        done = progress.blocks
        self.stats.blocks_loaded += done
        self.stats.blocks_failed += len(plan.digests) - done
        first_failed = max(0, done * per_block - skip_vllm_blocks)
        return list(plan.block_ids[first_failed:])

    def _fetch_into(
        self,
        cache: PagedCache,
        plan: LoadPlan,
        per_block: int,
        skip_vllm_blocks: int,
        progress: _Progress,
    ) -> None:
        payloads = self.client.iter_views(plan.tenant, self.model, plan.digests)
        try:
            for index, (digest, payload) in enumerate(zip(plan.digests, payloads, strict=False)):
                block = self._verified(plan.tenant, digest, payload)
                if block is None:
                    break
                skip = skip_vllm_blocks if index == 0 else 0
                start = max(0, index * per_block - skip_vllm_blocks)
                ids = plan.block_ids[start : start + per_block - skip]
                self._write(cache, block, ids, skip)
                progress.blocks = index + 1
        finally:
            close = getattr(payloads, "close", None)
            if close is not None:  # a stream left early is cancelled at once
                close()

    def _verified(
        self, tenant: str, digest: bytes, payload: bytes | memoryview
    ) -> torch.Tensor | None:
        where = (tenant, self.model, digest)
        return verified(self.gate, self.sealer, self.spec, where, payload, decode_block)

    @staticmethod
    def _write(cache: PagedCache, block: torch.Tensor, vllm_ids: Sequence[int], skip: int) -> None:
        """Tokens after the first `skip` vLLM blocks of `block` [L, 2, H, T, D] -> cache."""
        if not vllm_ids:
            return
        first_token = skip * cache.vllm_block_tokens
        kernel_ids = kernel_block_ids(list(vllm_ids), cache.kernel_ratio, cache.device)
        for layer, kv in enumerate(cache.layers):
            data = to_kernel_blocks(block[layer, :, :, first_token:], cache.layout.block_tokens)
            cache.layout.write(kv, kernel_ids, data.to(kv.device, kv.dtype))

    # -- save (write-behind) -------------------------------------------------------------

    def save(self, cache: PagedCache, plan: SavePlan) -> None:
        """Copy the plan's blocks out of the cache now; seal and send them later."""
        count = len(plan.digests)
        nbytes = count * self.spec.block_payload_bytes
        with self._pending:
            if self._queued_bytes + nbytes > self.save_queue_bytes:
                self._dropped(count, "queue_full")
                return
            self._queued_bytes += nbytes
        per_block = self.spec.block_tokens // cache.layout.block_tokens
        kernel_ids = kernel_block_ids(list(plan.block_ids), cache.kernel_ratio, cache.device)
        layers = [
            to_store_blocks(cache.layout.read(kv, kernel_ids), per_block) for kv in cache.layers
        ]
        gathered = torch.stack(layers, dim=1)  # [n, L, 2, H, T, D], a copy on the device
        ready = None
        if gathered.device.type == "cuda":
            host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
            host.copy_(gathered, non_blocking=True)
            ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
            ready.record()
            gathered = host
        self._jobs.put(_SaveJob(plan.tenant, plan.digests, gathered, nbytes, ready))
        self.stats.blocks_queued += count

    def _dropped(self, blocks: int, reason: DropReason) -> None:
        self.stats.blocks_dropped += blocks
        self.gate.telemetry.save_dropped(reason)

    def _save_loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            try:
                self._send(job)
            except Exception:  # a bug must not kill the saver: later saves still run
                self._dropped(len(job.digests), "error")
                log.exception("save failed unexpectedly; dropped")
            finally:
                with self._pending:
                    self._queued_bytes -= job.nbytes
                    self._pending.notify_all()

    def _send(self, job: _SaveJob) -> None:
        if job.ready is not None:
            job.ready.synchronize()
        if not self.gate.allow():
            self._dropped(len(job.digests), "breaker_open")
            return
        with self.gate.telemetry.span("kvshare.agent.save", job.tenant) as span:
            payloads = []
            for digest, block in zip(job.digests, job.blocks, strict=True):
                payload = encode_block(self.spec, block)
                if self.sealer is not None:
                    payload = self.sealer.seal(job.tenant, self.model, digest, payload)
                payloads.append(payload)
            try:
                self.client.put(job.tenant, self.model, job.digests, payloads)
            except Exception as error:
                self.gate.failed("put", error)
                self._dropped(len(job.digests), "error")
                return
            self.gate.breaker.record_success()
            self.stats.blocks_saved += len(payloads)
            self.gate.telemetry.saved(span, job.tenant, len(payloads))

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued save was attempted; False when time ran out."""
        deadline = time.monotonic() + timeout_s
        with self._pending:
            while self._queued_bytes > 0:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._pending.wait(left)
        return True

    def close(self, flush_timeout_s: float) -> None:
        if not self.flush(flush_timeout_s):
            unflushed = self._queued_bytes // max(1, self.spec.block_payload_bytes)
            self.stats.blocks_unflushed += unflushed
            log.warning(
                "%d blocks were still queued for the store after %.1f s; dropped",
                unflushed,
                flush_timeout_s,
            )
        self._jobs.put(None)
        self._saver.join(timeout=1.0)
        self.client.close()
