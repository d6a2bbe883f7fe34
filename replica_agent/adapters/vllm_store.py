"""The worker side of the vLLM connector: store blocks in and out of vLLM's paged cache.

Invariants:
- Inference never fails and never waits long because of the store. Every call goes
  through the replica side's one gate (replica_agent/gate.py): a deadline (the
  client's `timeout_s`), a circuit breaker, and the outcome table every engine shares.
  A load that cannot complete names the vLLM blocks it could not fill, so vLLM
  recomputes exactly those.
- Nothing unverified reaches the cache: with a keyring each payload is opened (AEAD,
  bound to tenant, model namespace and digest) and then decoded against the expected
  layout before a single element is written; the first block that fails ends the load.
  A plan's public blocks are read from `@public` and opened as `@public`'s (its key),
  never as the tenant's; saves go to the plan's tenant only.
- Saves are write-behind: the new blocks are copied out of the paged cache when vLLM
  says the step is done (`wait_for_save`), and sealed and sent by the shared saver
  (replica_agent/saver.py) from a queue bounded in bytes; past the bound a save is
  dropped (a future miss), never waited for. `close` flushes the queue within a
  deadline, so an engine that serves one request and exits still leaves its blocks.
  On CUDA the saver thread waits for a job's device-to-host copy before encoding it:
  vLLM captures its CUDA graphs before it serves, so no capture is running then.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from contextlib import closing
from dataclasses import dataclass

import torch

from policy.sealing import BlockSealer
from replica_agent.adapters.vllm_layout import (
    PagedLayout,
    kernel_block_ids,
    to_kernel_blocks,
    to_store_blocks,
)
from replica_agent.adapters.vllm_metadata import LoadPlan, SavePlan
from replica_agent.client import BlockClient, Payload, View
from replica_agent.codec import decode_block, encode_block
from replica_agent.gate import StoreGate
from replica_agent.public import PUBLIC_SCOPE
from replica_agent.saver import SaveJob, Saver
from replica_agent.spec import ModelSpec

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
        self._saver = Saver(client, gate, sealer, max_bytes=save_queue_bytes)

    # -- load --------------------------------------------------------------------------

    def load(self, cache: PagedCache, plan: LoadPlan) -> list[int]:
        """Fill the plan's vLLM blocks from the store; the vLLM block ids not filled.

        The plan's first `public_blocks` come from @public (opened under the public
        scope's key), the rest from its tenant, each range in one read; a range that
        stops short ends the load there."""
        public = min(plan.public_blocks, len(plan.digests))
        done = 0
        for tenant, first, last in (
            (PUBLIC_SCOPE, 0, public),
            (plan.tenant, public, len(plan.digests)),
        ):
            if first == last:
                continue
            if done < first:
                break
            done = first + self._load_range(cache, plan, tenant, first, last)
        self.gate.count(blocks_loaded=done, blocks_failed=len(plan.digests) - done)
        per_block = self.spec.block_tokens // cache.vllm_block_tokens
        first_failed = max(0, done * per_block - plan.skip_tokens // cache.vllm_block_tokens)
        return list(plan.block_ids[first_failed:])

    def _load_range(
        self, cache: PagedCache, plan: LoadPlan, tenant: str, first: int, last: int
    ) -> int:
        """Blocks `first..last` of the plan from `tenant`'s namespace; how many arrived."""
        if not self.gate.allow():
            return 0
        per_block = self.spec.block_tokens // cache.vllm_block_tokens
        skip_vllm_blocks = plan.skip_tokens // cache.vllm_block_tokens
        done = 0
        read = self.gate.read(
            self.client, tenant, self.model, plan.digests[first:last], self._verified(tenant)
        )
        with (
            self.gate.telemetry.span("kvshare.agent.load", tenant),
            self.gate.settled("get"),  # a broken stream ends the load, never the step
            closing(read) as blocks,
        ):
            for offset, block in enumerate(blocks):
                index = first + offset
                skip = skip_vllm_blocks if index == 0 else 0
                start = max(0, index * per_block - skip_vllm_blocks)
                ids = plan.block_ids[start : start + per_block - skip]
                self._write(cache, block, ids, skip)
                done = offset + 1
        return done

    def _verified(self, tenant: str) -> Callable[[bytes, View], torch.Tensor | None]:
        def check(digest: bytes, payload: View) -> torch.Tensor | None:
            where = (tenant, self.model, digest)
            return self.gate.verified(self.sealer, self.spec, where, payload, decode_block)

        return check

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
        if not self._saver.reserve(count, nbytes):
            return
        try:
            host, ready = self._copy_out(cache, plan)
        except BaseException:
            self._saver.cancel(count, nbytes, "error")
            raise
        spec = self.spec

        def encoded(index: int) -> Payload:  # on the saver thread
            if ready is not None:
                ready.synchronize()
            return encode_block(spec, host[index])

        self._saver.submit(SaveJob(plan.tenant, self.model, plan.digests, encoded, nbytes))

    def _copy_out(
        self, cache: PagedCache, plan: SavePlan
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """The plan's blocks as [n, *spec.block_shape] on the host, and the event that
        fires when the device-to-host copy is done (None: done already)."""
        per_block = self.spec.block_tokens // cache.layout.block_tokens
        kernel_ids = kernel_block_ids(list(plan.block_ids), cache.kernel_ratio, cache.device)
        layers = [
            to_store_blocks(cache.layout.read(kv, kernel_ids), per_block) for kv in cache.layers
        ]
        gathered = torch.stack(layers, dim=1)  # [n, L, 2, H, T, D], a copy on the device
        if gathered.device.type != "cuda":
            return gathered, None
        host = torch.empty(gathered.shape, dtype=gathered.dtype, pin_memory=True)
        host.copy_(gathered, non_blocking=True)
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
        return host, ready

    def flush(self, timeout_s: float) -> bool:
        """Wait until every queued save was attempted; False when time ran out."""
        return self._saver.flush(timeout_s)

    def close(self, flush_timeout_s: float) -> None:
        self._saver.close(flush_timeout_s)
        self.client.close()
