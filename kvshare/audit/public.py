"""The timing audit's public-scope check: can one tenant tell, by timing, which
published blocks another tenant read?

The scope is shared on purpose, so what must not leak is its use: a read must leave
nothing another reader can time (a promoted copy, a warmer page cache, a moved place in
an eviction order). The check measures published blocks as the deployment holds them:

- through every server given (`--target`, and `--also-target` for the other servers of
  a Redis Cluster deployment, where a block published through one server is read
  through the others from the cluster);
- after other puts have moved them out of the put journal (`--public-settle-bytes`:
  a long-running server's journal reclaims its records);
- with the data file's cold pages evicted before each trial (`--evict-page-cache`, on
  the server's host: what memory pressure does to pages nobody read lately).

Each trial takes a published block X nobody read before; at random the victim reads
X through the server or does nothing, and after a pause (room for whatever a read
sets off on the server's threads) the attacker's `get` of X through the same server
is timed: `public` compares the two arms. Two more arms, timed the same way in the
same random order, are the positive control: the attacker's `get` of a published block
of CONTROL_BLOCK_BYTES and of a digest nobody published.
`control` compares them: a difference the harness must see (in either direction: on a
clustered server a miss asks the cluster too) or the check cannot vouch for a pass.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import random
import time
from collections.abc import Sequence
from pathlib import Path

from kvcommon.errors import KvshareError
from kvshare.audit.parties import delete_planted, open_client, plant
from kvshare.audit.probing import WARMUP_CALLS
from kvshare.audit.setup import (
    PUBLIC_BLOCK_BYTES,
    PUBLIC_TENANT,
    AuditError,
    Party,
    Planted,
    Setup,
    Transport,
    random_digests,
)
from kvshare.audit.verdicts import (
    CHANNEL,
    CONTROL_AUC,
    INCONCLUSIVE,
    PASS,
    Comparison,
    Report,
    compare,
    leaks,
    worst,
)
from replica_agent.client import BlockClient

PAUSE_S = 0.02  # between the victim's read (or none) and the attacker's probe
SETTLE_BLOCK_BYTES = 1 << 20  # the settling puts' blocks
SETTLE_WAIT_S = 1.0  # a pause after publishing: the server's writer drains meanwhile
REACH_TIMEOUT_S = 60.0  # for published blocks to reach the other servers
ARMS = ("read", "none", "hit", "miss")
# The control's hits: published blocks of CONTROL_BLOCK_BYTES, cycled. On a clustered
# server a miss costs a round trip to the cluster too (and a block it does not hold,
# another), and a hit must still stand apart from it.
CONTROL_BLOCKS = 2
CONTROL_BLOCK_BYTES = 4 << 20
GRPC = Transport("grpc", bulk=False, same_host=False)
# The attacker times over the bulk channel where it can: its calls vary the least (the
# same-host arena is for clients on the server's host only).
BULK = Transport("bulk-tcp", bulk=True, same_host=False)


def control_separates(c: Comparison) -> bool:
    """Hits and misses told apart, either way round (|auc - 0.5| as the transports'
    control asks of its one direction)."""
    return bool(abs(c["auc"] - 0.5) >= CONTROL_AUC - 0.5)


def public_report(samples: dict[str, list[int]], misses: int) -> Report:
    """One server's entry: `public` (after a victim read vs after none), `control`
    (hits of a published CONTROL_BLOCK_BYTES block vs misses), the verdict and its reasons,
    median times."""
    public = compare(samples["read"], samples["none"])
    control = compare(samples["hit"], samples["miss"])
    reasons: list[str] = []
    if leaks(public):
        reasons.append("a published block times differently after another tenant read it")
    verdict = CHANNEL if reasons else PASS
    if verdict == PASS and not control_separates(control):
        reasons.append(
            f"the control (published hits vs misses) did not separate (auc "
            f"{control['auc']:.3f}, needs |auc - 0.5| >= {CONTROL_AUC - 0.5:.1f}): too noisy "
            "to vouch"
        )
        verdict = INCONCLUSIVE
    if misses:
        reasons.append(f"{misses} published block(s) missing (the scope's quota evicted them?)")
        verdict = INCONCLUSIVE if verdict == PASS else verdict
    return {
        "public": public,
        "control": control,
        "verdict": verdict,
        "reasons": reasons,
        "median_us": {arm: _median(values) / 1000 for arm, values in samples.items()},
    }


def summarize_public(servers: dict[str, Report], held: Report) -> Report:
    """The `public` entry: the most telling server's comparison at the top (`auc`,
    `ks_p`, `probes`, as before), the weakest control, each server's entry, and how
    the published blocks were held."""
    verdicts = [entry["verdict"] for entry in servers.values()]
    verdict = PASS
    if CHANNEL in verdicts:
        verdict = CHANNEL
    elif INCONCLUSIVE in verdicts:
        verdict = INCONCLUSIVE
    top = worst([entry["public"] for entry in servers.values()])
    return {
        **top,
        "verdict": verdict,
        "transport": "/".join(sorted({e.get("transport", GRPC.name) for e in servers.values()})),
        "control": weakest_either_way([entry["control"] for entry in servers.values()]),
        "servers": servers,
        "held": held,
    }


def weakest_either_way(comparisons: Sequence[Comparison]) -> Comparison:
    """The control closest to telling nothing (auc 0.5)."""
    return min(comparisons, key=lambda c: abs(c["auc"] - 0.5))


def check_evict_files(paths: Sequence[Path]) -> None:
    """AuditError unless each of `paths` is a file this process can open."""
    for path in paths:
        if not path.is_file() or not os.access(path, os.R_OK):
            raise AuditError(
                f"--evict-page-cache {path} is not a readable file; give a server's LMDB "
                "data file (DATA_DIR/lmdb/data.mdb) on this host, as the server's user"
            )


def evict_page_cache(paths: Sequence[Path]) -> None:
    """Write back, then drop from the page cache, the pages of `paths` that no process
    has mapped: what memory pressure reclaims first (pages a server read lately stay
    mapped, and cached). Files of the server's host only."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)  # dirty pages are not dropped
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def audit_public(setup: Setup, planted: Planted, rng: random.Random, cleanup: list[str]) -> Report:
    """The check of the module docstring; `cleanup` gets what deleting its blocks did."""
    if setup.publisher_token is None:
        return {"skipped": "no --publisher-token-file"}
    check_evict_files(setup.evict_files)
    publisher = Party(PUBLIC_TENANT, setup.publisher_token, "--publisher-token-file")
    addresses = [setup.target, *setup.also_targets]
    per_server = 2 * setup.probes + WARMUP_CALLS
    probed = random_digests(per_server * len(addresses))
    controls = random_digests(CONTROL_BLOCKS)
    planted.public = probed + controls
    with open_client(setup, publisher, GRPC) as pub:
        try:
            try:
                plant(setup, pub, publisher, planted.model, probed, PUBLIC_BLOCK_BYTES)
                plant(setup, pub, publisher, planted.model, controls, CONTROL_BLOCK_BYTES)
                _wait_until_reached(setup, publisher, addresses, planted)
                settled = _settle(setup, planted, cleanup)
                # Requests pause: the server's writer moves the published blocks out of
                # the put journal into LMDB, as it does soon after any publication.
                time.sleep(SETTLE_WAIT_S)
                servers = {
                    address: _probe_server(
                        setup,
                        address,
                        planted,
                        probed[i * per_server : (i + 1) * per_server],
                        controls,
                        rng,
                    )
                    for i, address in enumerate(addresses)
                }
            except KvshareError as error:
                return {"skipped": _why_skipped(error)}
        finally:
            cleanup.append(delete_planted(pub, PUBLIC_TENANT, planted.model, planted.public))
    held = {
        "settle_bytes": settled,
        "page_cache": "evicted before each trial" if setup.evict_files else "left as it was",
        "servers": len(addresses),
    }
    return summarize_public(servers, held)


