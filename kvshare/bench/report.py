"""The run as a terminal table or as the JSON document of docs/design.md §8."""

from __future__ import annotations

import os
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshare.bench.checks import VARIANTS, Check
from kvshare.bench.config import BenchConfig, format_size
from kvshare.bench.placement import LOOPBACK_TOPOLOGY, TWO_HOST_TOPOLOGY
from kvshare.bench.runner import RunOutcome
from kvshare.bench.stats import (
    BATCH_SUFFIX,
    LOOKUP_OP,
    REFERENCE_SYSTEMS,
    THROUGHPUT_UNIT,
    Row,
)

NOTES = {
    "lmcache": "LMCache PUT has no reply: each PUT here waits for an EXIST on the same "
    "connection; batched GETs are pipelined single GETs (its protocol has no batch).",
    "redis": "Redis runs without persistence (--save '' --appendonly no); batched GET is MGET; "
    "lookup is EXISTS k1 ... kn.",
    "tcp": "raw TCP is the ceiling: a Python socket server, no auth, eviction or integrity; "
    "its lookup is one EXISTS request (the keys of a GET, a count back).",
    LOOKUP_OP: "lookup rows: one call asks whether N present blocks are held (kvshare: "
    "BlockClient.lookup, over the bulk channel; kvshare-grpc: the gRPC Lookup); throughput "
    "in calls/s, MB/s 0, x peer compares calls/s.",
}
LMCACHE_LOOKUP_NOTE = " Its lookup is pipelined EXISTs, one per key (no multi-key EXIST)."


def machine_description() -> dict[str, Any]:
    description: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                description["cpu_model"] = line.split(":", 1)[1].strip()
                break
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        first = meminfo.read_text(errors="replace").splitlines()[0].split()
        if first[0] == "MemTotal:":
            description["memory_gib"] = round(int(first[1]) / 1024 / 1024, 1)
    return description


