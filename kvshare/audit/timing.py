"""The timing audit: can one tenant tell, by timing, what another tenant has cached?

Invariants the measurement keeps, so that a difference means a channel:
- Every arm of a comparison makes the same client call with the same shapes (one
  digest for `get`, LOOKUP_RUN digests for `lookup`) from digest pools made before any
  timing, cycled the same way: the only difference between the cross-tenant arm and
  the random-miss arm is that the victim stored the cross-tenant arm's digests.
- The arms run interleaved, in a fresh random order every round, on one client per
  transport; the first rounds (WARMUP_CALLS calls) are discarded; the garbage
  collector is off while timing; only the call itself is inside the timer, every check
  of its outcome comes after.
- A transport is reported only when the client really used it: a bulk transport whose
  calls fell back to gRPC, or a same-host transport that got no arena, is skipped with
  the reason, never measured under a name it did not have.
- A positive control (the attacker's own hits against the same random misses) must
  separate (auc >= CONTROL_AUC), or the harness is blind at this noise level and the
  audit cannot vouch for anything.
- Nothing secret is reported or logged: no token, digest or payload, only tenant ids,
  transport names and statistics.

Blocks are planted under a model name of their own ("kvshare-audit/<random>"), never
colliding with real data, and deleted afterwards.
"""

from __future__ import annotations

import gc
import ipaddress
import math
import os
import random
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvcommon.errors import KvshareError, PermissionDenied
from kvshare.audit.stats import auc, ks_2samp
from policy.types import PUBLIC
from replica_agent.client import BlockClient, ClientTls

PUBLIC_TENANT: str = PUBLIC  # the reserved tenant id of the public scope, "@public"
PUBLIC_BLOCK_BYTES = 64 << 10  # one block per public trial (a read from disk: 16 pages)
# A get's block: a 32-token KV block of a 7B-class model. On a server with a Redis
# Cluster tier a miss asks the cluster, and over the same-host arena that costs about
# what taking 1 MiB does: a hit of this size stays apart from a miss there too.
BLOCK_BYTES = 2 << 20
PLANTED = 8  # blocks of BLOCK_BYTES each party plants for the get arms
# Digests per lookup (a 64k-token prompt at 16 tokens a block): a hit walks the whole
# run. On a server with a Redis Cluster tier a miss asks the cluster, which costs about
# what walking 1024 local entries does; a run this long keeps hits apart from misses there.
LOOKUP_RUN = 4096
RUN_BLOCK_BYTES = 1 << 10  # the lookup arms' blocks: a lookup never reads a payload
PUT_BATCH_BYTES = 4 << 20
REPEATS = 3  # a probe's time: the fastest of this many back-to-back calls
WARMUP_CALLS = 50  # calls discarded per transport before timing counts
CONTROL_AUC = 0.7  # the control separates when its auc is at least this
MAX_SKEW = 0.1  # a comparison passes when |auc - 0.5| <= this ...
KS_ALPHA = 0.01  # ... and its KS p-value is at least this
TIMEOUT_S = 10.0
DIGEST_BYTES = 32

PASS, CHANNEL, INCONCLUSIVE = "pass", "channel", "inconclusive"

Comparison = dict[str, Any]  # {"auc": float, "ks_p": float, "probes": int}
Report = dict[str, Any]


class AuditError(Exception):
    """A usage or connection problem (exit 2); the message says what to change."""


@dataclass(frozen=True)
class Party:
    """A tenant and the token of a principal acting for it; `flag` names the option
    that gave the token, for messages."""

    tenant: str
    token: str
    flag: str


@dataclass(frozen=True)
class Setup:
    target: str
    attacker: Party
    victim: Party
    tls: ClientTls | None = None
    publisher_token: str | None = None
    probes: int = 400
    timeout_s: float = TIMEOUT_S
    # The public check (kvshare.audit.public): the deployment's other servers, the
    # bytes of other puts that move published blocks out of the put journal first,
    # and data files (on this host) whose cold pages are evicted before each trial.
    also_targets: tuple[str, ...] = ()
    public_settle_bytes: int = 0
    evict_files: tuple[Path, ...] = ()


