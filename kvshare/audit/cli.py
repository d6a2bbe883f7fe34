"""`kvshare audit`: an operator's checks against a live deployment.

    kvshare audit timing --target HOST:PORT \\
        --attacker-tenant T --attacker-token-file F \\
        --victim-tenant T --victim-token-file F \\
        [--tls-ca F] [--probes N] [--publisher-token-file F] [--json] \\
        [--also-target HOST:PORT ...] [--public-settle-bytes N] [--evict-page-cache F ...]

`timing` plants random blocks in the victim's tenant and in the attacker's, then times
the attacker's probes over every transport it can use (kvshare.audit.timing): does a
digest the victim stored time, for the attacker, like any miss? Exit 0: no channel
found and the control separates; 1: a channel, or a control too noisy to vouch; 2: a
usage or connection error (the message says what to change). Never prints a token, a
digest or a payload.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

MIN_PROBES = 20


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="audit_command", metavar="CHECK", required=True)
    timing = sub.add_parser(
        "timing",
        help="can one tenant tell by timing what another has cached?",
        description="Time cross-tenant probes against random misses on every transport.",
    )
    timing.add_argument("--target", required=True, metavar="HOST:PORT", help="the gRPC listener")
    timing.add_argument("--attacker-tenant", required=True, metavar="T", help="the prober's tenant")
    timing.add_argument(
        "--attacker-token-file",
        required=True,
        type=Path,
        metavar="F",
        help="token of a principal with read and write on the attacker tenant only",
    )
    timing.add_argument("--victim-tenant", required=True, metavar="T", help="the probed tenant")
    timing.add_argument(
        "--victim-token-file",
        required=True,
        type=Path,
        metavar="F",
        help="token of a principal with read and write on the victim tenant",
    )
    timing.add_argument("--tls-ca", type=Path, metavar="F", help="CA that signed the server")
    timing.add_argument(
        "--probes",
        type=_probes,
        default=400,
        metavar="N",
        help=f"timed calls per arm and transport (default 400, at least {MIN_PROBES})",
    )
    timing.add_argument(
        "--publisher-token-file",
        type=Path,
        metavar="F",
        help="token with `publish`: also audit reads of the public scope (@public)",
    )
    timing.add_argument(
        "--also-target",
        action="append",
        default=[],
        metavar="HOST:PORT",
        help="another server of the same deployment (one Redis Cluster): the public check "
        "also reads through it; repeat for each",
    )
    timing.add_argument(
        "--public-settle-bytes",
        type=_bytes,
        default=0,
        metavar="N",
        help="put N bytes of the attacker's own blocks before the public check, so the "
        "published blocks leave the put journal as on a long-running server (give twice "
        "the target's [storage] journal_bytes); deleted again",
    )
    timing.add_argument(
        "--evict-page-cache",
        action="append",
        default=[],
        type=Path,
        metavar="F",
        help="a server's LMDB data file on this host (DATA_DIR/lmdb/data.mdb): its pages "
        "no process has mapped are dropped from the page cache before each public trial, "
        "as memory pressure does; repeat for each",
    )
    timing.add_argument("--json", action="store_true", help="print one JSON object")


def _probes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < MIN_PROBES:
        raise argparse.ArgumentTypeError(f"give at least {MIN_PROBES} (got {value})")
    return value


def _bytes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"give 0 or more bytes (got {value})")
    return value


def run(args: argparse.Namespace) -> int:
    from kvshare.audit.public import check_evict_files
    from kvshare.audit.setup import AuditError, Party, Setup
    from kvshare.audit.timing import run_audit
    from kvshare.audit.verdicts import PASS
    from replica_agent.client import ClientTls

    try:
        setup = Setup(
            target=args.target,
            attacker=Party(
                args.attacker_tenant,
                _read_token(args.attacker_token_file, "--attacker-token-file"),
                "--attacker-token-file",
            ),
            victim=Party(
                args.victim_tenant,
                _read_token(args.victim_token_file, "--victim-token-file"),
                "--victim-token-file",
            ),
            tls=ClientTls(root_ca=args.tls_ca) if args.tls_ca else None,
            publisher_token=(
                _read_token(args.publisher_token_file, "--publisher-token-file")
                if args.publisher_token_file
                else None
            ),
            probes=args.probes,
            also_targets=tuple(args.also_target),
            public_settle_bytes=args.public_settle_bytes,
            evict_files=tuple(args.evict_page_cache),
        )
        if args.tls_ca and not args.tls_ca.is_file():
            raise AuditError(f"--tls-ca {args.tls_ca} is not a readable file")
        check_evict_files(setup.evict_files)
        audit = run_audit(setup)
    except AuditError as error:
        print(f"kvshare audit timing: error: {error}", file=sys.stderr)
        return 2
    for line in audit.cleanup:
        print(f"kvshare audit timing: planted blocks {line}", file=sys.stderr)
    report = audit.report
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0 if report["verdict"] == PASS else 1


def _read_token(path: Path, flag: str) -> str:
    from kvshare.audit.setup import AuditError

    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise AuditError(f"cannot read {flag} {path}: {error.strerror}") from None
    if not token:
        raise AuditError(f"{flag} {path} is empty; give the file holding the bearer token")
    return token


VERDICT_WORDS = {
    "pass": "pass: no timing channel found, and the control shows the harness can see one",
    "channel": "FAIL: a timing channel (or broken isolation) was found; see the reasons",
    "inconclusive": "FAIL: the control did not separate; the audit cannot vouch at this "
    "noise level (run with more --probes, or on a quieter host)",
}


def format_report(report: dict[str, Any]) -> str:
    """A readable table: one row per transport and comparison, then the verdict."""
    header = ["transport", "comparison", "auc", "ks_p", "probes", "verdict"]
    rows: list[list[str]] = []
    for name, entry in report["transports"].items():
        if "skipped" in entry:
            rows.append([name, "skipped", "-", "-", "-", entry["skipped"]])
            continue
        comparisons = [
            (f"{op} {kind.replace('_', '-')}", c)
            for op, pair in entry["ops"].items()
            for kind, c in pair.items()
        ]
        comparisons.append(("named tenant", entry["named_tenant"]))
        for i, (label, c) in enumerate(comparisons):
            rows.append(
                [name if i == 0 else "", label, *_cells(c), entry["verdict"] if i == 0 else ""]
            )
    public = report["public"]
    if "skipped" in public:
        rows.append(["@public", "skipped", "-", "-", "-", public["skipped"]])
    else:
        for server, entry in public["servers"].items():
            name = f"@public via {server}"
            rows.append([name, "after victim read", *_cells(entry["public"]), entry["verdict"]])
            rows.append(["", "control", *_cells(entry["control"]), ""])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = [
        "  ".join([*(c.ljust(w) for c, w in zip(row[:-1], widths, strict=True)), row[-1]])
        for row in [header, *rows]
    ]
    for name, entry in report["transports"].items():
        lines += [f"{name}: {reason}" for reason in entry.get("reasons", [])]
    for server, entry in public.get("servers", {}).items():
        lines += [f"@public via {server}: {reason}" for reason in entry.get("reasons", [])]
    if "held" in public:
        held = public["held"]
        lines.append(
            f"@public: blocks measured after {held['settle_bytes']} bytes of other puts, "
            f"page cache {held['page_cache']}"
        )
    lines += [
        "",
        "cross-tenant (a probe of the victim's digests vs random misses): |auc - 0.5| <= 0.1 "
        "and ks_p >= 0.01 passes; control (own hits vs misses): auc >= 0.7 separates "
        "(@public: published hits vs misses, |auc - 0.5| >= 0.2, either way)",
        f"verdict: {VERDICT_WORDS.get(report['verdict'], report['verdict'])}",
    ]
    return "\n".join(lines)


def _cells(c: dict[str, Any]) -> list[str]:
    return [f"{c['auc']:.3f}", f"{c['ks_p']:.3g}", str(c["probes"])]
