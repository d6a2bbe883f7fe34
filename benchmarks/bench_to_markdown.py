"""Turn `kvshare bench --json` documents into the tables of docs/benchmarks.md.

    kvshare bench --json > run.json && python benchmarks/bench_to_markdown.py run.json
    python benchmarks/bench_to_markdown.py two-host.json loopback.json   # both, headed

Every figure in the doc's results section comes from one run through this script, so
the doc can be regenerated rather than edited by hand.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

SIZES = {65536: "64 KiB", 524288: "512 KiB", 2097152: "2 MiB", 8388608: "8 MiB"}


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    lines = [
        "| " + " | ".join(header) + " |",
        "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def cell(row: dict[str, Any] | None, ratio: str = "tcp") -> str:
    if row is None:
        return "-"
    value = row.get(f"ratio_to_{ratio}")
    suffix = f" ({value:.2f})" if value is not None else ""
    return f"{row['mb_per_s']:,.0f}{suffix}"


def throughput_tables(results: list[dict[str, Any]]) -> str:
    out = []
    systems = list(
        dict.fromkeys(r["system"] for r in results if not r["system"].endswith("-batch"))
    )
    sizes = sorted({r["value_bytes"] for r in results if r["blocks_per_call"] == 1})
    for op in ("get", "put"):
        for clients in sorted({r["clients"] for r in results}):
            index = {
                (r["system"], r["value_bytes"]): r
                for r in results
                if r["op"] == op and r["clients"] == clients and r["blocks_per_call"] == 1
            }
            rows = [
                [s] + [cell(index.get((s, size))) for size in sizes]
                for s in systems
                if any((s, size) in index for size in sizes)
            ]
            title = f"{op.upper()}{' (acknowledged)' if op == 'put' else ''}, {clients} client(s)"
            out.append(
                f"{title}: MB/s (ratio to raw TCP in the same round):\n\n"
                + table(["system", *(SIZES.get(z, str(z)) for z in sizes)], rows)
            )
    return "\n\n".join(out)


def batch_table(results: list[dict[str, Any]]) -> str:
    rows = [
        [
            r["system"],
            str(r["clients"]),
            f"{r['mb_per_s']:,.0f}",
            f"{r['blocks_per_s_per_client']:,.0f}",
            f"{r['p50_ms']:.1f}",
            f"{r.get('ratio_to_tcp') or 0:.2f}",
        ]
        for r in results
        if r["blocks_per_call"] > 1 and r["op"] != "lookup"
    ]
    return table(["system", "clients", "MB/s", "blocks/s per client", "p50 ms", "x tcp"], rows)


def lookup_table(results: list[dict[str, Any]]) -> str:
    """Lookup rows: one call asking about N present blocks; calls/s, not MB/s."""
    rows = [
        [
            r["system"],
            str(r["clients"]),
            str(r["blocks_per_call"]),
            f"{r['calls_per_s']:,.0f}",
            f"{r['p50_ms']:.3f}",
            f"{r['p99_ms']:.3f}",
            f"{r.get('ratio_to_tcp') or 0:.2f}",
            server_cpu(r),
        ]
        for r in results
        if r["op"] == "lookup"
    ]
    header = ["system", "clients", "digests", "calls/s", "p50 ms", "p99 ms", "x tcp"]
    return table([*header, "server CPU us/call"], rows)


def server_cpu(row: dict[str, Any]) -> str:
    value = row.get("server_cpu_us_per_call")
    return "-" if value is None else f"{value:,.0f}"


def server_cpu_table(results: list[dict[str, Any]]) -> str:
    """Server CPU per call of each GET/PUT cell, a column per client count: where the
    server's time goes as clients are added."""
    counts = sorted({r["clients"] for r in results})
    index = {
        (r["system"], r["op"], r["value_bytes"], r["clients"]): r
        for r in results
        if r.get("server_cpu_us_per_call") is not None and r["op"] != "lookup"
    }
    cells = sorted({key[:3] for key in index}, key=lambda k: (k[1], k[2], k[0]))
    rows = [
        [system, op, SIZES.get(size, str(size))]
        + [server_cpu(index[(system, op, size, n)]) if (system, op, size, n) in index else "-"
           for n in counts]
        for system, op, size in cells
    ]  # fmt: skip
    return table(["system", "op", "size", *(f"{n} client(s)" for n in counts)], rows)


