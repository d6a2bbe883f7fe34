"""`ReplicaAgent`: what runs on each inference replica.

    agent = ReplicaAgent.connect("127.0.0.1:50051", token, spec, sealer=sealer)
    m = agent.match(tenant, token_ids)          # PrefixMatch: blocks/tokens the store holds
    kv = agent.load(m, first_block=k)           # [n, *spec.block_shape] on the device
    agent.save(tenant, digests[i:j], blocks)    # write-behind; never blocks inference

Contract: inference never fails and never waits long because of the store. Every store
call has a timeout; failures are counted, feed a circuit breaker, and come back as
misses (`match` -> 0 blocks, `load` -> fewer blocks, `save` -> dropped). The gRPC channel
reconnects by itself, and the breaker lets a trial call through after its cooldown.
With a sealer, payloads are sealed before they leave the replica and opened before
they are decoded: a block that fails to open is a miss plus a counter and never
becomes a tensor. `AgentStats` counts for this agent; `AgentTelemetry` records the same
events as OpenTelemetry metrics and spans (replica_agent/telemetry.py).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from kvcommon.errors import KvshareError
from kvcommon.memtune import tune_allocator
from policy.sealing import BlockSealer, SealError
from replica_agent.breaker import CircuitBreaker
from replica_agent.client import BlockClient, ClientTls
from replica_agent.codec import encode_block
from replica_agent.device import BlockRestorer
from replica_agent.hashing import BlockHasher
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry, Context

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SAVE_QUEUE_JOBS = 64


@dataclass
class AgentStats:
    lookups: int = 0
    blocks_matched: int = 0
    blocks_restored: int = 0
    bytes_restored: int = 0
    open_failures: int = 0  # sealed blocks that failed to open (tampered, moved, retired key)
    format_errors: int = 0  # opened blocks whose layout did not match the model spec
    store_errors: int = 0  # failed or timed-out store calls
    skipped_breaker_open: int = 0  # store calls not made because the breaker was open
    saves_queued: int = 0
    saves_dropped: int = 0  # save jobs dropped: queue full or breaker open
    blocks_saved: int = 0


@dataclass(frozen=True)
class PrefixMatch:
    tenant: str
    digests: tuple[bytes, ...]  # every full block of the prompt
    # Leading blocks covered: the `first_block` the caller holds locally plus those the
    # store holds after them (none when the store is unreachable).
    blocks: int
    block_tokens: int

    @property
    def tokens(self) -> int:
        return self.blocks * self.block_tokens


@dataclass(frozen=True)
class _SaveJob:
    tenant: str
    digests: tuple[bytes, ...]
    blocks: tuple[torch.Tensor, ...]
    parent: Context | None = None  # the trace context of the `save` call


class ReplicaAgent:
    def __init__(
        self,
        client: BlockClient,
        spec: ModelSpec,
        *,
        sealer: BlockSealer | None = None,
        device: torch.device | str = "cpu",
        breaker: CircuitBreaker | None = None,
        save_queue_jobs: int = DEFAULT_SAVE_QUEUE_JOBS,
        telemetry: AgentTelemetry | None = None,
    ) -> None:
        tune_allocator()  # block-sized buffers come and go: keep them in the heap
        self.client = client
        self.spec = spec
        self.model = spec.wire_model()
        self.sealer = sealer
        self.breaker = breaker or CircuitBreaker()
        self.stats = AgentStats()
        self.telemetry = telemetry or AgentTelemetry()
        self.telemetry.watch_breaker(self.breaker)
        self._restorer = BlockRestorer(spec, device)
        self._hashers: dict[bytes, BlockHasher] = {}
        self._saves: queue.Queue[_SaveJob | None] = queue.Queue(maxsize=save_queue_jobs)
        self._saver = threading.Thread(target=self._save_loop, name="kvshare-saver", daemon=True)
        self._saver.start()

    @classmethod
    def connect(
        cls,
        address: str,
        token: str,
        spec: ModelSpec,
        *,
        tls: ClientTls | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: object,
    ) -> ReplicaAgent:
        client = BlockClient(address, token, tls=tls, timeout_s=timeout_s)
        return cls(client, spec, **kwargs)  # type: ignore[arg-type]

    # -- hashing ----------------------------------------------------------------------

    def digests(self, token_ids: Sequence[int], *, salt: bytes = b"") -> list[bytes]:
        """Digests of the full blocks of `token_ids`. `salt`: see BlockHasher (per user)."""
        hasher = self._hashers.get(salt)
        if hasher is None:
            hasher = self._hashers[salt] = BlockHasher(self.model, self.spec.block_tokens, salt)
        return hasher.digests(token_ids)

    # -- match and load -----------------------------------------------------------------

    def match(self, tenant: str, digests: Sequence[bytes], *, first_block: int = 0) -> PrefixMatch:
        """How many leading blocks the store holds; blocks before `first_block` are
        assumed present locally and not asked for."""
        found = 0
        with self.telemetry.span("kvshare.agent.match", tenant) as span:
            if first_block < len(digests) and self._allow():
                try:
                    found = self.client.lookup(tenant, self.model, digests[first_block:])
                    self.breaker.record_success()
                except KvshareError as error:
                    self._store_failed("lookup", error)
            asked = max(len(digests) - first_block, 0)
            self.telemetry.matched(span, tenant, asked, found, self.spec.block_tokens)
        self.stats.lookups += 1
        self.stats.blocks_matched += found
        return PrefixMatch(tenant, tuple(digests), first_block + found, self.spec.block_tokens)

    def load(self, match: PrefixMatch, *, first_block: int = 0) -> torch.Tensor:
        """Blocks `first_block .. match.blocks-1` as `[n, *block_shape]` on the device.

        n may be smaller than asked (evicted meanwhile, store failure, a block that fails
        to open or decode): the caller recomputes from block `first_block + n`.
        """
        wanted = match.digests[first_block : match.blocks]
        with self.telemetry.span("kvshare.agent.load", match.tenant) as span:
            started = time.perf_counter()
            if not wanted or not self._allow():
                blocks = self._restorer.restore(iter(()), 0)
            else:
                errors_before = self._restorer.format_errors
                blocks = self._restorer.restore(self._opened(match.tenant, wanted), len(wanted))
                self.stats.format_errors += self._restorer.format_errors - errors_before
            nbytes = blocks.numel() * blocks.element_size()
            self.telemetry.loaded(
                span,
                match.tenant,
                len(wanted),
                len(blocks),
                nbytes,
                time.perf_counter() - started,
                self.spec.block_tokens,
            )
        self.stats.blocks_restored += len(blocks)
        self.stats.bytes_restored += nbytes
        return blocks

    def _opened(self, tenant: str, digests: Sequence[bytes]) -> Iterator[bytes | memoryview]:
        try:
            for digest, payload in zip(
                digests, self.client.iter_views(tenant, self.model, digests), strict=False
            ):
                if self.sealer is not None:
                    try:
                        payload = self.sealer.open(tenant, self.model, digest, payload)
                    except SealError:
                        self.stats.open_failures += 1
                        self.telemetry.open_failure()
                        log.warning("a block failed to open; treating it as a miss")
                        return
                yield payload
            self.breaker.record_success()
        except KvshareError as error:
            self._store_failed("get", error)

    # -- save (write-behind) ------------------------------------------------------------

    def save(self, tenant: str, digests: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> bool:
        """Queue blocks for the store; False (and counted) when the queue is full.

        `blocks` must not alias memory the engine will overwrite (see blocks_from_cache).
        """
        if len(digests) != len(blocks):
            raise ValueError(f"{len(digests)} digests for {len(blocks)} blocks; pass one each")
        if not digests:
            return True
        job = _SaveJob(tenant, tuple(digests), tuple(blocks), self.telemetry.current_context())
        try:
            self._saves.put_nowait(job)
        except queue.Full:
            self.stats.saves_dropped += 1
            self.telemetry.save_dropped("queue_full")
            return False
        self.stats.saves_queued += 1
        return True

    def _save_loop(self) -> None:
        while True:
            job = self._saves.get()
            try:
                if job is None:
                    return
                self._save_now(job)
            except Exception:  # a bug must not kill the saver: later saves still run
                self.stats.saves_dropped += 1
                self.telemetry.save_dropped("error")
                log.exception("save failed unexpectedly; dropped")
            finally:
                self._saves.task_done()

    def _save_now(self, job: _SaveJob) -> None:
        if not self._allow():
            self.stats.saves_dropped += 1
            self.telemetry.save_dropped("breaker_open")
            return
        with self.telemetry.span("kvshare.agent.save", job.tenant, job.parent) as span:
            payloads = []
            for digest, block in zip(job.digests, job.blocks, strict=True):
                payload = encode_block(self.spec, block)
                if self.sealer is not None:
                    payload = self.sealer.seal(job.tenant, self.model, digest, payload)
                payloads.append(payload)
            try:
                self.client.put(job.tenant, self.model, job.digests, payloads)
                self.breaker.record_success()
                self.stats.blocks_saved += len(payloads)
                self.telemetry.saved(span, job.tenant, len(payloads))
            except KvshareError as error:
                self._store_failed("put", error)

    def flush(self) -> None:
        """Wait until every queued save has been attempted (tests, demo, shutdown)."""
        self._saves.join()

    # -- failure handling -----------------------------------------------------------------

    def _allow(self) -> bool:
        if self.breaker.allow():
            return True
        self.stats.skipped_breaker_open += 1
        self.telemetry.breaker_skip()
        return False

    def _store_failed(self, operation: str, error: KvshareError) -> None:
        self.stats.store_errors += 1
        self.telemetry.store_error(operation)
        self.breaker.record_failure()
        code = getattr(error, "code", None)
        status = code().name if callable(code) else type(error).__name__
        log.warning("store %s failed (%s); serving a miss", operation, status)

    def close(self) -> None:
        self.flush()
        self._saves.put(None)
        self._saver.join()
        self.client.close()