def _why_skipped(error: KvshareError) -> str:
    status = getattr(error, "status", type(error).__name__)
    if status == "RESOURCE_EXHAUSTED":
        return (
            f"no room for the check's blocks ({status}): it publishes (2 x probes + 50) x "
            f"{PUBLIC_BLOCK_BYTES >> 10} KiB per server plus {CONTROL_BLOCKS} x "
            f"{CONTROL_BLOCK_BYTES >> 20} MiB, and --public-settle-bytes in the attacker's "
            "tenant; raise [public] quota_bytes or the tenant's quota, or give fewer --probes"
        )
    return (
        f"the public check failed ({status}): the attacker's and the victim's tenants both "
        "need read_public = true"
    )


def _wait_until_reached(
    setup: Setup, publisher: Party, addresses: list[str], planted: Planted
) -> None:
    """Every server lists every published block (the cluster's writes are behind the
    publishing server's acknowledgement). The publisher asks: its lookups are no
    tenant's use."""
    for address in addresses[1:]:
        other = dataclasses.replace(setup, target=address)
        with open_client(other, publisher, GRPC) as client:
            deadline = time.monotonic() + REACH_TIMEOUT_S
            while not _lists_all(client, planted):
                if time.monotonic() > deadline:
                    raise AuditError(
                        f"blocks published through {setup.target} did not reach {address} in "
                        f"{REACH_TIMEOUT_S:.0f} s: give --also-target only for servers of the "
                        "same deployment (one Redis Cluster)"
                    )
                time.sleep(0.2)