@dataclass(frozen=True)
class Transport:
    """How the attacker's client reaches the store (BlockClient's options)."""

    name: str
    bulk: bool
    same_host: bool

    @property
    def lookups(self) -> bool:
        """Whether to time lookups here: on every transport (BlockClient sends them
        over the bulk channel when it is up, else over gRPC)."""
        return True


def transports(*, tls: bool) -> list[Transport]:
    """Every transport an attacker could use; over TLS the same ones, named so."""
    suffix = "+tls" if tls else ""
    return [
        Transport(f"grpc{suffix}", bulk=False, same_host=False),
        Transport(f"bulk-tcp{suffix}", bulk=True, same_host=False),
        Transport(f"same-host{suffix}", bulk=True, same_host=True),
    ]


@dataclass(frozen=True)
class Pool:
    """One party's digests: `blocks` (PLANTED, for gets) and `runs` (2 * LOOKUP_RUN,
    for lookups). A lookup takes LOOKUP_RUN consecutive digests of `runs`, cyclic."""

    blocks: list[bytes]
    runs: list[bytes]

    @classmethod
    def fresh(cls) -> Pool:
        return cls(_digests(PLANTED), _digests(2 * LOOKUP_RUN))

    def block(self, i: int) -> bytes:
        return self.blocks[i % len(self.blocks)]

    def run(self, i: int) -> list[bytes]:
        return [self.runs[(i + k) % len(self.runs)] for k in range(LOOKUP_RUN)]


@dataclass
class Planted:
    """The audit's digest pools (made before any timing) under its own model name."""

    model: str
    victim: Pool  # stored by the victim in its tenant
    own: Pool  # stored by the attacker in its own tenant (the control)
    random: Pool  # stored by nobody
    public: list[bytes] = field(default_factory=list)  # published under PUBLIC_TENANT

    @classmethod
    def fresh(cls) -> Planted:
        model = f"kvshare-audit/{os.urandom(8).hex()}"
        return cls(model, Pool.fresh(), Pool.fresh(), Pool.fresh())


def _digests(count: int = PLANTED) -> list[bytes]:
    return [os.urandom(DIGEST_BYTES) for _ in range(count)]


# -- statistics -------------------------------------------------------------------------


def compare(x: Sequence[int], y: Sequence[int]) -> Comparison:
    """auc of "x slower than y", the KS p-value, and the probes per arm."""
    return {"auc": auc(x, y), "ks_p": ks_2samp(x, y).pvalue, "probes": min(len(x), len(y))}


def leaks(c: Comparison) -> bool:
    return bool(abs(c["auc"] - 0.5) > MAX_SKEW or c["ks_p"] < KS_ALPHA)


def separates(c: Comparison) -> bool:
    return bool(c["auc"] >= CONTROL_AUC)


def worst(comparisons: Sequence[Comparison]) -> Comparison:
    """The most telling comparison: the largest |auc - 0.5| (ties: the smallest p)."""
    return max(comparisons, key=lambda c: (abs(c["auc"] - 0.5), -c["ks_p"]))


def weakest(comparisons: Sequence[Comparison]) -> Comparison:
    return min(comparisons, key=lambda c: c["auc"])


# -- connecting -------------------------------------------------------------------------


