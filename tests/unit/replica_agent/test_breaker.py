"""Circuit breaker transitions with an injected clock (no sleeps)."""

from __future__ import annotations

from replica_agent.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_opens_after_threshold_and_lets_one_trial_through_after_cooldown() -> None:
    clock = Clock()
    breaker = CircuitBreaker(failure_threshold=3, cooldown_s=2.0, clock=clock)
    for _ in range(2):
        assert breaker.allow()
        breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN and not breaker.allow()
    clock.now = 2.0
    assert breaker.state is BreakerState.HALF_OPEN
    assert breaker.allow() and not breaker.allow()  # one trial at a time
    breaker.record_failure()
    assert breaker.state is BreakerState.OPEN  # the trial failed: open again
    clock.now = 4.5
    assert breaker.allow()
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.allow()
    assert breaker.times_opened == 2


def test_success_resets_the_failure_count() -> None:
    breaker = CircuitBreaker(failure_threshold=2, clock=Clock())
    breaker.record_failure()
    breaker.record_success()
    breaker.record_failure()
    assert breaker.state is BreakerState.CLOSED
