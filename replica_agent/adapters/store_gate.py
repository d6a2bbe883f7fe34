"""What every engine adapter puts around the store: a gate per call, and block checks.

Engine-neutral (no engine imports): the vLLM connector (`vllm_store`) and the SGLang
HiCache backend (`sglang_pages`) both use it.

Invariants:
- Inference never fails and never waits long because of the store. `StoreGate.call`
  runs a store call under the client's deadline (`timeout_s`) and a circuit breaker,
  and turns every error into a miss (None). Refusals about the request itself
  (permission, size, quota) are misses that do not open the breaker: a request naming
  a foreign tenant cannot switch the cache off for others.
- Nothing unverified reaches an engine's cache: `verified` opens a payload (AEAD, bound
  to tenant, namespace and digest) and checks it against the expected layout before
  the caller writes a single element; a failure is counted, logged without any
  payload, digest or tenant, and returned as None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kvcommon.errors import InvalidArgument, KvshareError, PermissionDenied, ResourceExhausted
from policy.sealing import BlockSealer, SealError
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.client import View
from replica_agent.codec import BlockFormatError
from replica_agent.spec import ModelSpec
from replica_agent.telemetry import AgentTelemetry

log = logging.getLogger(__name__)
T = TypeVar("T")
# Refusals about this request (its tenant, its size, a quota), not signs of a sick store:
# they are misses but do not count towards opening the breaker.
REQUEST_ERRORS = (PermissionDenied, InvalidArgument, ResourceExhausted)


@dataclass
class StoreStats:
    lookups_failed: int = 0
    store_errors: int = 0  # failed or timed-out calls (breaker failures)
    refused_calls: int = 0  # PERMISSION_DENIED, INVALID_ARGUMENT, RESOURCE_EXHAUSTED
    skipped_breaker_open: int = 0
    blocks_loaded: int = 0
    blocks_failed: int = 0  # blocks asked for that did not reach the engine's cache
    open_failures: int = 0  # sealed blocks that failed to open (tampered, moved, bad key)
    format_errors: int = 0  # opened blocks whose layout did not match
    blocks_queued: int = 0
    blocks_dropped: int = 0  # not saved: queue over its byte bound, breaker open, error
    blocks_saved: int = 0
    blocks_unflushed: int = 0  # still queued when `close` ran out of time


class StoreGate:
    """Breaker, deadline and error triage around every store call of one side."""

    def __init__(
        self, breaker: CircuitBreaker, telemetry: AgentTelemetry, stats: StoreStats
    ) -> None:
        self.breaker = breaker
        self.telemetry = telemetry
        self.stats = stats
        telemetry.watch_breaker(breaker)

    def allow(self) -> bool:
        if self.breaker.allow():
            return True
        self.stats.skipped_breaker_open += 1
        self.telemetry.breaker_skip()
        return False

    def is_open(self) -> bool:
        """Whether the breaker is open now (counted as a skip); unlike `allow`, reserves
        no half-open trial: for callers that would do costly work before the call."""
        if self.breaker.state is not BreakerState.OPEN:
            return False
        self.stats.skipped_breaker_open += 1
        self.telemetry.breaker_skip()
        return True

    def call(self, operation: str, action: Callable[[], T]) -> T | None:
        """`action()`, or None when the breaker is open or the call failed."""
        if not self.allow():
            return None
        try:
            result = action()
        except Exception as error:  # any failure of the cache is a miss, never a crash
            self.failed(operation, error)
            return None
        self.breaker.record_success()
        return result

    def failed(self, operation: str, error: Exception) -> None:
        if isinstance(error, REQUEST_ERRORS):
            self.stats.refused_calls += 1
            self.breaker.record_success()  # the store answered; the request was refused
            log.info("store %s refused (%s); serving a miss", operation, type(error).__name__)
            return
        self.stats.store_errors += 1
        self.telemetry.store_error(operation)
        self.breaker.record_failure()
        code = getattr(error, "code", None)
        status = code().name if callable(code) else type(error).__name__
        if not isinstance(error, KvshareError):
            log.exception("store %s failed unexpectedly; serving a miss", operation)
        else:
            log.warning("store %s failed (%s); serving a miss", operation, status)


def verified(
    gate: StoreGate,
    sealer: BlockSealer | None,
    spec: ModelSpec,
    where: tuple[str, str, bytes],
    payload: View,
    decode: Callable[[ModelSpec, View], T],
) -> T | None:
    """`decode(spec, plaintext)` of a payload read from `where` (tenant, namespace,
    digest), or None when it fails to open (sealed) or does not match `spec`."""
    tenant, model, digest = where
    try:
        if sealer is not None:
            payload = sealer.open(tenant, model, digest, payload)
        return decode(spec, payload)
    except SealError:
        gate.stats.open_failures += 1
        gate.telemetry.open_failure()
        log.warning("a block failed to open; the engine recomputes it")
    except BlockFormatError:
        gate.stats.format_errors += 1
        log.warning("a block does not match this engine's KV layout; the engine recomputes it")
    return None
