"""`ReplicaAgent`: what runs on each inference replica.

    agent = ReplicaAgent.connect("127.0.0.1:50051", token, spec, sealer=sealer)
    digests = agent.digests(token_ids)          # per full block, chained
    m = agent.match(tenant, digests)            # PrefixMatch: blocks/tokens the store holds
    kv = agent.load(m, first_block=k)           # [n, *spec.block_shape] on the device
    agent.save(tenant, digests[i:j], blocks)    # write-behind; never blocks inference

Contract: inference never fails and never waits long because of the store. Every store
call goes through the replica side's one gate (replica_agent/gate.py, shared with the
vLLM and SGLang adapters): a timeout, a circuit breaker, and one table of outcomes, so
failures come back as misses (`match` -> 0 blocks, `load` -> fewer blocks, `save` ->
dropped) exactly as in the other engines. The gRPC channel reconnects by itself, and
the breaker lets a trial call through after its cooldown. With a sealer, payloads are
sealed before they leave the replica (by the shared saver, replica_agent/saver.py) and
opened before they are decoded, straight into the restore's staging or destination
(replica_agent/device.py): a block that fails to open is a miss plus a counter and
never becomes a tensor. `AgentStats` counts for this agent; `AgentTelemetry`
records the same events as OpenTelemetry metrics and spans (replica_agent/telemetry.py).

Threads and devices: `load` may be called from several threads at once (each restore
borrows its own staging, replica_agent/device.py). On CUDA `load` returns before the
copies finish; the caller's current stream waits for them. `save` copies the blocks out
of device memory at call time, ordered after the calling thread's current stream, into
a host pool bounded in bytes (replica_agent/device_snapshot.py); the saver thread seals
and stores from there and never touches the device. With tensor parallelism every rank
must agree on how many blocks it uses: pass `tp_agree` (e.g. `min_across_ranks`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvcommon.memtune import tune_allocator
from policy.sealing import BlockSealer
from replica_agent.breaker import CircuitBreaker
from replica_agent.client import BlockClient, ClientTls, View
from replica_agent.codec import HEADER_BYTES
from replica_agent.device import BlockRestorer, Payload, Restored, Targets
from replica_agent.device_snapshot import HostPool, Snapshotter
from replica_agent.gate import Outcome, SealedView, StoreGate, StoreStats
from replica_agent.hashing import BlockHasher
from replica_agent.saver import SaveJob, Saver
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry

if TYPE_CHECKING:
    import torch

    from replica_agent.device_ops import DeviceOps, Stream

log = logging.getLogger(__name__)
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_SAVE_QUEUE_JOBS = 64
DEFAULT_FLUSH_TIMEOUT_S = 10.0  # how long `close` waits for queued saves
DEFAULT_SAVE_BUFFER_BYTES = 256 << 20  # host memory for blocks waiting to be stored
# (pinned on CUDA; at least 4 blocks' worth when blocks are larger than 64 MiB)


@dataclass
class AgentStats(StoreStats):
    """The gate's and saver's counts (`StoreStats`, as in every engine) and the agent's."""

    lookups: int = 0
    blocks_matched: int = 0
    blocks_restored: int = 0
    bytes_restored: int = 0
    oom_misses: int = 0  # restores cut short: device memory ran out
    capture_skips: int = 0  # loads and saves skipped: the thread was capturing a CUDA graph


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
        save_buffer_bytes: int | None = None,
        tp_agree: Callable[[int], int] | None = None,
        device_ops: DeviceOps | None = None,
        telemetry: AgentTelemetry | None = None,
    ) -> None:
        """`device`: where restored blocks go; `"cuda"` means the calling thread's
        current device, resolved now. `device_ops`: tests run the CUDA path against a
        simulated copy engine through it; leave it None."""
        if spec.tp_size > 1 and tp_agree is None:
            raise ValueError(
                f"spec has tp_size {spec.tp_size}: ranks must use the same number of "
                "restored blocks; pass tp_agree=min_across_ranks(tp_group) "
                "(replica_agent.device_ops)"
            )
        tune_allocator()  # block-sized buffers come and go: keep them in the heap
        self.client = client
        self.spec = spec
        self.model = spec.wire_model()
        self.sealer = sealer
        self.breaker = breaker or CircuitBreaker()
        self.stats = AgentStats()
        self.telemetry = telemetry or AgentTelemetry()
        self.gate = StoreGate(self.breaker, self.telemetry, self.stats)
        self._tp_agree = tp_agree
        self._restorer = BlockRestorer(spec, device, ops=device_ops)
        self.device = self._restorer.device
        if save_buffer_bytes is None:  # the default, but room for a few blocks at least
            block_bytes = HEADER_BYTES + spec.block_payload_bytes
            save_buffer_bytes = max(DEFAULT_SAVE_BUFFER_BYTES, 4 * block_bytes)
        pool = HostPool(spec, self._restorer.ops, self.device, save_buffer_bytes)
        self._snapshots = Snapshotter(spec, self._restorer.ops, pool)
        self._hashers: dict[bytes, BlockHasher] = {}
        # The snapshot pool bounds the bytes of queued saves; the saver bounds the jobs.
        self._saver = Saver(client, self.gate, sealer, max_jobs=save_queue_jobs)

    @classmethod
    def connect(
        cls,
        address: str,
        token: str | Callable[[], str],
        spec: ModelSpec,
        *,
        tls: ClientTls | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        **kwargs: object,
    ) -> ReplicaAgent:
        """`token`: the bearer token, or a `TokenFile` (replica_agent.credentials) read
        again when it changes; with `sealer=KeyringFileSealer(path)` the keyring is too:
        both rotate without a restart."""
        # The agent opens every block it reads when it has a sealer: it may then use
        # the sealed-payload channel (BlockClient).
        sealed = kwargs.get("sealer") is not None
        client = BlockClient(address, token, tls=tls, timeout_s=timeout_s, sealed_channel=sealed)
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
        assumed present locally and not asked for (every TP rank passes the same)."""
        self._collect()
        with self.telemetry.span("kvshare.agent.match", tenant) as span:
            asking = digests[first_block:]
            found = self._agree(self.gate.leading(self.client, tenant, self.model, asking))
            asked = max(len(digests) - first_block, 0)
            self.telemetry.matched(span, tenant, asked, found, self.spec.block_tokens)
        self._count(lookups=1, blocks_matched=found)
        return PrefixMatch(tenant, tuple(digests), first_block + found, self.spec.block_tokens)

    def load(self, match: PrefixMatch, *, first_block: int = 0) -> torch.Tensor:
        """Blocks `first_block .. match.blocks-1` as `[n, *block_shape]` on the device.

        n may be smaller than asked (evicted meanwhile, store failure, a block that fails
        to open or decode, device memory full): the caller recomputes from block
        `first_block + n`. On CUDA the tensor is ready for work on the current stream.
        """
        held: list[torch.Tensor] = []

        def restore(payloads: Iterator[Payload], wanted: int) -> Restored:
            blocks, restored = self._restorer.restore(payloads, wanted)
            held.append(blocks)
            return restored

        count = self._restore(match, first_block, restore)
        return self._restorer.leading(held[0], count)

    def load_into(
        self,
        match: PrefixMatch,
        targets: Targets,
        *,
        first_block: int = 0,
        stream: Stream | None = None,
    ) -> int:
        """Like `load`, into the caller's destinations (engine adapters): block
        `first_block + i` goes to `targets(i)` (see BlockRestorer.restore_into). Returns
        how many leading blocks the caller may use; `stream` waits for them."""
        return self._restore(
            match,
            first_block,
            lambda payloads, wanted: self._restorer.restore_into(
                payloads, targets, wanted, stream=stream
            ),
        )

    def _restore(
        self,
        match: PrefixMatch,
        first_block: int,
        run: Callable[[Iterator[Payload], int], Restored],
    ) -> int:
        capturing = self._restorer.is_capturing()
        self._collect(capturing)
        wanted = match.digests[first_block : match.blocks]
        with self.telemetry.span("kvshare.agent.load", match.tenant) as span:
            started = time.perf_counter()
            if capturing:  # before the breaker: no trial call wasted
                run(iter(()), 0)
                restored = Restored(0, "capturing")
            elif not wanted or not self.gate.allow():
                restored = run(iter(()), 0)
            else:  # closed as soon as the restorer stops: the call is settled then
                with closing(self._opened(match.tenant, wanted)) as payloads:
                    restored = run(payloads, len(wanted))
            self._note_stop(restored)
            count = self._agree(restored.blocks)
            nbytes = count * self.spec.block_payload_bytes
            seconds = time.perf_counter() - started
            self.telemetry.loaded(
                span, match.tenant, len(wanted), count, nbytes, seconds, self.spec.block_tokens
            )
        self._count(blocks_restored=count, bytes_restored=nbytes)
        return count

    def _opened(
        self, tenant: str, digests: Sequence[bytes]
    ) -> Generator[View | SealedView, None, None]:
        """The payloads of a read the gate allowed: plaintext views, or with a sealer
        `SealedView`s the restorer opens straight into its staging or destination (one
        host copy; a block that fails to open is counted there and ends the restore;
        a layout mismatch: `_note_stop`)."""

        def check(digest: bytes, payload: View) -> View | SealedView:
            return self.gate.sealed(self.sealer, (tenant, self.model, digest), payload)

        with self.gate.settled("get"):
            read: Iterator[View | SealedView] = self.gate.read(
                self.client, tenant, self.model, digests, check
            )
            yield from read

    def _note_stop(self, restored: Restored) -> None:
        if restored.stopped_by is None:
            return
        self.telemetry.restore_stopped(restored.stopped_by)
        if restored.stopped_by == "format_error":
            self.gate.settle(Outcome.MALFORMED)
        elif restored.stopped_by == "out_of_memory":
            self._count(oom_misses=1)
            log.warning("device memory ran out during a restore; serving a shorter prefix")
        else:
            self._count(capture_skips=1)

    def _agree(self, count: int) -> int:
        """Tensor parallelism: every rank uses the smallest count of any rank."""
        if self._tp_agree is None:
            return count
        return min(count, self._tp_agree(count))

    # -- save (write-behind) ------------------------------------------------------------

    def save(self, tenant: str, digests: Sequence[bytes], blocks: Sequence[torch.Tensor]) -> bool:
        """Queue blocks for the store; False (and counted) when they cannot be queued.

        The blocks' bytes are copied out when this is called (on CUDA: queued after the
        current stream's work), so the caller may reuse or free them at once.
        """
        if len(digests) != len(blocks):
            raise ValueError(f"{len(digests)} digests for {len(blocks)} blocks; pass one each")
        if not digests:
            return True
        self._collect()
        nbytes = len(blocks) * self._snapshots.pool.block_bytes
        if not self._saver.reserve(len(blocks), nbytes):
            return False
        try:
            snapshot = self._snapshots.take(blocks)
        except BaseException:
            self._saver.cancel(len(blocks), nbytes, "error")
            raise
        if isinstance(snapshot, str):
            self._saver.cancel(len(blocks), nbytes, snapshot)
            self._count(capture_skips=int(snapshot == "capturing"))
            return False
        pool, snapshots, encoded = self._snapshots.pool, self._snapshots, snapshot.encoded()
        self._saver.submit(
            SaveJob(
                tenant,
                self.model,
                tuple(digests),
                encoded.__getitem__,  # read by the saver thread once the copies are done
                nbytes,
                self.telemetry.current_context(),
                is_ready=lambda: snapshots.is_done(snapshot),
                wait_ready=lambda: snapshots.wait(snapshot),
                release=lambda: pool.give_back(snapshot.buffers),
            )
        )
        return True

    def _collect(self, capturing: bool | None = None) -> None:
        """Hand saves whose copies finished to the saver; never during a capture (an
        event query there would break the engine's graph)."""
        if capturing is None:
            capturing = self._restorer.is_capturing()
        if not capturing:
            self._saver.collect()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued save has been attempted (tests, demo, shutdown);
        False when `timeout_s` ran out first."""
        return self._saver.flush(timeout_s)

    def _count(self, **deltas: int) -> None:
        self.gate.count(**deltas)

    def close(self, flush_timeout_s: float = DEFAULT_FLUSH_TIMEOUT_S) -> None:
        """Store what is queued, for at most `flush_timeout_s`, then disconnect."""
        self._saver.close(flush_timeout_s)
        self.client.close()
