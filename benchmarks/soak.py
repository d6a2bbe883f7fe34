"""Soak: many client processes on one server for a while, then every block checked.

    python benchmarks/soak.py --clients 16 --seconds 600 [--json]

One `kvshare serve` (put journal on tmpfs, a small memory tier) and `--clients`
processes over four tenants: `hot0` and `hot1` have quotas a few seconds of puts
fill (eviction runs all the time), `keep0` and `keep1` have room for everything
(nothing of theirs may ever go missing). Each client runs a replica's mix: prefix
lookups then gets of a conversation it stored (most calls), new conversations of 1-8
blocks (puts), batched gets of several conversations, and occasional deletes; every
payload is derived from its digest, so any returned block can be checked.

At the end every acknowledged block of a `keep` tenant (and each client's last
HOT_WINDOW of a `hot` one) is fetched: a wrong byte is `corrupt`; a missing block of a
`keep` tenant is `lost` (a `hot` one may have been evicted); a deleted block that is
served again is `resurrected`. RSS of the server is sampled each
second. `--json` prints {"requests", "errors", "acknowledged_blocks", "lost_blocks",
"corrupt_blocks", "rss_start_bytes", "rss_end_bytes", "p50_ms", "p99_ms", ...}.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

from benchmarks.reliability.harness import (
    PrincipalSpec,
    ServerProc,
    TenantSpec,
    private_journal_dir,
    write_tenancy,
)

MODEL = "soak/model@r1;L4;B256"
BLOCK_BYTES = {"hot0": 32 << 10, "hot1": 64 << 10, "keep0": 32 << 10, "keep1": 16 << 10}
# `keep` tenants need room for all a run writes: 10 minutes on 2 cores wrote ~4 GB for
# keep0 (a run that outgrows a quota is reported as invalid, not as lost blocks).
QUOTAS = {"hot0": 4 << 20, "hot1": 6 << 20, "keep0": 12 << 30, "keep1": 12 << 30}
HOT_WINDOW = 1000  # blocks per client of a hot tenant checked at the end
STORAGE = {
    "journal_bytes": 64 << 20,
    "memory_budget_bytes": 48 << 20,
    "disk_budget_bytes": 32 << 30,
    "max_pending_write_bytes": 128 << 20,
}


def payload(digest: bytes, size: int) -> bytes:
    return hashlib.shake_256(digest).digest(size)


# -- one client process ---------------------------------------------------------------


def worker(index: int, address: str, token: str, tenant: str, seconds: float, out: Path) -> None:
    from replica_agent.client import BlockClient

    rng = random.Random(index)
    size = BLOCK_BYTES[tenant]
    chains: list[list[bytes]] = []
    acked: list[bytes] = []
    deleted: list[bytes] = []
    latencies: list[float] = []
    requests = errors = 0
    kinds: dict[str, int] = {}
    deadline = time.monotonic() + seconds
    client = BlockClient(address, token, bulk=index % 4 != 3, timeout_s=30)
    while time.monotonic() < deadline:
        op = rng.random()
        started = time.perf_counter()
        try:
            if op < 0.3 or not chains:  # a new conversation: put its blocks
                chain = [os.urandom(32) for _ in range(rng.randint(1, 8))]
                client.put(tenant, MODEL, chain, [payload(d, size) for d in chain])
                chains.append(chain)
                acked += chain
            elif op < 0.8:  # a follow-up: how much of the prefix is there, then get it
                chain = rng.choice(chains)
                present = client.lookup(tenant, MODEL, chain)
                got = client.get(tenant, MODEL, chain[:present])
                requests += 1
                if any(block != payload(d, size) for d, block in zip(chain, got, strict=False)):
                    errors += 1  # a wrong block served: the final check counts it too
                    kinds["wrong bytes"] = kinds.get("wrong bytes", 0) + 1
            elif op < 0.95:  # batched gets of several conversations
                for chain in rng.sample(chains, min(len(chains), 4)):
                    client.get(tenant, MODEL, chain)
            else:  # an occasional delete of a whole conversation
                chain = chains.pop(rng.randrange(len(chains)))
                client.delete(tenant, MODEL, chain)
                deleted += chain
        except Exception as error:  # counted, by kind; the soak goes on
            errors += 1
            code = getattr(error, "code", None)
            kind = code().name if callable(code) else type(error).__name__
            kinds[kind] = kinds.get(kind, 0) + 1
        requests += 1
        latencies.append((time.perf_counter() - started) * 1000)
    client.close()
    gone = set(deleted)
    out.write_text(
        json.dumps(
            {
                "tenant": tenant,
                "requests": requests,
                "errors": errors,
                "error_kinds": kinds,
                "acked": [d.hex() for d in acked if d not in gone],
                "deleted": [d.hex() for d in deleted],
                "latencies_ms": latencies,
            }
        )
    )


# -- the campaign ---------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--worker", metavar="JSON", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:  # one JSON argument: a token may start with "-"
        w = json.loads(args.worker)
        worker(w["index"], w["address"], w["token"], w["tenant"], w["seconds"], Path(w["out"]))
        return 0
    report = soak(args.clients, args.seconds)
    print(json.dumps(report) if args.json else "\n".join(f"{k}: {v}" for k, v in report.items()))
    return 0


def soak(clients: int, seconds: float) -> dict[str, Any]:
    tenants = list(QUOTAS)
    principals = [PrincipalSpec(f"p-{t}", (t,), ("read", "write")) for t in tenants]
    principals.append(PrincipalSpec("root", tuple(tenants), ("read", "admin")))
    with tempfile.TemporaryDirectory(prefix="kvshare-soak-") as tmp, private_journal_dir() as jd:
        work = Path(tmp)
        tenancy = write_tenancy(
            work,
            [TenantSpec(t, q) for t, q in QUOTAS.items()],
            principals,
            storage={**STORAGE, "journal_dir": str(jd)},
        )
        server = ServerProc(tenancy.path, work / "server.log")
        try:
            rss = [server.rss_bytes()]
            owned = [server.owned_rss_bytes()]
            procs = []
            for i in range(clients):
                tenant = tenants[i % len(tenants)]
                spec = {
                    "index": i,
                    "address": server.address,
                    "token": tenancy.tokens[f"p-{tenant}"],
                    "tenant": tenant,
                    "seconds": seconds,
                    "out": str(work / f"client{i}.json"),
                }
                procs.append(
                    subprocess.Popen(
                        [sys.executable, __file__, f"--worker={json.dumps(spec)}"],
                        stdin=subprocess.DEVNULL,
                        stderr=open(work / f"client{i}.log", "wb"),  # noqa: SIM115
                    )
                )
            while any(p.poll() is None for p in procs):
                time.sleep(1)
                rss.append(server.rss_bytes())
                owned.append(server.owned_rss_bytes())
            results = [_load(work / f"client{i}.json") for i in range(clients)]
            # A client process that died: its last log line says why (counted once).
            failures = [
                f"client {i} exited {p.returncode}: {_last_line(work / f'client{i}.log')}"
                for i, p in enumerate(procs)
                if p.returncode != 0
            ]
            verdict = verify(server.address, tenancy.tokens["root"], results)
            failures += outgrown(results)
            rss.append(server.rss_bytes())
            owned.append(server.owned_rss_bytes())
            alive = server.alive()
        finally:
            with contextlib.suppress(RuntimeError):
                server.terminate(timeout_s=60)
    latencies = sorted(x for r in results for x in r.get("latencies_ms", []))
    half = owned[len(owned) // 2 :]
    return {
        "requests": sum(r.get("requests", 0) for r in results),
        "errors": sum(r.get("errors", 0) for r in results) + len(failures) + (not alive),
        "acknowledged_blocks": verdict["acknowledged"],
        "lost_blocks": verdict["lost"],
        "corrupt_blocks": verdict["corrupt"],
        # The server's memory of its own (anonymous + shared memory): what the budget
        # bounds. VmRSS also counts LMDB's file pages in the page cache (rss_*_vm_bytes).
        "rss_start_bytes": owned[0],
        "rss_end_bytes": owned[-1],
        "p50_ms": round(statistics.median(latencies), 3) if latencies else None,
        "p99_ms": round(latencies[int(len(latencies) * 0.99)], 3) if latencies else None,
        "rss_max_bytes": max(owned),
        # What the configuration lets the server hold beyond its start: the memory tier,
        # the journal (mapped tmpfs), the write backlog and a 64 MiB arena per same-host
        # client.
        "rss_budget_bytes": owned[0]
        + STORAGE["memory_budget_bytes"]
        + STORAGE["journal_bytes"]
        + STORAGE["max_pending_write_bytes"]
        + sum(1 for i in range(clients) if i % 4 != 3) * (64 << 20),
        "rss_last_half_growth_bytes": (half[-1] - min(half)) if half else 0,
        "rss_start_vm_bytes": rss[0],
        "rss_max_vm_bytes": max(rss),
        "evicted_blocks": verdict["evicted"],
        "resurrected_blocks": verdict["resurrected"],
        "error_kinds": _merge(r.get("error_kinds", {}) for r in results),
        "client_failures": failures + ([] if alive else ["the server died"]),
        "clients": clients,
        "seconds": seconds,
    }


def outgrown(results: list[dict[str, Any]]) -> list[str]:
    """A `keep` tenant whose acknowledged bytes passed its quota: its missing blocks
    may have been evicted, so the run cannot tell loss from eviction (invalid run)."""
    acked: dict[str, int] = {}
    for result in results:
        tenant = result.get("tenant")
        if tenant is not None and not tenant.startswith("hot"):
            acked[tenant] = acked.get(tenant, 0) + len(result["acked"]) * BLOCK_BYTES[tenant]
    return [
        f"tenant {tenant} acknowledged {n} bytes, more than its quota {QUOTAS[tenant]}: "
        "raise QUOTAS for a run this long"
        for tenant, n in acked.items()
        if n > QUOTAS[tenant]
    ]


def _merge(dicts: object) -> dict[str, int]:
    merged: dict[str, int] = {}
    for d in dicts:  # type: ignore[attr-defined]
        for key, count in d.items():
            merged[key] = merged.get(key, 0) + count
    return merged


def _load(path: Path) -> dict[str, Any]:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return {}  # the client died: counted from its exit status


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:200] if lines else ""


def verify(address: str, token: str, results: list[dict[str, Any]]) -> dict[str, int]:
    """Fetch acknowledged blocks (and deleted ones) and compare. A `keep` tenant's are
    all checked; of a `hot` tenant's, each client's last HOT_WINDOW (a hot tenant holds
    far fewer: its quota), the older ones being evicted long since."""
    from replica_agent.client import BlockClient

    counts = {"acknowledged": 0, "lost": 0, "corrupt": 0, "evicted": 0, "resurrected": 0}
    with BlockClient(address, token) as client:
        for result in results:
            tenant = result.get("tenant")
            if tenant is None:
                continue
            acked = [bytes.fromhex(h) for h in result["acked"]]
            counts["acknowledged"] += len(acked)
            hot = tenant.startswith("hot")
            if hot:
                counts["evicted"] += max(0, len(acked) - HOT_WINDOW)
                acked = acked[-HOT_WINDOW:]
            missing, corrupt = _check(client, tenant, acked)
            counts["evicted" if hot else "lost"] += missing
            counts["corrupt"] += corrupt
            for hexed in result["deleted"]:
                if client.get(tenant, MODEL, [bytes.fromhex(hexed)]):
                    counts["resurrected"] += 1
    return counts


def _check(client: object, tenant: str, digests: list[bytes]) -> tuple[int, int]:
    """(missing, corrupt) among `digests`: batched gets, resumed after each miss."""
    size = BLOCK_BYTES[tenant]
    missing = corrupt = 0
    at = 0
    while at < len(digests):
        batch = digests[at : at + 256]
        got = client.get(tenant, MODEL, batch)  # type: ignore[attr-defined]
        corrupt += sum(1 for d, b in zip(batch, got, strict=False) if b != payload(d, size))
        at += len(got)
        if len(got) < len(batch):
            missing += 1  # the first miss; the batch goes on after it
            at += 1
    return missing, corrupt


if __name__ == "__main__":
    raise SystemExit(main())
