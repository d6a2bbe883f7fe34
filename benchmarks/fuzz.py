"""Coverage-guided fuzzing of every parser that sees untrusted bytes.

    python benchmarks/fuzz.py --cases 100000 [--targets grpc,bulk_server,...] [--json]

Engine: atheris (libFuzzer for Python), one child process per target, each running
`--cases / len(targets)` inputs: libFuzzer mutates byte strings and keeps those that
reach new code, with the project's modules instrumented (atheris.instrument_imports),
and each target reads its input through a FuzzedDataProvider so that mutations keep
the structure of a request (a real ticket, a header with odd fields, a size of 2^63).

Targets (benchmarks/reliability/fuzz_parsers.py, fuzz_wire.py):
- grpc:        protobuf requests (real messages with fuzzed fields, or raw bytes) to
               every method, with and without a valid token
- bulk_server: the bulk channel's HELLO, request headers, digest lists and sizes
- bulk_client: the client reading a hostile bulk server's replies, over TCP and the
               same-host socket with its arena descriptor
- codec, sealing, config, journal: the agent's block codec and sealed-block opener,
               the TOML config loader, the journal's replay of a corrupted ring
The server targets send every input both to a live `kvshare serve` process, started
here (its crashes, logged tracebacks and RSS are what the report counts), and to a
server embedded in the child, whose instrumented code steers the mutations.

`--json` prints {"cases", "server_crashes", "internal_errors", "unexpected_statuses",
"rss_growth_bytes", "targets", "findings"}: internal_errors counts INTERNAL statuses
and tracebacks of either server and exceptions a parser may not raise; findings names
each distinct one (type and source line, never input bytes).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages

from benchmarks.reliability.harness import (
    PrincipalSpec,
    ServerProc,
    TenantSpec,
    log_size,
    private_journal_dir,
    write_tenancy,
)

TARGETS = ("grpc", "bulk_server", "bulk_client", "codec", "sealing", "config", "journal")
SERVER_TARGETS = ("grpc", "bulk_server")
# Log lines of the live server that mark a bug: the service's "internal error in
# <method>" (INTERNAL answered), the bulk listener's "bulk connection failed", and
# gRPC's own failures to decode a request or run a handler.
LOG_MARKERS = (
    "internal error in",
    "bulk connection failed",
    "Exception deserializing",
    "Exception calling application",
    "Exception iterating",
    "raised by servicer method",
)
EXCEPTION_RE = re.compile(r"^([\w.]*(?:Error|Exception|Exhausted|Denied))\b")
TENANTS = [TenantSpec("alpha", 64 << 20), TenantSpec("beta", 64 << 20)]
PRINCIPALS = [
    PrincipalSpec("a", ("alpha",), ("read", "write")),
    PrincipalSpec("root", ("alpha", "beta"), ("read", "write", "admin")),
]


def write_config(directory: Path, journal_dir: Path) -> tuple[Path, str]:
    storage: dict[str, int | bool | str] = {
        "journal_bytes": 16 << 20,
        "journal_dir": str(journal_dir),
        "memory_budget_bytes": 64 << 20,
        "disk_budget_bytes": 256 << 20,
        "max_pending_write_bytes": 64 << 20,
    }
    tenancy = write_tenancy(directory, TENANTS, PRINCIPALS, storage=storage)
    return tenancy.path, tenancy.tokens["a"]


def log_findings(path: Path, start: int) -> dict[str, int]:
    """The bug markers in the live server's log after byte `start`, by marker, method and
    the exception type that ended the traceback after it."""
    with open(path, "rb") as f:
        f.seek(start)
        lines = f.read().decode("utf-8", "replace").splitlines()
    found: dict[str, int] = {}
    for i, line in enumerate(lines):
        marker = next((m for m in LOG_MARKERS if m in line), None)
        if marker is None:
            continue
        method = re.search(r"BlockStore/(\w+)", line)
        error = next(
            (m.group(1) for later in lines[i + 1 : i + 40] if (m := EXCEPTION_RE.match(later))),
            "?",
        )
        key = f"live:logged:{marker}:{method.group(1) if method else '-'}:{error}"
        found[key] = found.get(key, 0) + 1
    return found


def libfuzzer_flags(runs: int, seed: int, artifacts: Path) -> list[str]:
    """libFuzzer's flags for one child. `-artifact_prefix` sends the inputs it keeps
    (crash-*, leak-*, timeout-*, slow-unit-*, oom-*) into the campaign's directory;
    without it they land in the working directory, a checkout's root."""
    flags = [
        f"-runs={runs}",
        "-rss_limit_mb=0",
        "-max_len=4096",
        "-len_control=0",
        f"-artifact_prefix={artifacts}{os.sep}",  # a directory: libFuzzer appends the name
    ]
    if seed:
        flags.append(f"-seed={seed}")
    return flags


