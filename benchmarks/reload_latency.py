"""What a live config reload costs the tenants it does not change: GET latency with
reloads against without.

    python benchmarks/reload_latency.py [--clients 4] [--seconds 10] [--reload-every-ms 250]
        [--block-bytes 65536] [--json]

One `kvshare serve --config` (a child process) with four tenants that keep their
config, one client thread each over the transport `--transport` picks, GETting blocks
they stored before the run. Two phases of `--seconds` each, alternating twice (quiet,
reloading, quiet, reloading) so a drift of the machine shows in both: in the reloading
phases an admin reloads the config every `--reload-every-ms` (`kvshare admin reload`'s
RPC), each time adding a tenant with a principal and removing the previous ones (a
removed tenant's blocks are deleted behind the reload). `--json` prints
{"quiet": {...}, "reloading": {...}, "reloads", "reload_ms_p50", "reload_ms_p99",
"p99_ratio"}, each phase with "gets", "p50_ms", "p99_ms", "max_ms", "errors".
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

from benchmarks.reliability.harness import PrincipalSpec, ServerProc, TenantSpec, write_tenancy
from kvshare.reload_cli import request_reload
from replica_agent.client import BlockClient

MODEL = "reload-bench/model@r1;L4;B256"
TENANTS = ("t0", "t1", "t2", "t3")
BLOCKS_PER_GET = 4
STORED_BLOCKS = 64
TRANSPORTS = {"grpc": {"bulk": False}, "bulk-tcp": {"same_host": False}, "same-host": {}}


def digest(tenant: str, index: int) -> bytes:
    return hashlib.sha256(f"{tenant}/{index}".encode()).digest()


def percentile_ms(samples: list[float], q: float) -> float:
    if not samples:
        return 0.0
    ordered = sorted(samples)
    return round(1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)


class Reader:
    """One tenant's client: GETs of stored blocks, timed, tagged with the phase."""

    def __init__(self, address: str, token: str, tenant: str, options: dict[str, bool]) -> None:
        self.client = BlockClient(address, token, timeout_s=30, **options)  # type: ignore[arg-type]
        self.tenant = tenant
        self.samples: dict[str, list[float]] = {"quiet": [], "reloading": []}
        self.errors: dict[str, int] = {"quiet": 0, "reloading": 0}
        self.phase = "quiet"

    def run(self, stop: threading.Event) -> None:
        index = 0
        while not stop.is_set():
            start = index % (STORED_BLOCKS - BLOCKS_PER_GET)
            digests = [digest(self.tenant, start + i) for i in range(BLOCKS_PER_GET)]
            phase = self.phase
            began = time.perf_counter()
            try:
                got = self.client.get(self.tenant, MODEL, digests)
                ok = len(got) == BLOCKS_PER_GET
            except Exception:
                ok = False
            if ok:
                self.samples[phase].append(time.perf_counter() - began)
            else:
                self.errors[phase] += 1
            index += 1


def run(args: argparse.Namespace) -> dict[str, Any]:
    directory = Path(tempfile.mkdtemp(prefix="kvshare-reload-bench-"))
    stayers = [PrincipalSpec(f"r-{t}", (t,), ("read", "write")) for t in TENANTS]
    admin = PrincipalSpec("admin", TENANTS, ("read", "admin"))
    tenancy = write_tenancy(directory, [TenantSpec(t) for t in TENANTS], [*stayers, admin])
    server = ServerProc(tenancy.path, directory / "server.log")
    options = TRANSPORTS[args.transport]
    try:
        payload = bytes(range(256)) * (args.block_bytes // 256)
        readers = []
        for tenant in TENANTS[: args.clients]:
            reader = Reader(server.address, tenancy.tokens[f"r-{tenant}"], tenant, options)
            digests = [digest(tenant, i) for i in range(STORED_BLOCKS)]
            reader.client.put(tenant, MODEL, digests, [payload] * STORED_BLOCKS)
            readers.append(reader)
        stop = threading.Event()
        threads = [threading.Thread(target=r.run, args=(stop,)) for r in readers]
        for thread in threads:
            thread.start()
        reload_s: list[float] = []
        try:
            for phase in ("quiet", "reloading", "quiet", "reloading"):
                for reader in readers:
                    reader.phase = phase
                ends = time.monotonic() + args.seconds
                while time.monotonic() < ends:
                    if phase == "quiet":
                        time.sleep(0.05)
                        continue
                    reload_s.append(churn(tenancy, server.address, len(reload_s)))
                    time.sleep(args.reload_every_ms / 1000)
        finally:
            stop.set()
            for thread in threads:
                thread.join(60)
            for reader in readers:
                reader.client.close()
    finally:
        server.terminate()
    result: dict[str, Any] = {}
    for phase in ("quiet", "reloading"):
        samples = [s for r in readers for s in r.samples[phase]]
        result[phase] = {
            "gets": len(samples),
            "p50_ms": percentile_ms(samples, 0.5),
            "p99_ms": percentile_ms(samples, 0.99),
            "max_ms": percentile_ms(samples, 1.0),
            "errors": sum(r.errors[phase] for r in readers),
        }
    result["reloads"] = len(reload_s)
    result["reload_ms_p50"] = percentile_ms(reload_s, 0.5)
    result["reload_ms_p99"] = percentile_ms(reload_s, 0.99)
    quiet_p99 = result["quiet"]["p99_ms"]
    result["p99_ratio"] = round(result["reloading"]["p99_ms"] / quiet_p99, 3) if quiet_p99 else None
    result["transport"] = args.transport
    result["clients"] = len(readers)
    return result


def churn(tenancy: Any, address: str, n: int) -> float:
    """Rewrite the config with tenant `x{n}` and a principal of it (the previous ones
    gone), then reload; the reload's round trip in seconds."""
    text = tenancy.path.read_text()
    cut = text.find("\n# churn\n")
    base = text if cut < 0 else text[: cut + 1]
    token = hashlib.sha256(f"churn-{n}".encode()).hexdigest()
    extra = (
        f'# churn\n[[tenants]]\nid = "x{n}"\nquota_bytes = 0\n'
        f'[[principals]]\nname = "p{n}"\ntoken_sha256 = "{token}"\n'
        f'tenants = ["x{n}"]\nactions = ["read", "write"]\n'
    )
    tenancy.path.write_text(base + extra)
    began = time.perf_counter()
    reply = request_reload(address, tenancy.tokens["admin"])
    elapsed = time.perf_counter() - began
    if not reply.applied:
        raise SystemExit(f"reload refused: {reply.message}")
    return elapsed


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=4, choices=range(1, len(TENANTS) + 1))
    parser.add_argument("--seconds", type=float, default=10.0, help="each of the 4 phases")
    parser.add_argument("--reload-every-ms", type=float, default=250.0)
    parser.add_argument("--block-bytes", type=int, default=64 << 10)
    parser.add_argument("--transport", choices=sorted(TRANSPORTS), default="bulk-tcp")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    result = run(args)
    if args.json:
        print(json.dumps(result))
    else:
        for phase in ("quiet", "reloading"):
            figures = result[phase]
            print(
                f"{phase:9} gets {figures['gets']:7}  p50 {figures['p50_ms']:8.3f} ms  "
                f"p99 {figures['p99_ms']:8.3f} ms  max {figures['max_ms']:8.3f} ms  "
                f"errors {figures['errors']}"
            )
        print(
            f"reloads {result['reloads']}  reload p50 {result['reload_ms_p50']} ms  "
            f"p99 {result['reload_ms_p99']} ms  GET p99 ratio {result['p99_ratio']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