def _explain(error: KvshareError, setup: Setup, party: Party, doing: str) -> AuditError:
    """The usage or connection error a failed set-up call means, saying what to change."""
    status = getattr(error, "status", type(error).__name__)
    if status == "UNAUTHENTICATED":
        return AuditError(
            f"the server refused the token in {party.flag} ({status}) while {doing}: "
            f"give the file of a valid token for tenant {party.tenant!r}"
        )
    if status == "PERMISSION_DENIED" and party.tenant == PUBLIC_TENANT:
        return AuditError(
            f"the principal of {party.flag} may not publish ({status}) while {doing}: "
            "give a token whose principal has the `publish` action"
        )
    if status == "PERMISSION_DENIED":
        return AuditError(
            f"the principal of {party.flag} may not act for tenant {party.tenant!r} "
            f"({status}) while {doing}: give a token whose principal lists that tenant "
            "with read and write, or the tenant it does list"
        )
    if status in ("UNAVAILABLE", "DEADLINE_EXCEEDED"):
        hint = "check --tls-ca" if setup.tls else "if the server uses TLS, give --tls-ca"
        return AuditError(
            f"cannot reach {setup.target} ({status}) while {doing}: check --target "
            f"(HOST:PORT of the server's gRPC listener); {hint}"
        )
    if status == "RESOURCE_EXHAUSTED":
        return AuditError(
            f"tenant {party.tenant!r} has no room ({status}) while {doing}: the audit "
            f"stores {PLANTED} blocks of {BLOCK_BYTES >> 10} KiB per tenant; raise its "
            "quota or its request rate, or free room, and run again"
        )
    return AuditError(f"{doing} failed: {error}")


@contextmanager
def _client(setup: Setup, party: Party, transport: Transport) -> Iterator[BlockClient]:
    try:
        client = BlockClient(
            setup.target,
            party.token,
            tls=setup.tls,
            timeout_s=setup.timeout_s,
            bulk=transport.bulk,
            same_host=transport.same_host,
        )
    except OSError as error:  # a TLS file that cannot be read
        raise AuditError(f"cannot read a TLS file: {error}; check --tls-ca") from None
    try:
        yield client
    finally:
        client.close()


def _preflight(setup: Setup, attacker: BlockClient, victim: BlockClient, model: str) -> None:
    """Both tokens work for their tenants, and the attacker's does not for the
    victim's (else there is no isolation to audit: a usage error)."""
    probe = [os.urandom(DIGEST_BYTES)]
    for client, party in ((attacker, setup.attacker), (victim, setup.victim)):
        try:
            client.lookup(party.tenant, model, probe)
        except KvshareError as error:
            raise _explain(error, setup, party, f"checking {party.flag}") from None
    try:
        attacker.lookup(setup.victim.tenant, model, probe)
    except PermissionDenied:
        return
    except KvshareError as error:
        raise _explain(error, setup, setup.attacker, "checking isolation") from None
    raise AuditError(
        f"the principal of {setup.attacker.flag} may read tenant {setup.victim.tenant!r}: "
        "there is no isolation between them to audit; give an attacker token whose "
        "principal does not list the victim tenant"
    )


