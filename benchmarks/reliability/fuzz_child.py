"""One fuzz target under atheris (libFuzzer), started by benchmarks/fuzz.py.

    python benchmarks/reliability/fuzz_child.py TARGET --runs N --out FILE
        [--live HOST:PORT --token TOKEN --work DIR] [--seed S] [--artifacts DIR]

The project's packages are imported inside `atheris.instrument_imports`, so their
branches are what libFuzzer's coverage sees. Results (cases and verdicts) are
written to --out every 256 inputs and after the last, because libFuzzer ends the
process itself once it has run N inputs. The inputs libFuzzer keeps (crash-*,
slow-unit-*, ...) go to --artifacts (default: --work/artifacts/TARGET), never to the
working directory.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # this checkout's packages

import atheris

PROJECT = ["cacheserver", "replica_agent", "policy", "kvcommon"]

with atheris.instrument_imports(include=PROJECT):  # any project module they load too
    from benchmarks.fuzz import libfuzzer_flags
    from benchmarks.reliability import fuzz_parsers, fuzz_wire


def _embedded(work: Path, journal_dir: Path) -> tuple[object, str, str]:
    """A server in this process (instrumented), with its own data dir and token."""
    from benchmarks.fuzz import PRINCIPALS, TENANTS
    from benchmarks.reliability.harness import write_tenancy
    from cacheserver.config import load_config
    from cacheserver.embedded import EmbeddedServer

    storage: dict[str, int | bool | str] = {
        "journal_bytes": 16 << 20,
        "journal_dir": str(journal_dir),
    }
    tenancy = write_tenancy(work, TENANTS, PRINCIPALS, storage=storage)
    server = EmbeddedServer(load_config(tenancy.path))
    return server, server.start(), tenancy.tokens["a"]


def build(args: argparse.Namespace, verdicts: dict[str, int]) -> fuzz_parsers.Target:
    if args.target in ("grpc", "bulk_server"):
        # Never stopped: libFuzzer ends the process. Its journal is in the directory the
        # parent made (and removes); its data dir in the parent's temporary directory.
        work = Path(tempfile.mkdtemp(prefix=f"embedded-{args.target}-", dir=args.work))
        _, address, token = _embedded(work, args.journal_dir or work)
        servers = [fuzz_wire.Server("embedded", address, token)]
        if args.live:
            servers.append(fuzz_wire.Server("live", args.live, args.token))
        make = fuzz_wire.grpc_target if args.target == "grpc" else fuzz_wire.bulk_server_target
        return make(servers, verdicts)
    if args.target == "bulk_client":
        return fuzz_wire.bulk_client_target(verdicts)
    return fuzz_parsers.TARGETS[args.target]()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("target")
    parser.add_argument("--runs", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--live", default="")
    parser.add_argument("--token", default="")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--journal-dir", type=Path, default=None)
    parser.add_argument("--artifacts", type=Path, default=None)
    args = parser.parse_args()
    artifacts: Path = args.artifacts or args.work / "artifacts" / args.target
    artifacts.mkdir(parents=True, exist_ok=True)
    tempfile.tempdir = str(args.work)  # the targets' scratch files: removed by the parent
    logging.basicConfig(level=logging.WARNING)
    errors = fuzz_wire.LoggedErrors()
    logging.getLogger().addHandler(errors)
    verdicts: dict[str, int] = {}
    started = time.monotonic()
    with atheris.instrument_imports(include=PROJECT):  # the target's modules load here
        target = build(args, verdicts)

    cases = 0

    def write() -> None:
        result = {
            "target": args.target,
            "cases": cases,
            "verdicts": verdicts,
            "logged_errors": errors.counts,
            "seconds": round(time.monotonic() - started, 1),
        }
        args.out.write_text(json.dumps(result))

    def one(data: bytes) -> None:
        nonlocal cases
        cases += 1
        try:
            target(data)
        except fuzz_parsers.Finding as finding:
            key = f"{args.target}:internal:{finding}"
            verdicts[key] = verdicts.get(key, 0) + 1
        except Exception as error:  # any other exception out of a parser is a bug
            key = f"{args.target}:internal:{fuzz_parsers.describe(error)}"
            verdicts[key] = verdicts.get(key, 0) + 1
        if cases % 256 == 0 or cases >= args.runs:
            write()

    write()
    atheris.Setup([sys.argv[0], *libfuzzer_flags(args.runs, args.seed, artifacts)], one)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
