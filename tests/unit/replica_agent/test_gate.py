"""The store gate's outcome table and its settlement rules (no server: errors as the
client raises them; tests/e2e/test_gate_parity.py runs them against real servers)."""

from __future__ import annotations

import logging
import subprocess
import sys
from collections.abc import Callable, Generator
from dataclasses import fields

import pytest

from policy.sealing import SealError
from replica_agent.breaker import BreakerState, CircuitBreaker
from replica_agent.errors import store_error
from replica_agent.gate import (
    OUTCOMES,
    BreakerEffect,
    Outcome,
    StoreGate,
    StoreStats,
    classify,
)
from replica_agent.spec import BlockFormatError
from replica_agent.telemetry import AgentTelemetry
from tests.support.repo import REPO


def gate(threshold: int = 1) -> StoreGate:
    return StoreGate(CircuitBreaker(failure_threshold=threshold), AgentTelemetry(), StoreStats())


@pytest.mark.parametrize(
    ("status", "outcome"),
    [
        ("PERMISSION_DENIED", Outcome.REFUSED),
        ("INVALID_ARGUMENT", Outcome.REFUSED),
        ("RESOURCE_EXHAUSTED", Outcome.REFUSED),
        ("UNAVAILABLE", Outcome.UNAVAILABLE),
        ("DEADLINE_EXCEEDED", Outcome.TIMEOUT),
        ("INTERNAL", Outcome.INTERNAL),
        ("UNAUTHENTICATED", Outcome.INTERNAL),  # this replica's token: every call fails
        ("DATA_LOSS", Outcome.INTERNAL),
        ("UNKNOWN", Outcome.INTERNAL),
    ],
)
def test_each_status_the_client_raises_has_one_outcome(status: str, outcome: Outcome) -> None:
    assert classify(store_error(status, "details")) is outcome


@pytest.mark.parametrize(
    ("error", "outcome"),
    [
        (ConnectionRefusedError(), Outcome.UNAVAILABLE),
        (TimeoutError(), Outcome.TIMEOUT),
        (SealError("block cannot be opened"), Outcome.TAMPERED),
        (BlockFormatError("bad header"), Outcome.MALFORMED),
        (OverflowError("a bug below the gate"), Outcome.INTERNAL),
    ],
)
def test_errors_that_are_not_statuses_are_classified_too(
    error: Exception, outcome: Outcome
) -> None:
    assert classify(error) is outcome


def test_the_table_covers_every_outcome_and_names_real_counters() -> None:
    assert set(OUTCOMES) == set(Outcome)
    counters = {f.name for f in fields(StoreStats)}
    assert {t.counter for t in OUTCOMES.values() if t.counter} <= counters
    failures = {o for o, t in OUTCOMES.items() if t.breaker is BreakerEffect.FAILURE}
    assert failures == {Outcome.UNAVAILABLE, Outcome.TIMEOUT, Outcome.INTERNAL}


def raising(error: BaseException) -> int:
    raise error


def failing_with(status: str, details: str) -> Callable[[], int]:
    return lambda: raising(store_error(status, details))


def test_call_turns_every_error_into_a_miss_as_the_table_says() -> None:
    refused, failing = gate(), gate()
    assert refused.call("lookup", lambda: raising(store_error("PERMISSION_DENIED", "x"))) is None
    assert refused.stats.refused_calls == 1 and refused.breaker.state is BreakerState.CLOSED
    assert failing.call("lookup", lambda: raising(store_error("UNAVAILABLE", "x"))) is None
    assert failing.stats.store_errors == 1 and failing.breaker.state is BreakerState.OPEN
    assert failing.call("lookup", lambda: 3) is None  # skipped: the breaker is open
    assert failing.stats.skipped_breaker_open == 1
    assert refused.call("lookup", lambda: 3) == 3  # positive control


def test_an_interrupt_is_not_swallowed_but_settles_the_trial() -> None:
    g = gate()
    assert g.allow()
    with pytest.raises(KeyboardInterrupt), g.settled("get"):
        raise KeyboardInterrupt
    assert g.breaker.state is BreakerState.OPEN  # settled (as a failure): no trial kept


def test_a_read_the_reader_leaves_early_is_settled_as_answered() -> None:
    clock = [0.0]
    breaker = CircuitBreaker(failure_threshold=1, cooldown_s=1.0, clock=lambda: clock[0])
    g = StoreGate(breaker, AgentTelemetry(), StoreStats())
    breaker.record_failure()
    clock[0] = 1.0  # half-open: the next call is the one trial

    def reader() -> Generator[int, None, None]:
        with g.settled("get"):
            yield from (1, 2, 3)

    assert g.allow()
    blocks = reader()
    assert next(blocks) == 1
    blocks.close()  # the engine stopped after one block
    assert breaker.state is BreakerState.CLOSED


def test_logs_name_the_status_never_the_servers_details(
    caplog: pytest.LogCaptureFixture,
) -> None:
    g = gate(threshold=5)
    with caplog.at_level(logging.DEBUG, logger="replica_agent.gate"):
        for status in ("PERMISSION_DENIED", "UNAVAILABLE", "DEADLINE_EXCEEDED"):
            g.call("get", failing_with(status, "tenant-x digest-ab12"))
    messages = [r.getMessage() for r in caplog.records]
    assert [m.split(";")[0] for m in messages] == [
        "store get: PERMISSION_DENIED",
        "store get: UNAVAILABLE",
        "store get: DEADLINE_EXCEEDED",
    ]
    assert not any("tenant-x" in m or "ab12" in m for m in messages)


def test_the_gate_and_the_saver_import_no_torch() -> None:
    """Engine-neutral: the agent, vLLM and SGLang share them; torch is the engines'."""
    code = "import sys, replica_agent.gate, replica_agent.saver; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO, check=False).returncode == 0
