"""`kvshare simulate`: flags, and the run from trace file to table, JSON or plot.

Kept light at import time (the dispatcher imports it to build `kvshare --help`):
matplotlib is loaded only by `--plot`.
"""

from __future__ import annotations

import argparse
import json
import sys

from kvshare.simulate.engine import SimConfig, ideal_token_hit_rate
from kvshare.simulate.errors import SimulateInputError
from kvshare.simulate.options import (
    PUBLIC_PREFIX_DEFAULTS,
    PUBLIC_PREFIX_FLAGS,
    TRACE_DEFAULTS,
    WORKLOAD_NAMES,
    PublicPrefixOptions,
    SimulateOptions,
    check_workload,
    parse_options,
    parse_public_prefix_options,
)
from kvshare.simulate.policies import PolicyParams
from kvshare.simulate.presets import DEFAULT_PRESET, PRESETS
from kvshare.simulate.public_prefix import PublicPrefixWorkload, run_comparison
from kvshare.simulate.report import (
    build_public_prefix_report,
    build_report,
    format_public_prefix_table,
    format_table,
)
from kvshare.simulate.scenarios import SCENARIO_NAMES, shape_traffic
from kvshare.simulate.sweep import run_sweep
from kvshare.simulate.trace import load_trace

_DEFAULTS = PolicyParams()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the flags; values stay text so `options` can report bad ones in one line."""
    parser.add_argument(
        "--workload",
        default="trace",
        metavar="NAME",
        help=f"one of {', '.join(WORKLOAD_NAMES)} (default trace: replay --trace)",
    )
    parser.add_argument(
        "--trace",
        metavar="FILE",
        help="Mooncake-format .jsonl trace (required by --workload trace)",
    )
    _add_sweep_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--plot", metavar="FILE", help="write a PNG of hit rate and TTFT")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when it is a terminal)",
    )
    _add_time_model_arguments(parser)
    _add_policy_arguments(parser)
    _add_public_prefix_arguments(parser)


def _add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--replicas",
        help=f"comma-separated replica counts (default {TRACE_DEFAULTS['replicas']}; "
        f"public-prefix: one count, default {PUBLIC_PREFIX_DEFAULTS['replicas']})",
    )
    parser.add_argument(
        "--policies",
        help=f"comma-separated routing policies (default {TRACE_DEFAULTS['policies']}; "
        f"public-prefix: one, default {PUBLIC_PREFIX_DEFAULTS['policies']})",
    )
    parser.add_argument(
        "--replica-capacity-tokens",
        default="0",
        metavar="N",
        help="local KV cache per replica in tokens; 0 = unbounded (default)",
    )
    parser.add_argument(
        "--store-capacity-tokens",
        default="0",
        metavar="N",
        help="shared store capacity in tokens; 0 = unbounded (default)",
    )
    parser.add_argument(
        "--shared-store",
        metavar="both|on|off",
        help="run each configuration with the store, without, or both (default; public-prefix: on)",
    )
    parser.add_argument(
        "--block-tokens",
        default="512",
        metavar="N",
        help="tokens per hash_ids block (Mooncake traces: 512, the default)",
    )
    parser.add_argument(
        "--scenario", default="static", metavar="NAME", help=f"one of {', '.join(SCENARIO_NAMES)}"
    )
    parser.add_argument("--seed", default="0", help="seed of the random policy and scenarios")


def _add_time_model_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("time model")
    presets = "; ".join(
        f"{p.name}: {p.prefill_tokens_per_s:,.0f} tok/s, {p.kv_bytes_per_token:,} B/token"
        for p in PRESETS.values()
    )
    group.add_argument(
        "--preset",
        default=DEFAULT_PRESET,
        metavar="NAME",
        help=f"model/GPU pair ({presets}); default {DEFAULT_PRESET}",
    )
    group.add_argument("--prefill-tokens-per-s", metavar="R", help="override the preset")
    group.add_argument("--kv-bytes-per-token", metavar="B", help="override the preset")
    group.add_argument(
        "--restore-gb-per-s",
        default="10",
        metavar="GB",
        help="store-to-GPU restore bandwidth, 1e9 bytes/s (default 10)",
    )
    group.add_argument(
        "--restore-latency-ms",
        default="1",
        metavar="MS",
        help="fixed cost of one restore (default 1 ms)",
    )


def _add_policy_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("policy tuning")
    group.add_argument(
        "--affinity-key-blocks",
        metavar="N",
        default=str(_DEFAULTS.affinity_key_blocks),
        help="leading blocks hashed by prefix_affinity",
    )
    group.add_argument(
        "--affinity-load-factor",
        metavar="F",
        default=str(_DEFAULTS.affinity_load_factor),
        help="prefix_affinity's bound on routed tokens over the mean",
    )
    group.add_argument(
        "--cache-threshold",
        metavar="F",
        default=str(_DEFAULTS.cache_threshold),
        help="cache_aware: least matched share of a prompt to follow the match",
    )
    group.add_argument(
        "--balance-abs-threshold",
        metavar="N",
        default=str(_DEFAULTS.balance_abs_threshold),
        help="cache_aware: in-flight gap that counts as imbalance",
    )
    group.add_argument(
        "--balance-rel-threshold",
        metavar="F",
        default=str(_DEFAULTS.balance_rel_threshold),
        help="cache_aware: in-flight ratio that counts as imbalance",
    )


def _add_public_prefix_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "public-prefix workload",
        "T tenants send a shared framework prompt, their system prompt, then turns; "
        "compared without and with the public scope",
    )
    defaults = PublicPrefixWorkload()
    for flag, dest in PUBLIC_PREFIX_FLAGS.items():
        group.add_argument(
            flag,
            metavar="N",
            help=f"{_PUBLIC_PREFIX_HELP[dest]} (default {getattr(defaults, dest):,})",
        )


_PUBLIC_PREFIX_HELP = {
    "tenants": "tenants sharing the framework prompt",
    "public_tokens": "tokens of the public framework prompt",
    "system_tokens": "tokens of each tenant's system prompt",
    "conversations": "conversations per tenant",
    "turns": "turns per conversation",
    "turn_tokens": "mean tokens a turn adds (uniform in [1/2, 3/2] of it)",
}


def _configs(options: SimulateOptions) -> list[SimConfig]:
    return [
        SimConfig(
            policy=policy,
            replicas=replicas,
            shared_store=shared_store,
            block_tokens=options.block_tokens,
            replica_capacity_blocks=options.replica_capacity_blocks,
            store_capacity_blocks=options.store_capacity_blocks,
            time_model=options.time_model,
            policy_params=options.policy_params,
            scenario=options.scenario,
            seed=options.seed,
        )
        for replicas in options.replica_counts
        for policy in options.policies
        for shared_store in options.store_settings
    ]


def run(args: argparse.Namespace) -> int:
    """Exit 0 with results on stdout, or 2 with one line on stderr saying what to change."""
    try:
        if check_workload(args.workload) == "public-prefix":
            return _run_public_prefix(parse_public_prefix_options(args))
        options = parse_options(args)
        requests = shape_traffic(load_trace(options.trace), options.scenario, options.seed)
        ideal = ideal_token_hit_rate(requests, options.block_tokens)
        results = run_sweep(requests, _configs(options), options.progress)
        if options.plot is not None:
            from kvshare.simulate.plot import write_plot

            title = f"{options.trace.name}, scenario {options.scenario}, preset {options.preset}"
            write_plot(results, ideal, options.plot, title)
    except SimulateInputError as error:
        print(f"kvshare simulate: {error}", file=sys.stderr)
        return 2
    if options.json_output:
        print(json.dumps(build_report(results, ideal, options), indent=2))
    else:
        print(format_table(results, ideal))
    return 0


def _run_public_prefix(options: PublicPrefixOptions) -> int:
    comparison = run_comparison(
        options.workload,
        replicas=options.replicas,
        policy=options.policy,
        block_tokens=options.block_tokens,
        replica_capacity_blocks=options.replica_capacity_blocks,
        time_model=options.time_model,
        policy_params=options.policy_params,
    )
    if options.json_output:
        print(json.dumps(build_public_prefix_report(comparison, options), indent=2))
    else:
        print(format_public_prefix_table(comparison, options))
    return 0
