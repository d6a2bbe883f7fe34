"""The replica side's one store gate: what every engine gets for each store outcome.

The transformers agent (`ReplicaAgent`), the vLLM connector (`adapters.vllm_store`) and
the SGLang backend (`adapters.sglang_pages`) all call the store through `StoreGate`, so
an outcome means the same thing in every engine. Engine-neutral: no torch, no engine.

Invariant: inference never fails and never waits long because of the store. Whatever
the store does, the engine gets a result, a miss or a dropped save, never an exception;
every call runs under the client's deadline (`timeout_s`, the whole call's budget
however slowly the reply comes: replica_agent.deadline) and a circuit breaker.

The outcome table (`OUTCOMES`, the one copy of it; docs/architecture.md repeats it):

    outcome      store said / what happened             engine gets            breaker
    success      answered in full                       the blocks / stored    answered
    miss         answered, fewer leading blocks          a shorter prefix       answered
    refused      PERMISSION_DENIED, INVALID_ARGUMENT,    a miss / dropped save  answered
                 RESOURCE_EXHAUSTED (the request's own
                 fault: its tenant, its size, a quota)
    unavailable  UNAVAILABLE, a connection that failed   a miss / dropped save  failure
    timeout      DEADLINE_EXCEEDED, a timeout: the       a miss / dropped save  failure
                 reply did not end within timeout_s
    internal     INTERNAL, any other status              a miss / dropped save  failure
                 (UNAUTHENTICATED, DATA_LOSS: a reply
                 that breaks its framing or announces
                 sizes past the limits, ...), or an
                 unexpected error below the gate
    tampered     a sealed block failed to open           a miss from that       answered
    malformed    an opened block is not of this          block on (recomputed)  answered
                 engine's layout (codec header), or
                 holds NaN or infinite values

"answered" resets the breaker's failure count (and closes a half-open breaker): the
store is up. A refusal must not count as a failure, or a request naming a foreign
tenant could switch the cache off for every tenant of the replica; a bad block must
not either, or a writer without the data key could. "failure" counts towards opening
the breaker; while it is open calls are skipped (`skipped_breaker_open`) until its
cooldown lets one trial call through. A slow or malformed reply is the store's own
doing, so it is a failure: a store that drips its replies opens the breaker after
`failure_threshold` calls of `timeout_s` each, and the engine stops waiting for it.

Breaker protocol: every `allow()` that returns True is settled exactly once, by leaving
`settled(...)` (or through `call`, which does both): a half-open breaker lets one trial
through and waits for its settlement, so a trial never settled would keep it off.
Logs name the operation and the status, never tokens, digests, payloads or tenants.
A refusal of this replica's credentials (UNAUTHENTICATED: a revoked or rotated-out
token; PERMISSION_DENIED: a principal that lost a tenant) is logged once, when it
starts, not per call: until a call is answered again (the token file rewritten with a
token the store accepts, replica_agent.credentials), the engine gets misses and a
revoked replica's log stays readable.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from types import MappingProxyType, TracebackType
from typing import TYPE_CHECKING, Final, Protocol, TypeVar

from kvcommon.errors import KvshareError
from policy.sealing import SealError, opened_bytes
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.spec import BlockFormatError, ModelSpec
from replica_agent.telemetry import AgentTelemetry

if TYPE_CHECKING:
    from policy.sealing import BlockSealer
    from replica_agent.client import Payload, View

log = logging.getLogger(__name__)
T = TypeVar("T")


class Outcome(StrEnum):
    SUCCESS = "success"
    MISS = "miss"
    REFUSED = "refused"
    UNAVAILABLE = "unavailable"
    TIMEOUT = "timeout"
    INTERNAL = "internal"
    TAMPERED = "tampered"
    MALFORMED = "malformed"


class BreakerEffect(StrEnum):
    ANSWERED = "answered"  # the store is up: the breaker's failure count restarts
    FAILURE = "failure"  # counts towards opening the breaker


@dataclass(frozen=True)
class Treatment:
    engine_gets: str
    breaker: BreakerEffect
    counter: str | None  # the `StoreStats` field it counts
    log_level: int


_MISS_OR_DROP = "a miss, or a dropped save"
_RECOMPUTE_FROM_IT = "a miss from that block on: the engine recomputes it and the rest"
OUTCOMES: Final[Mapping[Outcome, Treatment]] = MappingProxyType(
    {
        Outcome.SUCCESS: Treatment(
            "the blocks, or a stored save", BreakerEffect.ANSWERED, None, logging.DEBUG
        ),
        Outcome.MISS: Treatment(
            "a shorter prefix: the engine recomputes the rest",
            BreakerEffect.ANSWERED,
            None,
            logging.DEBUG,
        ),
        Outcome.REFUSED: Treatment(
            _MISS_OR_DROP, BreakerEffect.ANSWERED, "refused_calls", logging.INFO
        ),
        Outcome.UNAVAILABLE: Treatment(
            _MISS_OR_DROP, BreakerEffect.FAILURE, "store_errors", logging.WARNING
        ),
        Outcome.TIMEOUT: Treatment(
            _MISS_OR_DROP, BreakerEffect.FAILURE, "store_errors", logging.WARNING
        ),
        Outcome.INTERNAL: Treatment(
            _MISS_OR_DROP, BreakerEffect.FAILURE, "store_errors", logging.WARNING
        ),
        Outcome.TAMPERED: Treatment(
            _RECOMPUTE_FROM_IT, BreakerEffect.ANSWERED, "open_failures", logging.WARNING
        ),
        Outcome.MALFORMED: Treatment(
            _RECOMPUTE_FROM_IT, BreakerEffect.ANSWERED, "format_errors", logging.WARNING
        ),
    }
)
# Refusals of the replica's credentials rather than of one request: logged once each.
CREDENTIAL_REFUSALS: Final = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})
# Status names (kvcommon.errors.KvshareError.status) by outcome; any other is INTERNAL.
BY_STATUS: Final[Mapping[str, Outcome]] = MappingProxyType(
    {
        "PERMISSION_DENIED": Outcome.REFUSED,
        "INVALID_ARGUMENT": Outcome.REFUSED,
        "RESOURCE_EXHAUSTED": Outcome.REFUSED,
        "UNAVAILABLE": Outcome.UNAVAILABLE,
        "DEADLINE_EXCEEDED": Outcome.TIMEOUT,
        "INTERNAL": Outcome.INTERNAL,
    }
)


def classify(error: BaseException) -> Outcome:
    """The outcome of a store call that raised `error`."""
    if isinstance(error, SealError):
        return Outcome.TAMPERED
    if isinstance(error, BlockFormatError):
        return Outcome.MALFORMED
    if isinstance(error, KvshareError):
        return BY_STATUS.get(error.status, Outcome.INTERNAL)
    if isinstance(error, ConnectionError):
        return Outcome.UNAVAILABLE
    if isinstance(error, TimeoutError):
        return Outcome.TIMEOUT
    return Outcome.INTERNAL


@dataclass
class StoreStats:
    """Counts of one engine side; the agent's `AgentStats` adds its own to these."""

    lookups_failed: int = 0  # lookups answered with 0 because the store did not say
    store_errors: int = 0  # unavailable, timeout, internal: breaker failures
    refused_calls: int = 0  # PERMISSION_DENIED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED
    skipped_breaker_open: int = 0  # calls not made: the breaker was open
    open_failures: int = 0  # sealed blocks that failed to open (tampered, moved, bad key)
    format_errors: int = 0  # opened blocks whose layout did not match
    blocks_loaded: int = 0
    blocks_failed: int = 0  # blocks asked for that did not reach the engine's cache
    saves_queued: int = 0  # save jobs queued for the saver
    saves_dropped: int = 0  # save jobs dropped (in part): queue full, breaker open, error
    blocks_queued: int = 0
    blocks_dropped: int = 0  # blocks not saved: queue full, breaker open, error
    blocks_saved: int = 0
    blocks_unflushed: int = 0  # still queued when `close` ran out of time


