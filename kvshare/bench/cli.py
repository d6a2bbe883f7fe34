"""`kvshare bench`: kvshare's data path beside raw TCP, Redis and LMCache's server.

Imported by the `kvshare` dispatcher when it builds its parser, so nothing heavy
(redis, grpc, torch) is imported here at module level; the peers import their client
libraries inside the client processes.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path
from types import FrameType
from typing import TypeVar

from kvshare.bench import config as cfg

QUICK_ROUNDS = 1
QUICK_SECONDS_PER_CELL = 0.1
QUICK_PUT_MIB_PER_CLIENT = 4
QUICK_BATCH_BLOCKS = 16
DEFAULT_ROUNDS = 3
DEFAULT_SECONDS_PER_CELL = 0.5
# Per client and PUT cell: bounds what servers that cannot drop values hold per round.
DEFAULT_PUT_MIB_PER_CLIENT = 64
MIN_CALLS_PER_CELL = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", help="value sizes, e.g. 64KiB,512KiB,2MiB,8MiB (the default)")
    parser.add_argument(
        "--clients",
        help=f"client process counts, e.g. 1,4 (the default) or 1,4,16; at most {cfg.MAX_CLIENTS}",
    )
    parser.add_argument("--rounds", type=int, help=f"interleaved rounds (default {DEFAULT_ROUNDS})")
    parser.add_argument(
        "--systems",
        help=f"comma-separated, from {', '.join(cfg.KNOWN_SYSTEMS)} "
        f"(default {','.join(cfg.DEFAULT_SYSTEMS)}); unavailable ones are skipped with a note",
    )
    parser.add_argument(
        "--seconds", type=float, help=f"time per measured cell (default {DEFAULT_SECONDS_PER_CELL})"
    )
    parser.add_argument(
        "--put-mib",
        type=int,
        help=f"MiB one client writes at most per PUT cell (default {DEFAULT_PUT_MIB_PER_CLIENT})",
    )
    parser.add_argument(
        "--batch-blocks",
        type=int,
        help="64 KiB blocks per batched GET "
        f"(default {cfg.DEFAULT_BATCH_BLOCKS}; 0 leaves batch rows out)",
    )
    parser.add_argument(
        "--lookup-blocks",
        type=int,
        help="digests of present 64 KiB blocks per lookup call "
        f"(default {cfg.DEFAULT_LOOKUP_BLOCKS}; 0 leaves lookup rows out)",
    )
    parser.add_argument(
        "--lmcache-python",
        help="python of a venv with lmcache "
        "(benchmarks/setup_lmcache.sh); default $KVSHARE_LMCACHE_PYTHON",
    )
    parser.add_argument("--workdir", type=Path, help="keep server logs and data here")
    parser.add_argument(
        "--two-host",
        action="store_true",
        help="run each server in one network namespace and its clients in another, joined "
        "by a veth pair on 198.18.0.0/15 (needs root and iproute2): what a replica on "
        f"another host gets (default systems {','.join(cfg.TWO_HOST_SYSTEMS)})",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="one short round, 1 client, 64 KiB and 2 MiB: a smoke run",
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help='print one JSON object {"results": [...], ...} on stdout',
    )


_T = TypeVar("_T")


def _pick(given: _T | None, quick_value: _T, default: _T, is_quick: bool) -> _T:
    """A flag given on the command line wins; otherwise --quick's value or the default."""
    if given is not None:
        return given
    return quick_value if is_quick else default


def config_from_args(args: argparse.Namespace) -> cfg.BenchConfig:
    """Parse and check every setting once, before anything starts."""
    quick = bool(args.quick)
    sizes = cfg.parse_sizes(args.sizes) if args.sizes else None
    clients = cfg.parse_counts(args.clients) if args.clients else None
    default_systems = cfg.TWO_HOST_SYSTEMS if args.two_host else cfg.DEFAULT_SYSTEMS
    systems = cfg.parse_systems(args.systems) if args.systems else default_systems
    rounds = _pick(args.rounds, QUICK_ROUNDS, DEFAULT_ROUNDS, quick)
    seconds = _pick(args.seconds, QUICK_SECONDS_PER_CELL, DEFAULT_SECONDS_PER_CELL, quick)
    put_mib = _pick(args.put_mib, QUICK_PUT_MIB_PER_CLIENT, DEFAULT_PUT_MIB_PER_CLIENT, quick)
    batch = _pick(args.batch_blocks, QUICK_BATCH_BLOCKS, cfg.DEFAULT_BATCH_BLOCKS, quick)
    lookup = cfg.DEFAULT_LOOKUP_BLOCKS if args.lookup_blocks is None else args.lookup_blocks
    if rounds < 1 or seconds <= 0 or put_mib < 1 or batch < 0:
        raise ValueError("--rounds, --seconds and --put-mib must be positive, --batch-blocks >= 0")
    if not 0 <= lookup <= cfg.MAX_LOOKUP_BLOCKS:
        raise ValueError(f"--lookup-blocks must be from 0 to {cfg.MAX_LOOKUP_BLOCKS}")
    return cfg.BenchConfig(
        sizes=_pick(sizes, cfg.QUICK_SIZES, cfg.DEFAULT_SIZES, quick),
        client_counts=_pick(clients, cfg.QUICK_CLIENT_COUNTS, cfg.DEFAULT_CLIENT_COUNTS, quick),
        rounds=rounds,
        systems=systems,
        seconds_per_cell=float(seconds),
        put_bytes_per_client=put_mib * cfg.MIB,
        min_calls_per_cell=MIN_CALLS_PER_CELL,
        batch_blocks=batch,
        lookup_blocks=lookup,
        lmcache_python=args.lmcache_python,
        workdir=args.workdir,
        is_json=bool(args.json),
        is_two_host=bool(args.two_host),
    )


def run(args: argparse.Namespace) -> int:
    from kvshare.bench import checks, netns, placement, report, runner, stats
    from kvshare.bench.systems import build_systems

    try:
        config = config_from_args(args)
    except ValueError as error:
        print(f"kvshare bench: {error}", file=sys.stderr)
        return 2
    progress = runner.Progress()
    # A plain SIGTERM would skip the `finally` blocks that stop the servers.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    if config.is_two_host:
        reason = netns.unavailable_reason()
        if reason is not None:
            print(f"kvshare bench: --two-host: {reason}", file=sys.stderr)
            return 2
        with netns.two_hosts() as rig, rig.client.entered():
            at = placement.two_host(rig)
            progress.say(f"two hosts: servers at {at.server_host} (namespace "
                         f"{rig.server.namespace}), clients in {rig.client.namespace}")  # fmt: skip
            outcome = runner.run_benchmark(config, build_systems(config, at), progress, at)
    else:
        outcome = runner.run_benchmark(config, build_systems(config), progress)
    rows = stats.aggregate(outcome.samples)
    found_checks = checks.evaluate(rows, config.client_counts, two_host=config.is_two_host)
    text = report.format_report(config, outcome, rows, found_checks)
    if config.is_json:
        print(text, file=sys.stderr)
        print(json.dumps(report.json_document(config, outcome, rows, found_checks), indent=2))
    else:
        print(text)
    return 1 if outcome.failed else 0


def _exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)