def child_command(
    target: str, runs: int, seed: int, work: Path, live: str, token: str, journal_dir: Path
) -> list[str]:
    """The fuzz child's command line; its libFuzzer artifacts go to work/artifacts/TARGET."""
    return [
        sys.executable,
        str(Path(__file__).resolve().parent / "reliability" / "fuzz_child.py"),
        target,
        f"--runs={runs}",
        f"--seed={seed}",
        f"--out={work / f'{target}.json'}",
        f"--live={live}",
        f"--token={token}",
        f"--work={work}",
        f"--journal-dir={journal_dir}",
        f"--artifacts={work / 'artifacts' / target}",
    ]


def run_child(
    target: str, runs: int, seed: int, work: Path, live: str, token: str, journal_dir: Path
) -> dict[str, Any]:
    out = work / f"{target}.json"
    command = child_command(target, runs, seed, work, live, token, journal_dir)
    with open(work / f"{target}.log", "ab") as log:
        subprocess.run(command, stdout=log, stderr=log, stdin=subprocess.DEVNULL, check=False)
    try:
        return dict(json.loads(out.read_text()))
    except (OSError, ValueError):
        return {"target": target, "cases": 0, "verdicts": {"harness:child failed": 1}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=10_000, help="inputs in all")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--seed", type=int, default=0, help="libFuzzer seed (0: random)")
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--keep", type=Path, help="keep the logs, data and libFuzzer's artifacts here"
    )
    args = parser.parse_args()
    targets = [t for t in args.targets.split(",") if t]
    unknown = set(targets) - set(TARGETS)
    if unknown:
        parser.error(f"unknown targets {sorted(unknown)}; use {', '.join(TARGETS)}")
    report = campaign(targets, args.cases, args.seed, args.keep)
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key}: {value}")
    return 0


def campaign(targets: list[str], cases: int, seed: int, keep: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="kvshare-fuzz-") as tmp, private_journal_dir() as jd:
        work = Path(tmp) if keep is None else keep
        work.mkdir(parents=True, exist_ok=True)
        config, token = write_config(work / "live", jd)
        log_path = work / "live-server.log"
        server = ServerProc(config, log_path)
        crashes, logged = 0, {}
        try:
            _warm_up(server.address, token)
            rss_start, log_start = server.rss_bytes(), log_size(log_path)
            results = []
            for index, target in enumerate(targets):
                # `cases` split evenly, the remainder to the first targets: at least
                # `cases` in all (one each at the least)
                share = max(1, cases // len(targets) + (index < cases % len(targets)))
                results.append(run_child(target, share, seed, work, server.address, token, jd))
                if not server.alive():  # died: count it, and start it again for the rest
                    crashes += 1
                    logged.update(log_findings(log_path, log_start))
                    server = ServerProc(config, log_path)
                    log_start = log_size(log_path)
            rss_end = server.rss_bytes()
            for key, count in log_findings(log_path, log_start).items():
                logged[key] = logged.get(key, 0) + count
        finally:
            with contextlib.suppress(RuntimeError):
                server.terminate(timeout_s=30)
    return summarize(results, crashes, logged, rss_end - rss_start)


def _warm_up(address: str, token: str) -> None:
    """A few real puts and gets first, so that RSS growth is the fuzzing's, not start-up's."""
    from replica_agent.client import BlockClient

    with BlockClient(address, token) as client:
        for bulk in range(20):
            digests = [os.urandom(32) for _ in range(4)]
            client.put("alpha", f"warm{bulk}", digests, [os.urandom(64 << 10)] * 4)
            client.get("alpha", f"warm{bulk}", digests)


def summarize(
    results: list[dict[str, Any]], crashes: int, logged: dict[str, int], rss_growth: int
) -> dict[str, Any]:
    internal, unexpected = sum(logged.values()), 0
    findings: dict[str, int] = dict(logged)
    per_target: dict[str, dict[str, Any]] = {}
    for result in results:
        verdicts: dict[str, int] = result.get("verdicts", {})
        for key, count in verdicts.items():
            if key.startswith(("live:internal", "embedded:internal")):
                findings[key] = findings.get(key, 0) + count
                continue  # a server's INTERNAL is counted from its log (one per event)
            if ":internal" in key or key.startswith("harness:"):
                internal += count
                findings[key] = findings.get(key, 0) + count
            elif ":unexpected" in key:
                unexpected += count
                findings[key] = findings.get(key, 0) + count
        for key, count in result.get("logged_errors", {}).items():
            internal += count
            findings[f"embedded:logged:{key}"] = count
        per_target[result["target"]] = {
            "cases": result.get("cases", 0),
            "seconds": result.get("seconds"),
        }
    return {
        "cases": sum(int(r.get("cases", 0)) for r in results),
        "server_crashes": crashes,
        "internal_errors": internal,
        "unexpected_statuses": unexpected,
        "rss_growth_bytes": rss_growth,
        "targets": per_target,
        "findings": findings,
    }


if __name__ == "__main__":
    raise SystemExit(main())
