"""One transport's probes: the attacker's arms, timed as kvshare.audit.timing's
invariants say, and the transport's report (its comparisons and verdict).
"""

from __future__ import annotations

import gc
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvcommon.errors import KvshareError, PermissionDenied
from kvshare.audit.parties import open_client
from kvshare.audit.setup import LOOKUP_RUN, Planted, Pool, Setup, Transport
from kvshare.audit.verdicts import (
    CHANNEL,
    CONTROL_AUC,
    INCONCLUSIVE,
    PASS,
    Report,
    compare,
    leaks,
    separates,
    weakest,
    worst,
)
from replica_agent.client import BlockClient

REPEATS = 3  # a probe's time: the fastest of this many back-to-back calls
WARMUP_CALLS = 50  # calls discarded per transport before timing counts


@dataclass(frozen=True)
class Arm:
    """One timed call: `call(i)` is timed; `expect(result)` is checked after the timer."""

    call: Callable[[int], object]
    expect: Callable[[object], bool]
    hard: bool  # an unexpected outcome is an isolation failure, not just noise


REFUSED, ALLOWED = "refused", "allowed"


def _refusal(call: Callable[[], object]) -> str:
    try:
        call()
    except PermissionDenied:
        return REFUSED
    return ALLOWED


def _arms(client: BlockClient, setup: Setup, planted: Planted, *, lookups: bool) -> dict[str, Arm]:
    """The attacker's arms (kvshare.audit.timing's docstring): cross-tenant, random
    miss, own hit, by get (and by lookup when `lookups`); and naming the victim's
    tenant, planted vs random digest."""
    a, v, m = setup.attacker.tenant, setup.victim.tenant, planted.model
    pools = {"cross": planted.victim, "random": planted.random, "own": planted.own}
    arms: dict[str, Arm] = {}
    for kind, pool in pools.items():
        hit = kind == "own"

        def get(i: int, pool: Pool = pool) -> object:
            return client.get(a, m, [pool.block(i)])

        def lookup(i: int, pool: Pool = pool) -> object:
            return client.lookup(a, m, pool.run(i))

        def got(result: object, hit: bool = hit) -> bool:
            return isinstance(result, list) and len(result) == (1 if hit else 0)

        def counted(result: object, hit: bool = hit) -> bool:
            return result == (LOOKUP_RUN if hit else 0)

        arms[f"get_{kind}"] = Arm(get, got, hard=kind == "cross")
        if lookups:
            arms[f"lookup_{kind}"] = Arm(lookup, counted, hard=kind == "cross")
    for kind, pool in (("planted", planted.victim), ("random", planted.random)):

        def named(i: int, pool: Pool = pool) -> object:
            return _refusal(lambda: client.get(v, m, [pool.block(i)]))

        arms[f"named_{kind}"] = Arm(named, lambda r: r == REFUSED, hard=True)
    return arms


def _time(
    arms: dict[str, Arm], rounds: int, rng: random.Random
) -> tuple[dict[str, list[int]], dict[str, int]]:
    """Nanosecond timings per arm over `rounds` counted rounds (after the warm-up), in a
    fresh random order each round; and per arm the count of unexpected outcomes."""
    order = list(arms)
    samples: dict[str, list[int]] = {name: [] for name in arms}
    unexpected = dict.fromkeys(arms, 0)
    warmup = math.ceil(WARMUP_CALLS / len(arms))
    gc.collect()
    gc.disable()  # collector pauses add noise to whichever call they land in
    try:
        for i in range(warmup + rounds):
            rng.shuffle(order)
            for name in order:
                arm = arms[name]
                fastest = None
                for _ in range(REPEATS):
                    start = time.perf_counter_ns()
                    result = arm.call(i)
                    elapsed = time.perf_counter_ns() - start
                    fastest = elapsed if fastest is None else min(fastest, elapsed)
                    if not arm.expect(result):
                        unexpected[name] += 1
                if i >= warmup and fastest is not None:
                    samples[name].append(fastest)
    finally:
        gc.enable()
    return samples, unexpected


