"""Scenarios: reshaped traffic and replica pools that change mid-trace.

Two kinds, one name each:

- traffic (`shape_traffic`): `burst` squeezes the middle 20% of requests into a tenth
  of their time; `unique` gives 90% of requests fresh block ids, the mostly-unique
  traffic where no cache can help.
- pool (`plan_replicas`): `autoscale` starts with half the replicas, adds the rest cold
  at one third of the trace and removes them again at two thirds; `churn` restarts
  every replica once, one at a time (a rolling deploy), each coming back cold.

`static` changes neither. Times are fractions of the trace's own span, so a scenario
means the same thing on any trace.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvshare.simulate.errors import SimulateInputError
from kvshare.simulate.trace import Request

SCENARIO_NAMES: tuple[str, ...] = ("static", "autoscale", "churn", "burst", "unique")

BURST_START_FRACTION = 0.4  # the burst starts at this fraction of the requests
BURST_REQUEST_FRACTION = 0.2  # and takes this fraction of them
BURST_SPEEDUP = 10.0  # arriving this many times faster than in the trace
UNIQUE_REQUEST_FRACTION = 0.9  # share of requests whose every block becomes new


@dataclass(frozen=True)
class ScalingEvent:
    """At `at_s`, `leaves` replicas leave (oldest or newest first), then `joins` join cold."""

    at_s: float
    joins: int
    leaves: int
    leave_oldest: bool


@dataclass(frozen=True)
class ReplicaPlan:
    """How many replicas start, and the joins and leaves that follow, in time order."""

    initial_replicas: int
    events: tuple[ScalingEvent, ...]


def check_scenario(name: str) -> str:
    """Return `name` if it is a scenario, else raise with the list to choose from."""
    if name not in SCENARIO_NAMES:
        raise SimulateInputError(
            f"unknown scenario {name!r}; choose one of {', '.join(SCENARIO_NAMES)}"
        )
    return name


def shape_traffic(requests: Sequence[Request], scenario: str, seed: int) -> tuple[Request, ...]:
    """The requests a scenario replays: the trace itself unless it is `burst` or `unique`."""
    if scenario == "burst":
        return _compress_burst(requests)
    if scenario == "unique":
        return _make_mostly_unique(requests, seed)
    return tuple(requests)


def _compress_burst(requests: Sequence[Request]) -> tuple[Request, ...]:
    count = len(requests)
    first = int(count * BURST_START_FRACTION)
    after = min(count, first + max(1, int(count * BURST_REQUEST_FRACTION)))
    if first >= count:
        return tuple(requests)
    start_s = requests[first].arrival_s
    end_s = requests[after].arrival_s if after < count else requests[-1].arrival_s
    saved_s = (end_s - start_s) * (1.0 - 1.0 / BURST_SPEEDUP)
    shaped = list(requests[:first])
    for request in requests[first:after]:
        arrival_s = start_s + (request.arrival_s - start_s) / BURST_SPEEDUP
        shaped.append(replace(request, arrival_s=arrival_s))
    shaped.extend(replace(r, arrival_s=r.arrival_s - saved_s) for r in requests[after:])
    return tuple(shaped)


def _make_mostly_unique(requests: Sequence[Request], seed: int) -> tuple[Request, ...]:
    rng = random.Random(seed)
    next_id = 1 + max((max(r.block_ids) for r in requests if r.block_ids), default=-1)
    shaped = []
    for request in requests:
        if rng.random() < UNIQUE_REQUEST_FRACTION:
            fresh_ids = tuple(range(next_id, next_id + len(request.block_ids)))
            next_id += len(request.block_ids)
            request = replace(request, block_ids=fresh_ids)
        shaped.append(request)
    return tuple(shaped)


def plan_replicas(scenario: str, replicas: int, start_s: float, end_s: float) -> ReplicaPlan:
    """The pool a scenario runs: `replicas` throughout, unless `autoscale` or `churn`."""
    span_s = end_s - start_s
    if scenario == "autoscale":
        initial = max(1, replicas // 2)
        extra = replicas - initial
        grow = ScalingEvent(start_s + span_s / 3, joins=extra, leaves=0, leave_oldest=False)
        shrink = ScalingEvent(start_s + 2 * span_s / 3, joins=0, leaves=extra, leave_oldest=False)
        return ReplicaPlan(initial, (grow, shrink) if extra else ())
    if scenario == "churn":
        restarts = tuple(
            ScalingEvent(start_s + span_s * (i + 1) / (replicas + 1), 1, 1, leave_oldest=True)
            for i in range(replicas)
        )
        return ReplicaPlan(replicas, restarts)
    return ReplicaPlan(replicas, ())