class StoreClient(Protocol):
    """The calls the gate and the saver make (`replica_agent.client.BlockClient`)."""

    def lookup(self, tenant: str, model: str, digests: Sequence[bytes]) -> int: ...

    def iter_views(self, tenant: str, model: str, digests: Sequence[bytes]) -> Iterator[View]: ...

    def put(
        self, tenant: str, model: str, digests: Sequence[bytes], payloads: Sequence[Payload]
    ) -> list[bool]: ...


class StoreGate:
    """Breaker and outcome table around every store call of one engine side."""

    def __init__(
        self, breaker: CircuitBreaker, telemetry: AgentTelemetry, stats: StoreStats
    ) -> None:
        self.breaker = breaker
        self.telemetry = telemetry
        self.stats = stats
        self._stats_lock = threading.Lock()
        self._refusing: set[str] = set()  # credential refusals logged, not yet answered
        telemetry.watch_breaker(breaker)

    def count(self, **deltas: int) -> None:
        """Add to `stats` (engines call from several threads at once)."""
        with self._stats_lock:
            for name, delta in deltas.items():
                setattr(self.stats, name, getattr(self.stats, name) + delta)

    # -- the breaker -------------------------------------------------------------------

    def allow(self) -> bool:
        """Whether to call the store now (a half-open breaker's one trial); settle a
        True with `settled`."""
        if self.breaker.allow():
            return True
        self.count(skipped_breaker_open=1)
        self.telemetry.breaker_skip()
        return False

    def is_open(self) -> bool:
        """Whether the breaker is open now (counted as a skip); unlike `allow`, reserves
        no trial: for callers that would do costly work before the call."""
        if self.breaker.state is not BreakerState.OPEN:
            return False
        self.count(skipped_breaker_open=1)
        self.telemetry.breaker_skip()
        return True

    def settled(self, operation: str) -> _Settled:
        """Around a call `allow` let through: leaving normally (or a generator closed
        early) is an answer; an exception is classified, settled and not re-raised."""
        return _Settled(self, operation)

    def settle(
        self, outcome: Outcome, operation: str = "get", error: BaseException | None = None
    ) -> None:
        """Apply the table's row for `outcome`: count, breaker, telemetry, log."""
        treatment = OUTCOMES[outcome]
        if treatment.counter is not None:
            self.count(**{treatment.counter: 1})
        if treatment.breaker is BreakerEffect.FAILURE:
            self.breaker.record_failure()
            self.telemetry.store_error(operation)
        else:
            self.breaker.record_success()
        if outcome is Outcome.TAMPERED:
            self.telemetry.open_failure()
        if error is not None and not isinstance(error, KvshareError):
            log.error("store %s failed unexpectedly; serving a miss", operation, exc_info=error)
            return
        status = error.status if isinstance(error, KvshareError) else outcome.value
        level = treatment.log_level
        if outcome in (Outcome.SUCCESS, Outcome.MISS) and self._refusing:
            self._credentials_accepted()
        elif status in CREDENTIAL_REFUSALS and not self._first_refusal(status):
            level = logging.DEBUG  # logged when the refusal started
        elif status == "UNAUTHENTICATED":
            log.warning(
                "store %s: UNAUTHENTICATED: the store refuses this replica's token (revoked "
                "or rotated out); serving misses and dropping saves until it accepts one. "
                "Write a valid token to the token file: it is re-read without a restart",
                operation,
            )
            return
        log.log(level, "store %s: %s; %s", operation, status, treatment.engine_gets)

    def _first_refusal(self, status: str) -> bool:
        with self._stats_lock:
            first = status not in self._refusing
            self._refusing.add(status)
        return first

    def _credentials_accepted(self) -> None:
        with self._stats_lock:
            refused, self._refusing = self._refusing, set()
        if "UNAUTHENTICATED" in refused:
            log.warning("the store accepts this replica's token again; the cache is back")

    def call(self, operation: str, action: Callable[[], T]) -> T | None:
        """`action()`, or None when the breaker is open or the call failed."""
        if not self.allow():
            return None
        with self.settled(operation):
            return action()
        return None

    # -- the verbs every engine shares ---------------------------------------------------

    def leading(
        self, client: StoreClient, tenant: str, model: str, digests: Sequence[bytes]
    ) -> int:
        """How many leading blocks of `digests` the store holds (0 when it cannot say)."""
        if not digests:
            return 0
        found = self.call("lookup", lambda: client.lookup(tenant, model, digests))
        if found is None:
            self.count(lookups_failed=1)
            return 0
        if found < len(digests):
            self.settle(Outcome.MISS, "lookup")
        return found

    def read(
        self,
        client: StoreClient,
        tenant: str,
        model: str,
        digests: Sequence[bytes],
        check: Callable[[bytes, View], T | None],
    ) -> Generator[T, None, None]:
        """`check(digest, payload)` of the leading stored blocks, up to the first that
        fails its check (None). Run it inside `settled("get")`; the stream is cancelled
        when the reader stops early."""
        payloads = client.iter_views(tenant, model, digests)
        try:
            for digest, payload in zip(digests, payloads, strict=False):
                block = check(digest, payload)
                if block is None:
                    return
                yield block
        finally:
            close = getattr(payloads, "close", None)
            if close is not None:  # a stream left early is cancelled at once
                close()

    def opened(
        self, sealer: BlockSealer | None, where: tuple[str, str, bytes], payload: View
    ) -> View | None:
        """The plaintext of a payload read from `where` (tenant, namespace, digest), or
        None (tampered: counted) when it does not open."""
        if sealer is None:
            return payload
        tenant, model, digest = where
        try:
            return sealer.open(tenant, model, digest, payload)
        except SealError:
            self.settle(Outcome.TAMPERED)
            return None

    def sealed(
        self, sealer: BlockSealer | None, where: tuple[str, str, bytes], payload: View
    ) -> View | SealedView:
        """A payload read from `where` as its consumer takes it: the plaintext view when
        there is no sealer, else a `SealedView` the consumer opens straight into a
        buffer of its own (the restorer: its staging slot or destination)."""
        if sealer is None:
            return payload
        return SealedView(self, sealer, where, payload)

    def verified(
        self,
        sealer: BlockSealer | None,
        spec: ModelSpec,
        where: tuple[str, str, bytes],
        payload: View,
        decode: Callable[[ModelSpec, View], T],
    ) -> T | None:
        """`decode(spec, plaintext)`, or None (counted) when the payload does not open
        or is not a block of `spec`: nothing unverified reaches an engine's cache."""
        plaintext = self.opened(sealer, where, payload)
        if plaintext is None:
            return None
        try:
            return decode(spec, plaintext)
        except BlockFormatError:
            self.settle(Outcome.MALFORMED)
            return None