def _plant(
    setup: Setup, client: BlockClient, party: Party, model: str, digests: list[bytes], size: int
) -> None:
    """Store a random payload of `size` bytes under each digest, in puts of about
    PUT_BATCH_BYTES."""
    step = max(1, PUT_BATCH_BYTES // size)
    try:
        for start in range(0, len(digests), step):
            batch = digests[start : start + step]
            client.put(party.tenant, model, batch, [os.urandom(size) for _ in batch])
    except KvshareError as error:
        raise _explain(error, setup, party, f"planting blocks in {party.tenant!r}") from None


def _plant_pool(setup: Setup, client: BlockClient, party: Party, model: str, pool: Pool) -> None:
    _plant(setup, client, party, model, pool.blocks, BLOCK_BYTES)
    _plant(setup, client, party, model, pool.runs, RUN_BLOCK_BYTES)


def _cleanup(client: BlockClient, tenant: str, model: str, digests: list[bytes]) -> str:
    """Delete planted blocks; what happened, in words (never an exception)."""
    step = LOOKUP_RUN  # a call names at most [limits] max_digests_per_call (8192 by default)
    try:
        deleted = sum(
            client.delete(tenant, model, digests[start : start + step])
            for start in range(0, len(digests), step)
        )
    except KvshareError as error:
        status = getattr(error, "status", type(error).__name__)
        return f"not deleted from {tenant!r} ({status}): its principal lacks the right"
    return f"deleted {deleted} of {len(digests)} from {tenant!r}"


def _cleanup_pool(client: BlockClient, tenant: str, model: str, pool: Pool) -> str:
    return _cleanup(client, tenant, model, pool.blocks + pool.runs)


def is_local_target(target: str) -> bool:
    """Whether HOST of HOST:PORT is an address of this host (one it can bind to)."""
    host = target.rpartition(":")[0].strip("[]") or target
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        ip = ipaddress.ip_address(address[0])
        if ip.is_loopback:
            return True
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            try:
                probe.bind((address[0], 0))
            except OSError:
                continue
            return True
    return False


# -- probing ----------------------------------------------------------------------------


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
    """The attacker's arms (module docstring): cross-tenant, random miss, own hit, by
    get (and by lookup when `lookups`); and naming the victim's tenant, planted vs
    random digest."""
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
    with _client(setup, setup.attacker, transport) as client:
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


# -- the public scope -------------------------------------------------------------------


def probe_public(setup: Setup, planted: Planted, rng: random.Random, cleanup: list[str]) -> Report:
    """Can the attacker tell which published blocks the victim read? The check lives in
    kvshare.audit.public, which builds on this module (hence imported here, late)."""
    from kvshare.audit.public import audit_public

    return audit_public(setup, planted, rng, cleanup)


# -- the whole audit --------------------------------------------------------------------


@dataclass
class Audit:
    """The report of the CLI's contract (kvshare.audit.cli), and what the clean-up did."""

    report: Report
    cleanup: list[str]


def run_audit(setup: Setup, rng: random.Random | None = None) -> Audit:
    """Plant, probe every transport, probe the public scope, clean up."""
    if setup.attacker.tenant == setup.victim.tenant:
        raise AuditError(
            "--attacker-tenant and --victim-tenant are the same tenant; give two tenants"
        )
    rng = rng or random.Random(os.urandom(16))
    planted = Planted.fresh()
    cleanup: list[str] = []
    grpc_only = Transport("grpc", bulk=False, same_host=False)
    with (
        _client(setup, setup.attacker, grpc_only) as attacker,
        _client(setup, setup.victim, grpc_only) as victim,
    ):
        _preflight(setup, attacker, victim, planted.model)
        try:
            _plant_pool(setup, victim, setup.victim, planted.model, planted.victim)
            _plant_pool(setup, attacker, setup.attacker, planted.model, planted.own)
            local = is_local_target(setup.target)
            entries = {
                t.name: probe_transport(t, setup, planted, rng, local=local)
                for t in transports(tls=setup.tls is not None)
            }
            public = probe_public(setup, planted, rng, cleanup)
        finally:
            cleanup.append(
                _cleanup_pool(victim, setup.victim.tenant, planted.model, planted.victim)
            )
            cleanup.append(
                _cleanup_pool(attacker, setup.attacker.tenant, planted.model, planted.own)
            )
    return Audit(summarize(entries, public), cleanup)


def summarize(entries: dict[str, Report], public: Report) -> Report:
    """The top level: the worst transport's cross-tenant comparison, the weakest
    control, and the overall verdict (a channel anywhere, else a blind control
    anywhere, else pass)."""
    measured = [e for e in entries.values() if "skipped" not in e]
    if not measured:
        reasons = "; ".join(f"{name}: {e['skipped']}" for name, e in entries.items())
        raise AuditError(f"no transport could be audited ({reasons})")
    verdicts = [e["verdict"] for e in measured]
    if "verdict" in public:
        verdicts.append(public["verdict"])
    verdict = PASS
    if CHANNEL in verdicts:
        verdict = CHANNEL
    elif INCONCLUSIVE in verdicts:
        verdict = INCONCLUSIVE
    return {
        "cross_tenant": worst([e["cross_tenant"] for e in measured]),
        "control": weakest([e["control"] for e in measured]),
        "verdict": verdict,
        "transports": entries,
        "public": public,
    }
