"""Scenarios: reshaped arrivals and block ids, and the replica join/leave plans."""

from __future__ import annotations

import pytest

from kvshare.simulate.errors import SimulateInputError
from kvshare.simulate.scenarios import (
    ScalingEvent,
    check_scenario,
    plan_replicas,
    shape_traffic,
)
from kvshare.simulate.trace import Request

# Ten requests, one per second, each sharing block 1 and owning one block of its own.
TEN = tuple(Request(float(i), 8, 0, (1, 100 + i)) for i in range(10))


def test_static_and_pool_scenarios_replay_the_trace_unchanged() -> None:
    for name in ("static", "autoscale", "churn"):
        assert shape_traffic(TEN, name, seed=0) == TEN


def test_burst_squeezes_the_middle_fifth_tenfold_and_shifts_the_rest() -> None:
    # Requests 4 and 5 (from t=4 to t=6) arrive 10x faster; later ones move up 1.8 s.
    arrivals = [request.arrival_s for request in shape_traffic(TEN, "burst", seed=0)]
    expected = [0, 1, 2, 3, 4, 4.1, 4.2, 5.2, 6.2, 7.2]
    assert arrivals == pytest.approx(expected)
    assert [r.block_ids for r in shape_traffic(TEN, "burst", seed=0)] == [r.block_ids for r in TEN]


def test_unique_gives_most_requests_fresh_blocks_deterministically() -> None:
    many = tuple(Request(float(i), 8, 0, (1, 2)) for i in range(1000))
    shaped = shape_traffic(many, "unique", seed=3)
    assert shaped == shape_traffic(many, "unique", seed=3)
    unchanged = sum(1 for request in shaped if request.block_ids == (1, 2))
    assert 60 <= unchanged <= 140  # 10% expected
    fresh = [
        block for request in shaped if request.block_ids != (1, 2) for block in request.block_ids
    ]
    assert len(fresh) == len(set(fresh))
    assert min(fresh) > 2
    assert [r.input_tokens for r in shaped] == [r.input_tokens for r in many]


def test_autoscale_plan_doubles_then_halves_the_pool() -> None:
    plan = plan_replicas("autoscale", 8, start_s=0.0, end_s=9.0)
    assert plan.initial_replicas == 4
    assert plan.events == (
        ScalingEvent(3.0, joins=4, leaves=0, leave_oldest=False),
        ScalingEvent(6.0, joins=0, leaves=4, leave_oldest=False),
    )
    assert plan_replicas("autoscale", 1, 0.0, 9.0).events == ()


def test_churn_plan_restarts_each_replica_once_oldest_first() -> None:
    plan = plan_replicas("churn", 2, start_s=0.0, end_s=9.0)
    assert plan.initial_replicas == 2
    assert plan.events == (
        ScalingEvent(3.0, joins=1, leaves=1, leave_oldest=True),
        ScalingEvent(6.0, joins=1, leaves=1, leave_oldest=True),
    )


def test_unknown_scenario_lists_the_choices() -> None:
    assert check_scenario("burst") == "burst"
    with pytest.raises(SimulateInputError, match="choose one of static, autoscale"):
        check_scenario("flood")