def ratio_table(results: list[dict[str, Any]], systems: list[str], reference: str) -> str:
    rows = []
    for system in systems:
        for op in ("get", "put"):
            for clients in sorted({r["clients"] for r in results}):
                cells = {
                    r["value_bytes"]: r.get(f"ratio_to_{reference}")
                    for r in results
                    if r["system"] == system and r["op"] == op and r["clients"] == clients
                }
                if cells:
                    rows.append(
                        [system, op, str(clients)]
                        + [
                            f"{cells[z]:.2f}" if cells.get(z) is not None else "-"
                            for z in sorted(SIZES)
                        ]
                    )
    return table(["system", "op", "clients", *SIZES.values()], rows)


def checks_table(checks: list[dict[str, Any]]) -> str:
    rows = [
        [
            "**pass**" if c["passed"] else ("**fail**" if c["passed"] is False else "n/a"),
            c["check"],
            str(c["clients"]),
            f"{c['value']:,.2f}" if c["value"] is not None else "-",
            str(c["threshold"]),
        ]
        for c in checks
        if c["threshold"] is not None
    ]
    return table(["", "target", "clients", "measured", "threshold"], rows)


TOPOLOGY_TITLES = {
    "two-host": "Across two hosts (servers in one network namespace, clients in another, "
    "joined by a veth pair): what a replica on another host gets",
    "loopback": "On one host (loopback)",
}


def render(doc: dict[str, Any]) -> str:
    """The tables of one run; a two-host run has no same-host rows, so fewer tables."""
    results = doc["results"]
    systems = {r["system"] for r in results}
    variants = sorted(s for s in systems if s.startswith("kvshare-") and not s.endswith("-batch"))
    parts = [
        throughput_tables(results),
        "Batched GET (one call for many 64 KiB blocks):\n\n" + batch_table(results),
    ]
    if any(r["op"] == "lookup" for r in results):
        parts.append(
            "Lookup (one call asking whether N present blocks are held; calls/s, ratio "
            "to raw TCP's EXISTS request in the same round):\n\n" + lookup_table(results)
        )
    if any(r.get("server_cpu_us_per_call") is not None for r in results):
        parts.append(
            "Server CPU time per call (user+sys of the server's threads in the timed "
            "part, over the cell's calls), us:\n\n" + server_cpu_table(results)
        )
    parts.append("Targets:\n\n" + checks_table(doc["checks"]))
    over_tcp = [v for v in variants if v.startswith(("kvshare-tls", "kvshare-grpc"))]
    same_host = [v for v in variants if v not in over_tcp]
    if "kvshare" in systems and same_host:
        parts.append(
            "Same-host variants (sealing; TCP instead of the arena): ratio to plain "
            "`kvshare` in the same round:\n\n" + ratio_table(results, same_host, "kvshare")
        )
    if over_tcp and "kvshare-tcp" in systems:
        parts.append(
            "Cost of TLS (and of the gRPC-only path) over TCP: ratio to `kvshare-tcp` in "
            "the same round:\n\n" + ratio_table(results, over_tcp, "kvshare-tcp")
        )
    peers = []
    if "redis-unix" in systems and "kvshare" in systems:
        peers.append(ratio_table(results, ["kvshare"], "redis-unix"))
    if "redis" in systems and "kvshare-tcp" in systems:
        peers.append(ratio_table(results, ["kvshare-tcp"], "redis"))
    if peers:
        parts.append(
            "Each transport against its Redis peer: `kvshare` (same-host arena) / "
            "`redis-unix`, `kvshare-tcp` / `redis` (TCP):\n\n" + "\n\n".join(peers)
        )
    if any(r.get("ratio_to_lmcache") is not None for r in results):
        mine = [s for s in ("kvshare", "kvshare-tcp", "kvshare-tls-sealed") if s in systems]
        parts.append(
            "kvshare against LMCache's server: ratio in the same round:\n\n"
            + ratio_table(results, mine, "lmcache")
        )
    parts.append(f"Settings: {json.dumps(doc['settings'])}; skipped: {doc['skipped'] or 'none'}")
    return "\n\n".join(parts)


def main() -> None:
    """Each file given (e.g. a two-host run, then a loopback run) under its own heading."""
    for path in sys.argv[1:]:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        topology = doc["settings"].get("topology", "loopback")
        if len(sys.argv) > 2:
            print(f"### {TOPOLOGY_TITLES.get(topology, topology)}\n")
        print(render(doc) + "\n")


if __name__ == "__main__":
    main()