class SealedView:
    """A sealed payload not yet opened, for a consumer that opens it into a buffer it
    owns (`BlockSealer.open_into`): the one host copy between the socket's buffers and
    the staging or destination. Valid as long as the view it wraps (the next block read
    may reuse that buffer). A block that fails to open is settled as tampered here, as
    `StoreGate.opened` does, and leaves the buffer zeroed."""

    __slots__ = ("_gate", "_payload", "_sealer", "_where")

    def __init__(
        self, gate: StoreGate, sealer: BlockSealer, where: tuple[str, str, bytes], payload: View
    ) -> None:
        self._gate, self._sealer, self._where, self._payload = gate, sealer, where, payload

    @property
    def opened_bytes(self) -> int:
        """How many bytes it opens to (0 when it is too short to be sealed)."""
        return opened_bytes(self._payload)

    def open_into(self, out: bytearray | memoryview) -> memoryview | None:
        """The plaintext in `out`'s first `opened_bytes` bytes, or None (tampered:
        counted, that region zeroed) when it does not open."""
        tenant, model, digest = self._where
        try:
            return self._sealer.open_into(tenant, model, digest, self._payload, out)
        except SealError:
            self._gate.settle(Outcome.TAMPERED)
            return None

    def open(self) -> View | None:
        """The plaintext in fresh memory (`StoreGate.opened`), for what does not fit."""
        return self._gate.opened(self._sealer, self._where, self._payload)


class _Settled:
    def __init__(self, gate: StoreGate, operation: str) -> None:
        self._gate, self._operation = gate, operation

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> bool:
        if error is None or isinstance(error, GeneratorExit):
            self._gate.settle(Outcome.SUCCESS, self._operation)
            return False
        self._gate.settle(classify(error), self._operation, error)
        return isinstance(error, Exception)  # a miss, never a crash; interrupts go on
