"""`kvshare stats`: per-tenant usage, hit rate and bytes, from the server's Stats RPC.

    kvshare stats                                   # dev mode: ./kvshare-data/dev.token
    kvshare stats --address HOST:PORT --token-file FILE [--tls-ca PEM ...] [--json]

The server answers only for the tenants the caller's principal may see (and adds the
tiers and integrity failures for principals with `admin`), so this shows exactly that.
Hit rate is the share of digests asked by lookups that were present.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from kvshare.client_options import add_address_argument, add_tls_arguments, client_tls

DEFAULT_TOKEN_FILE = Path("kvshare-data") / "dev.token"
COLUMNS = (
    ("tenant", "tenant"),
    ("blocks", "blocks"),
    ("bytes", "bytes"),
    ("quota", "quota_bytes"),
    ("lookups", "lookups"),
    ("hit rate", "hit_rate"),
    ("served", "blocks_served"),
    ("served bytes", "bytes_served"),
    ("stored", "blocks_stored"),
    ("stored bytes", "bytes_stored"),
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_address_argument(parser)
    token = parser.add_mutually_exclusive_group()
    token.add_argument(
        "--token-file",
        type=Path,
        default=DEFAULT_TOKEN_FILE,
        metavar="FILE",
        help=f"file holding the bearer token (default ./{DEFAULT_TOKEN_FILE}, dev mode)",
    )
    token.add_argument(
        "--token",
        metavar="TOKEN",
        help="bearer token, as --token=TOKEN (visible in the process list: prefer a file)",
    )
    add_tls_arguments(parser, timeout_s=10.0)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from kvcommon.errors import KvshareError
    from replica_agent.client import BlockClient

    try:
        token = args.token if args.token is not None else _read_token(args.token_file)
    except OSError as error:
        print(
            f"kvshare stats: error: cannot read token file {args.token_file}: {error.strerror}; "
            "give --token-file (or run beside a dev-mode server's data dir)",
            file=sys.stderr,
        )
        return 2
    try:
        with BlockClient(
            args.address, token, tls=client_tls(args), timeout_s=args.timeout_s, bulk=False
        ) as client:
            report = to_report(client.stats())
    except KvshareError as error:
        print(f"kvshare stats: error: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _read_token(path: Path) -> str:
    return path.read_text(encoding="utf-8").strip()


def to_report(stats: Any) -> dict[str, Any]:
    """The StatsResponse as plain data, with each tenant's hit rate."""
    tenants = []
    for t in stats.tenants:
        tenants.append(
            {
                "tenant": t.tenant,
                "blocks": t.blocks,
                "bytes": t.bytes,
                "quota_bytes": t.quota_bytes,
                "lookups": t.lookups,
                "lookup_digests": t.lookup_digests,
                "lookup_hits": t.lookup_hits,
                "hit_rate": t.lookup_hits / t.lookup_digests if t.lookup_digests else None,
                "blocks_served": t.blocks_served,
                "bytes_served": t.bytes_served,
                "blocks_stored": t.blocks_stored,
                "bytes_stored": t.bytes_stored,
            }
        )
    report: dict[str, Any] = {"tenants": tenants}
    if stats.tiers:  # only principals with `admin` get these
        report["tiers"] = [
            {"name": t.name, "blocks": t.blocks, "bytes": t.bytes, "budget_bytes": t.budget_bytes}
            for t in stats.tiers
        ]
        report["integrity_failures"] = stats.integrity_failures
    return report


def format_report(report: dict[str, Any]) -> str:
    rows = [[_cell(key, tenant[key]) for _, key in COLUMNS] for tenant in report["tenants"]]
    lines = _table([title for title, _ in COLUMNS], rows) if rows else ["(no tenants visible)"]
    if "tiers" in report:
        tier_rows = [
            [t["name"], str(t["blocks"]), _size(t["bytes"]), _size(t["budget_bytes"])]
            for t in report["tiers"]
        ]
        lines += ["", *_table(["tier", "blocks", "bytes", "budget"], tier_rows)]
        lines.append(f"integrity failures: {report['integrity_failures']}")
    return "\n".join(lines)


def _cell(key: str, value: Any) -> str:
    if key == "hit_rate":
        return "-" if value is None else f"{value:.1%}"
    if key == "quota_bytes":
        return _size(value) if value else "-"
    if key.startswith("bytes") or key == "bytes":
        return _size(value)
    return str(value)


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    first = [
        header[0].ljust(widths[0]),
        *(h.rjust(w) for h, w in zip(header[1:], widths[1:], strict=True)),
    ]
    out = ["  ".join(first)]
    for row in rows:
        cells = [
            row[0].ljust(widths[0]),
            *(c.rjust(w) for c, w in zip(row[1:], widths[1:], strict=True)),
        ]
        out.append("  ".join(cells))
    return out


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit("run: kvshare stats")