def _available(transport: Transport, client: BlockClient, setup: Setup, local: bool) -> str | None:
    """Why `transport` cannot be audited from here (None: it can). Checked after calls."""
    stats = client.transport_stats
    if transport.bulk and stats.bulk_fallbacks:
        return (
            f"the bulk channel fell back to gRPC {stats.bulk_fallbacks} time(s): "
            "the server's bulk listener is unreachable from here"
        )
    if transport.same_host:
        if not local:
            return f"{setup.target} is not an address of this host"
        if stats.same_host_fallbacks or not stats.same_host_connections:
            return (
                "no same-host arena was granted (another host or network namespace, "
                "another user, or the server's arenas are all taken): TCP was used"
            )
    return None


def probe_transport(
    transport: Transport, setup: Setup, planted: Planted, rng: random.Random, *, local: bool
) -> Report:
    """One transport's entry: skipped with a reason, or its comparisons and verdict."""
    if transport.same_host and not local:
        return {"skipped": f"{setup.target} is not an address of this host"}
    with open_client(setup, setup.attacker, transport) as client:
        arms = _arms(client, setup, planted, lookups=transport.lookups)
        try:
            for arm in arms.values():  # one call each: opens its connections
                arm.call(0)
        except KvshareError as error:
            return {"skipped": f"a first call failed ({getattr(error, 'status', error)})"}
        reason = _available(transport, client, setup, local)
        if reason is not None:
            return {"skipped": reason}
        samples, unexpected = _time(arms, setup.probes, rng)
        reason = _available(transport, client, setup, local)
        if reason is not None:
            return {"skipped": f"{reason} while timing"}
    report = transport_report(samples, unexpected, arms)
    return report


def transport_report(
    samples: dict[str, list[int]], unexpected: dict[str, int], arms: dict[str, Arm]
) -> Report:
    """Comparisons per operation, the worst cross-tenant one, the weakest control, the
    named-tenant refusal timing, and the verdict with its reasons."""
    ops = {
        op: {
            "cross_tenant": compare(samples[f"{op}_cross"], samples[f"{op}_random"]),
            "control": compare(samples[f"{op}_own"], samples[f"{op}_random"]),
        }
        for op in ("get", "lookup")
        if f"{op}_cross" in samples
    }
    named = compare(samples["named_planted"], samples["named_random"])
    cross = worst([o["cross_tenant"] for o in ops.values()])
    control = weakest([o["control"] for o in ops.values()])
    reasons: list[str] = []
    for name, count in unexpected.items():
        if count and arms[name].hard:
            reasons.append(f"{name}: {count} call(s) were not the isolated miss or refusal")
    for op, c in ops.items():
        if leaks(c["cross_tenant"]):
            reasons.append(f"{op}: cross-tenant probes time unlike random misses")
    if leaks(named):
        reasons.append("naming the victim's tenant: refusals time differently for its blocks")
    verdict = CHANNEL if reasons else PASS
    if verdict == PASS:
        for op, c in ops.items():
            if not separates(c["control"]):
                reasons.append(
                    f"{op}: the control (own hits vs misses) did not separate "
                    f"(auc {c['control']['auc']:.3f} < {CONTROL_AUC}): too noisy to vouch"
                )
        verdict = INCONCLUSIVE if reasons else PASS
    for name, count in unexpected.items():
        if count and not arms[name].hard:
            reasons.append(f"{name}: {count} own block(s) missing (evicted?)")
    return {
        "cross_tenant": cross,
        "control": control,
        "verdict": verdict,
        "reasons": reasons,
        "ops": ops,
        "named_tenant": named,
        "median_us": {name: _median(values) / 1000 for name, values in samples.items()},
    }


def _median(values: Sequence[int]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
