"""The targets the data path is held to, read off one run's rows.

A check that could not be measured (kvshare or a peer did not run, a size was left
out) says so with `passed = None`; it never passes by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvshare.bench.config import BATCH_BLOCK_BYTES, MIB, format_size
from kvshare.bench.stats import BATCH_SUFFIX, Row

TWO_MIB = 2 * MIB
MIN_GET_RATIO_TO_REDIS = 1.0
MIN_GET_RATIO_TO_TCP = 0.5
MIN_PUT_RATIO_TO_REDIS = 1.0
# A 128k-token prompt is 512 blocks; at 5,000 blocks/s one restore stays near 0.1 s.
MIN_BATCH_BLOCKS_PER_S_PER_CLIENT = 5_000.0
# Across hosts (`--two-host`, docs/benchmarks.md): the bulk channel over TCP near the
# wire, and the secure configuration the docs recommend (TLS + sealed blocks) at least
# half of it.
MIN_TWO_HOST_GET_RATIO_TO_TCP = 0.8
MIN_TWO_HOST_SECURE_GET_RATIO_TO_TCP = 0.5
# Over one Redis Cluster (docs/scale-out.md): a cold read through a server that did not write the
# block, against redis-py's cluster client straight to the cluster; warm reads (served by
# the reading server's local tiers) faster than that.
MIN_CLUSTER_COLD_GET_RATIO = 0.5
MIN_CLUSTER_WARM_GET_RATIO = 1.0
# variant -> (the system it is compared with, what the ratio shows). TLS guards bytes
# that cross a network, so its variants run over TCP and compare with kvshare-tcp.
VARIANTS = {
    "kvshare-tcp": ("kvshare", "TCP instead of the same-host arena"),
    "kvshare-tls": ("kvshare-tcp", "cost of TLS"),
    "kvshare-sealed": ("kvshare", "cost of sealing"),
    "kvshare-tls-sealed": ("kvshare-tcp", "cost of TLS and sealing"),
    "kvshare-nosync": ("kvshare", "PUT acknowledged before fsync"),
    "kvshare-tcp-2w": ("kvshare-tcp", "two bulk-serving processes instead of one"),
    "kvshare-tcp-4w": ("kvshare-tcp", "four bulk-serving processes instead of one"),
}


@dataclass(frozen=True)
class Check:
    name: str
    clients: int
    value: float | None
    threshold: float | None
    passed: bool | None  # None: reported only, or not measured
    note: str = ""


def _find(rows: Sequence[Row], system: str, op: str, value_bytes: int, clients: int) -> Row | None:
    for row in rows:
        if (row.system, row.op, row.value_bytes, row.clients) == (system, op, value_bytes, clients):
            return row
    return None


def _ratio_check(
    rows: Sequence[Row],
    name: str,
    op: str,
    reference: str,
    threshold: float | None,
    clients: int,
    system: str = "kvshare",
) -> Check:
    row = _find(rows, system, op, TWO_MIB, clients)
    value = None if row is None else row.ratio_to.get(reference)
    if value is None:
        return Check(
            name, clients, None, threshold, None, f"not measured ({system} or {reference})"
        )
    return Check(name, clients, value, threshold, None if threshold is None else value >= threshold)


def evaluate(
    rows: Sequence[Row], client_counts: Sequence[int], *, two_host: bool = False
) -> list[Check]:
    if two_host:
        return _two_host_checks(rows, client_counts) + _reported_ratios(rows)
    checks = []
    for clients in client_counts:
        checks += [
            _ratio_check(
                rows,
                "kvshare GET 2 MiB / Redis GET",
                "get",
                "redis",
                MIN_GET_RATIO_TO_REDIS,
                clients,
            ),
            _ratio_check(
                rows, "kvshare GET 2 MiB / raw TCP", "get", "tcp", MIN_GET_RATIO_TO_TCP, clients
            ),
            _ratio_check(
                rows,
                "kvshare PUT 2 MiB / Redis SET (acknowledged)",
                "put",
                "redis",
                MIN_PUT_RATIO_TO_REDIS,
                clients,
            ),
        ]
        batch = next(
            (
                r
                for r in rows
                if r.system == "kvshare-batch"
                and r.clients == clients
                and r.value_bytes == BATCH_BLOCK_BYTES
            ),
            None,
        )
        checks.append(_batch_check(batch, "kvshare", clients))
        if any(r.system.startswith(("kvshare-cluster", "redis-cluster")) for r in rows):
            checks += _cluster_checks(rows, clients)
    checks += _reported_ratios(rows)
    return checks


def _cluster_checks(rows: Sequence[Row], clients: int) -> list[Check]:
    return [
        _ratio_check(rows, "kvshare-cluster GET 2 MiB (cold, another server's block) / "
                     "redis-cluster GET", "get", "redis-cluster", MIN_CLUSTER_COLD_GET_RATIO,
                     clients, "kvshare-cluster"),
        _ratio_check(rows, "kvshare-cluster-warm GET 2 MiB (local tier) / redis-cluster GET",
                     "get", "redis-cluster", MIN_CLUSTER_WARM_GET_RATIO, clients,
                     "kvshare-cluster-warm"),
        _ratio_check(rows, "kvshare-cluster PUT 2 MiB / redis-cluster SET (acknowledged)",
                     "put", "redis-cluster", None, clients, "kvshare-cluster"),
    ]  # fmt: skip


def _batch_check(batch: Row | None, system: str, clients: int) -> Check:
    name = f"{system} batched GET, 64 KiB blocks/s per client"
    if batch is None:
        return Check(name, clients, None, MIN_BATCH_BLOCKS_PER_S_PER_CLIENT, None, "not measured")
    value = batch.blocks_per_s_per_client
    return Check(
        name,
        clients,
        value,
        MIN_BATCH_BLOCKS_PER_S_PER_CLIENT,
        value >= MIN_BATCH_BLOCKS_PER_S_PER_CLIENT,
        f"{batch.blocks_per_call} blocks per call",
    )


def _two_host_checks(rows: Sequence[Row], client_counts: Sequence[int]) -> list[Check]:
    """Across hosts, what a replica gets: the bulk channel over TCP, and over TLS with
    sealed blocks (the configuration the docs recommend)."""
    checks = []
    for n in client_counts:
        tcp, secure = "kvshare-tcp", "kvshare-tls-sealed"
        checks += [
            _ratio_check(rows, f"{tcp} GET 2 MiB / raw TCP", "get", "tcp",
                         MIN_TWO_HOST_GET_RATIO_TO_TCP, n, tcp),
            _ratio_check(rows, f"{tcp} GET 2 MiB / Redis GET", "get", "redis",
                         MIN_GET_RATIO_TO_REDIS, n, tcp),
            _ratio_check(rows, f"{secure} GET 2 MiB / raw TCP", "get", "tcp",
                         MIN_TWO_HOST_SECURE_GET_RATIO_TO_TCP, n, secure),
            _ratio_check(rows, f"{tcp} PUT 2 MiB / raw TCP (acknowledged)", "put", "tcp",
                         None, n, tcp),
            _ratio_check(rows, f"{tcp} PUT 2 MiB / Redis SET (acknowledged)", "put", "redis",
                         None, n, tcp),
            _ratio_check(rows, f"{secure} PUT 2 MiB / raw TCP (acknowledged)", "put", "tcp",
                         None, n, secure),
        ]  # fmt: skip
        batch = next(
            (r for r in rows if r.system == f"{tcp}-batch" and r.clients == n),
            None,
        )
        checks.append(_batch_check(batch, tcp, n))
    return checks


def _reported_ratios(rows: Sequence[Row]) -> list[Check]:
    """Ratios with no target: the cost of security, and kvshare against LMCache's server."""
    reported = []
    for row in rows:
        family = row.system.removesuffix(BATCH_SUFFIX)
        reference, note = VARIANTS.get(family, ("", ""))
        if reference in row.ratio_to:
            base = reference + row.system.removeprefix(family)
            reported.append(
                Check(
                    f"{row.system} / {base} {row.op.upper()} {format_size(row.value_bytes)}",
                    row.clients,
                    row.ratio_to[reference],
                    None,
                    None,
                    note,
                )
            )
        peers = {"kvshare": "redis-unix", "kvshare-tcp": "redis"}  # each transport's peer
        if row.system in peers and row.value_bytes == TWO_MIB and peers[row.system] in row.ratio_to:
            reported.append(
                Check(
                    f"{row.system} / {peers[row.system]} {row.op.upper()} 2 MiB",
                    row.clients,
                    row.ratio_to[peers[row.system]],
                    None,
                    None,
                    "same host: kvshare's arena, Redis over a Unix socket"
                    if row.system == "kvshare"
                    else "both over loopback TCP, as across hosts",
                )
            )
        if row.system in ("kvshare", "kvshare-batch") and "lmcache" in row.ratio_to:
            reported.append(
                Check(
                    f"{row.system} / lmcache {row.op.upper()} {format_size(row.value_bytes)}",
                    row.clients,
                    row.ratio_to["lmcache"],
                    None,
                    None,
                    "lmcache PUT acknowledged by an EXIST round trip" if row.op == "put" else "",
                )
            )
    return reported