def _lists_all(client: BlockClient, planted: Planted) -> bool:
    step = 1024
    for start in range(0, len(planted.public), step):
        run = planted.public[start : start + step]
        if client.lookup(PUBLIC_TENANT, planted.model, run) != len(run):
            return False
    return True


def _settle(setup: Setup, planted: Planted, cleanup: list[str]) -> int:
    """Put `public_settle_bytes` of the attacker's own blocks through the target, so
    the put journal reclaims the published blocks' records as a long-running server's
    does; deleted again at once. Returns the bytes put."""
    count = -(-setup.public_settle_bytes // SETTLE_BLOCK_BYTES)
    if not count:
        return 0
    digests = random_digests(count)
    with open_client(setup, setup.attacker, GRPC) as attacker:
        try:
            for digest in digests:
                attacker.put(
                    setup.attacker.tenant, planted.model, [digest], [os.urandom(SETTLE_BLOCK_BYTES)]
                )
        finally:
            cleanup.append(delete_planted(attacker, setup.attacker.tenant, planted.model, digests))
    return count * SETTLE_BLOCK_BYTES


def _probe_server(
    setup: Setup,
    address: str,
    planted: Planted,
    published: list[bytes],
    controls: list[bytes],
    rng: random.Random,
) -> Report:
    here = dataclasses.replace(setup, target=address)
    with (
        open_client(here, setup.victim, GRPC) as victim,
        open_client(here, setup.attacker, BULK) as attacker,
    ):
        samples, misses = _time_trials(
            setup, victim, attacker, planted.model, (published, controls), rng
        )
        fell_back = attacker.transport_stats.bulk_fallbacks
    report = public_report(samples, misses)
    report["transport"] = GRPC.name if fell_back else BULK.name
    return report


def _time_trials(
    setup: Setup,
    victim: BlockClient,
    attacker: BlockClient,
    model: str,
    blocks: tuple[list[bytes], list[bytes]],
    rng: random.Random,
) -> tuple[dict[str, list[int]], int]:
    """Attacker timings per arm (`setup.probes` each, random order, after WARMUP_CALLS
    discarded trials), and how many published blocks were not found. `blocks`: the
    published blocks nobody read yet (one per read or none trial, the warm-up's too),
    and the control's."""
    published, controls = blocks
    arms = [arm for arm in ARMS for _ in range(setup.probes)]
    rng.shuffle(arms)
    warmup = [rng.choice(ARMS[:2]) for _ in range(WARMUP_CALLS)]
    samples: dict[str, list[int]] = {arm: [] for arm in ARMS}
    fresh = iter(published)
    misses = 0
    gc.collect()
    gc.disable()
    try:
        for i, arm in enumerate(warmup + arms):
            if arm == "hit":
                digest = controls[i % len(controls)]
            else:
                digest = os.urandom(32) if arm == "miss" else next(fresh)
            evict_page_cache(setup.evict_files)
            if arm == "read":
                misses += len(victim.get(PUBLIC_TENANT, model, [digest])) != 1
            time.sleep(PAUSE_S)
            start = time.perf_counter_ns()
            found = attacker.get(PUBLIC_TENANT, model, [digest])
            elapsed = time.perf_counter_ns() - start
            misses += arm != "miss" and len(found) != 1
            if i >= WARMUP_CALLS:
                samples[arm].append(elapsed)
    finally:
        gc.enable()
    return samples, misses


def _median(values: Sequence[int]) -> float:
    ordered = sorted(values)
    if not ordered:
        return 0.0
    mid = len(ordered) // 2
    return float(ordered[mid]) if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