def _round_or_none(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def row_to_json(row: Row, topology: str = LOOPBACK_TOPOLOGY) -> dict[str, Any]:
    document: dict[str, Any] = {
        "system": row.system,
        "topology": topology,
        "op": row.op,
        "value_bytes": row.value_bytes,
        "clients": row.clients,
        # Three decimals: a cell that ran a few slow calls is not reported as 0.0.
        "mb_per_s": round(row.mb_per_s, 3),
        "p50_ms": round(row.p50_ms, 4),
        "p99_ms": round(row.p99_ms, 4),
        "blocks_per_call": row.blocks_per_call,
        "blocks_per_s_per_client": round(row.blocks_per_s_per_client, 1),
        "calls_per_s": round(row.calls_per_s, 1),
        # What throughput_rounds and ratio_to_* measure: calls_per_s for a lookup row
        # (which moves no payload: its mb_per_s is 0), mb_per_s otherwise.
        "throughput_unit": THROUGHPUT_UNIT[row.op],
        "throughput_rounds": [round(v, 3) for v in row.throughput_rounds],
        # Server CPU (user+sys, all its threads) in the timed part per call; null where
        # the harness does not know the server's processes.
        "server_cpu_us_per_call": _round_or_none(row.server_cpu_us_per_call, 1),
        "rounds": len(row.mb_per_s_rounds),
        "mb_per_s_rounds": [round(v, 3) for v in row.mb_per_s_rounds],
    }
    for reference in REFERENCE_SYSTEMS:
        document[f"ratio_to_{reference}"] = _round_or_none(row.ratio_to.get(reference), 3)
    return document


def check_to_json(check: Check) -> dict[str, Any]:
    return {
        "check": check.name,
        "clients": check.clients,
        "value": _round_or_none(check.value, 3),
        "threshold": check.threshold,
        "passed": check.passed,
        "note": check.note,
    }


def json_document(
    config: BenchConfig, outcome: RunOutcome, rows: Sequence[Row], checks: Sequence[Check]
) -> dict[str, Any]:
    return {
        "results": [row_to_json(row, _topology(config)) for row in rows],
        "checks": [check_to_json(check) for check in checks],
        "skipped": outcome.skipped,
        "failed": outcome.failed,
        "machine": machine_description(),
        "settings": {
            "topology": _topology(config),
            "sizes": list(config.sizes),
            "clients": list(config.client_counts),
            "rounds": config.rounds,
            "seconds_per_cell": config.seconds_per_cell,
            "put_bytes_per_client": config.put_bytes_per_client,
            "batch_blocks": config.batch_blocks,
            "elapsed_s": round(outcome.elapsed_s, 1),
        },
    }


def _topology(config: BenchConfig) -> str:
    return TWO_HOST_TOPOLOGY if config.is_two_host else LOOPBACK_TOPOLOGY


def _ratio(row: Row, reference: str) -> str:
    value = row.ratio_to.get(reference)
    return "" if value is None else f"{value:.2f}"


def _render(lines: Sequence[Sequence[str]], left_aligned: int) -> str:
    """Columns padded to their widest cell; the first `left_aligned` columns flush left."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    rendered = []
    for line in lines:
        cells = [
            cell.ljust(widths[i]) if i < left_aligned else cell.rjust(widths[i])
            for i, cell in enumerate(line)
        ]
        rendered.append("  ".join(cells).rstrip())
    rendered.insert(1, "-" * len(rendered[0]))
    return "\n".join(rendered)


def format_table(rows: Sequence[Row]) -> str:
    header = (
        "system", "op", "size", "clients", "MB/s", "calls/s", "p50 ms", "p99 ms",
        "x tcp", "x redis", "x lmcache", "blocks/s/client", "srv CPU us/call",
    )  # fmt: skip
    lines = [header]
    for row in rows:
        is_lookup = row.op == LOOKUP_OP
        cpu = row.server_cpu_us_per_call
        lines.append(
            (
                row.system,
                row.op,
                f"{row.blocks_per_call} x {format_size(row.value_bytes)}"
                if is_lookup
                else format_size(row.value_bytes),
                str(row.clients),
                "" if is_lookup else f"{row.mb_per_s:,.0f}",
                f"{row.calls_per_s:,.0f}",
                f"{row.p50_ms:.3f}",
                f"{row.p99_ms:.3f}",
                _ratio(row, "tcp"),
                _ratio(row, "redis"),
                _ratio(row, "lmcache"),
                f"{row.blocks_per_s_per_client:,.0f}"
                if row.blocks_per_call > 1 and not is_lookup
                else "",
                "" if cpu is None else f"{cpu:,.0f}",
            )
        )
    return _render(lines, left_aligned=2)


def format_ratio_matrix(rows: Sequence[Row], systems: Sequence[str], reference: str) -> str:
    """Ratios of `systems` to `reference`, a line per system/op/clients, a column per size."""
    chosen = [r for r in rows if r.system in systems and reference in r.ratio_to]
    sizes = sorted({r.value_bytes for r in chosen})
    if not chosen:
        return ""
    cells: dict[tuple[str, int, int, str], dict[int, float]] = {}
    for row in chosen:
        key = (row.op, row.clients, list(systems).index(row.system), row.system)
        cells.setdefault(key, {})[row.value_bytes] = row.ratio_to[reference]
    lines = [("system", "op", "clients", *(format_size(size) for size in sizes))]
    for (op, clients, _, system), by_size in sorted(cells.items()):
        ratios = [f"{by_size[size]:.2f}" if size in by_size else "" for size in sizes]
        lines.append((system, op, str(clients), *ratios))
    return _render(lines, left_aligned=2)


def format_checks(checks: Sequence[Check]) -> str:
    lines = []
    for check in checks:
        if check.passed is None and check.value is None:
            verdict = "n/a "
        elif check.passed is None:
            verdict = "info"
        else:
            verdict = "PASS" if check.passed else "FAIL"
        value = "-" if check.value is None else f"{check.value:,.2f}"
        target = "" if check.threshold is None else f" (target >= {check.threshold:,.2f})"
        note = f"  [{check.note}]" if check.note else ""
        lines.append(f"{verdict}  {check.name}, {check.clients} client(s): {value}{target}{note}")
    return "\n".join(lines)


def format_report(
    config: BenchConfig, outcome: RunOutcome, rows: Sequence[Row], checks: Sequence[Check]
) -> str:
    machine = machine_description()
    parts = [
        f"kvshare bench: {config.rounds} round(s), {config.seconds_per_cell:g} s per cell, "
        f"{machine.get('cpus')} CPUs ({machine.get('cpu_model', 'unknown CPU')}), "
        f"Python {machine['python']}, {outcome.elapsed_s:.0f} s",
        "topology: two-host (servers and clients in two network namespaces joined by a veth pair)"
        if config.is_two_host
        else "topology: loopback (servers and clients on this host)",
        "MB/s = 10^6 bytes/s over all clients (median of rounds); x peer = median per-round ratio",
        "",
        format_table(rows) if rows else "(no results)",
    ]
    targets = [check for check in checks if check.threshold is not None]
    if targets:
        parts += ["", "Targets:", format_checks(targets)]
    for reference in ("kvshare", "kvshare-tcp"):
        variants = [
            f"{name}{suffix}"
            for name, (base, _) in VARIANTS.items()
            if base == reference
            for suffix in ("", BATCH_SUFFIX)
        ]
        matrix = format_ratio_matrix(rows, variants, reference)
        if matrix:
            title = f"kvshare variants (cost of transport and security): ratio to {reference}"
            parts += ["", f"{title}, same round", matrix]
    against_lmcache = format_ratio_matrix(rows, ["kvshare", "kvshare-batch"], "lmcache")
    if against_lmcache:
        title = "kvshare against LMCache's server: ratio in the same round"
        parts += ["", title, against_lmcache]
    families = {row.system.removesuffix("-batch").split("-")[0] for row in rows}
    notes = [NOTES[name] for name in ("tcp", "redis", "lmcache") if name in families]
    if "lmcache" in families and any(row.op == LOOKUP_OP for row in rows):
        notes[-1] += LMCACHE_LOOKUP_NOTE
    if any(row.op == LOOKUP_OP for row in rows):
        notes.append(NOTES[LOOKUP_OP])
    notes.append(
        "srv CPU us/call: the server's CPU time (user+sys, all threads) in the timed part "
        "over the cell's calls; for a PUT cell it includes writing behind earlier PUTs."
    )
    notes += [f"{name} not run: {why}" for name, why in outcome.skipped.items()]
    notes += [f"{name} FAILED: {why}" for name, why in outcome.failed.items()]
    if notes:
        parts += ["", "Notes:", *(f"- {note}" for note in notes)]
    return "\n".join(parts)
