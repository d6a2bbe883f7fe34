"""Parse `kvshare simulate` flags once into a frozen `SimulateOptions`.

argparse keeps every value as text so that this module, not argparse, reports bad
input: each problem becomes one `SimulateInputError` line naming the flag and what to
change, and the CLI exits 2.

Two workloads, each with its own options value: `trace` (the default) replays a trace
over a sweep of configurations (`SimulateOptions`); `public-prefix` generates a
multi-tenant workload and compares it without and with the public scope
(`PublicPrefixOptions`). A flag that only one workload reads is an error with the other,
so nothing given is silently ignored; flags they share default per workload.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from pathlib import Path

from kvshare.simulate.errors import SimulateInputError
from kvshare.simulate.policies import POLICY_NAMES, PolicyParams
from kvshare.simulate.presets import PRESETS
from kvshare.simulate.public_prefix import PublicPrefixWorkload
from kvshare.simulate.scenarios import check_scenario
from kvshare.simulate.timing import TimeModel

STORE_SETTINGS: dict[str, tuple[bool, ...]] = {
    "both": (False, True),
    "on": (True,),
    "off": (False,),
}
WORKLOAD_NAMES: tuple[str, ...] = ("trace", "public-prefix")
TRACE_DEFAULTS = {"replicas": "1,2,4,8,16", "policies": ",".join(POLICY_NAMES), "store": "both"}
PUBLIC_PREFIX_DEFAULTS = {"replicas": "4", "policies": "round_robin"}
# Flag -> argparse destination of the flags only `--workload public-prefix` reads.
PUBLIC_PREFIX_FLAGS = {
    "--tenants": "tenants",
    "--public-tokens": "public_tokens",
    "--system-tokens": "system_tokens",
    "--conversations": "conversations",
    "--turns": "turns",
    "--turn-tokens": "turn_tokens",
}


@dataclass(frozen=True)
class SimulateOptions:
    """Everything a `kvshare simulate` run needs, validated."""

    trace: Path
    replica_counts: tuple[int, ...]
    policies: tuple[str, ...]
    store_settings: tuple[bool, ...]
    block_tokens: int
    replica_capacity_blocks: int | None
    store_capacity_blocks: int | None
    time_model: TimeModel
    preset: str
    policy_params: PolicyParams
    scenario: str
    seed: int
    json_output: bool
    plot: Path | None
    progress: bool | None


@dataclass(frozen=True)
class PublicPrefixOptions:
    """Everything a `kvshare simulate --workload public-prefix` run needs, validated."""

    workload: PublicPrefixWorkload
    replicas: int
    policy: str
    block_tokens: int
    replica_capacity_blocks: int | None
    time_model: TimeModel
    preset: str
    policy_params: PolicyParams
    json_output: bool


def check_workload(name: str) -> str:
    """Return `name` if it is a workload, else raise with the list to choose from."""
    if name not in WORKLOAD_NAMES:
        raise SimulateInputError(
            f"--workload {name!r} is unknown; choose one of {', '.join(WORKLOAD_NAMES)}"
        )
    return name


def parse_options(args: argparse.Namespace) -> SimulateOptions:
    """Validate the parsed flags; raise `SimulateInputError` on the first bad one."""
    for flag, dest in PUBLIC_PREFIX_FLAGS.items():
        if getattr(args, dest) is not None:
            raise SimulateInputError(f"{flag} applies to --workload public-prefix only; drop it")
    if args.trace is None:
        raise SimulateInputError("--trace is required; pass a Mooncake-format .jsonl file")
    block_tokens = parse_int(args.block_tokens, "--block-tokens", minimum=1)
    store = TRACE_DEFAULTS["store"] if args.shared_store is None else args.shared_store
    if store not in STORE_SETTINGS:
        raise SimulateInputError(f"--shared-store {store!r}: use one of both, on, off")
    return SimulateOptions(
        trace=Path(args.trace),
        replica_counts=parse_replica_counts(_or_default(args.replicas, TRACE_DEFAULTS, "replicas")),
        policies=parse_policies(_or_default(args.policies, TRACE_DEFAULTS, "policies")),
        store_settings=STORE_SETTINGS[store],
        block_tokens=block_tokens,
        replica_capacity_blocks=capacity_blocks(
            args.replica_capacity_tokens, "--replica-capacity-tokens", block_tokens
        ),
        store_capacity_blocks=capacity_blocks(
            args.store_capacity_tokens, "--store-capacity-tokens", block_tokens
        ),
        time_model=parse_time_model(args),
        preset=args.preset,
        policy_params=parse_policy_params(args),
        scenario=check_scenario(args.scenario),
        seed=parse_int(args.seed, "--seed", minimum=0),
        json_output=args.json,
        plot=None if args.plot is None else Path(args.plot),
        progress=args.progress,
    )


def parse_public_prefix_options(args: argparse.Namespace) -> PublicPrefixOptions:
    """Validate the flags of `--workload public-prefix`; raise on the first bad one.

    It runs one pool (one replica count, one policy) with an unbounded shared store in
    both runs, so the trace, sweep, scenario, store and plot flags are refused.
    """
    _refuse_trace_only_flags(args)
    block_tokens = parse_int(args.block_tokens, "--block-tokens", minimum=1)
    replicas = _or_default(args.replicas, PUBLIC_PREFIX_DEFAULTS, "replicas")
    policies = parse_policies(_or_default(args.policies, PUBLIC_PREFIX_DEFAULTS, "policies"))
    if len(policies) != 1:
        raise SimulateInputError(
            f"--policies {args.policies!r}: --workload public-prefix runs one policy; give one"
        )
    return PublicPrefixOptions(
        workload=parse_public_prefix_workload(args),
        replicas=parse_int(replicas, "--replicas", minimum=1),
        policy=policies[0],
        block_tokens=block_tokens,
        replica_capacity_blocks=capacity_blocks(
            args.replica_capacity_tokens, "--replica-capacity-tokens", block_tokens
        ),
        time_model=parse_time_model(args),
        preset=args.preset,
        policy_params=parse_policy_params(args),
        json_output=args.json,
    )


def _refuse_trace_only_flags(args: argparse.Namespace) -> None:
    refusals = [
        (args.trace is not None, "--trace"),
        (args.plot is not None, "--plot"),
        (args.scenario != "static", "--scenario"),
        (args.store_capacity_tokens != "0", "--store-capacity-tokens (the store is unbounded)"),
        (args.shared_store not in (None, "on"), "--shared-store (both runs use the store)"),
    ]
    for refused, flag in refusals:
        if refused:
            raise SimulateInputError(f"{flag} does not apply to --workload public-prefix; drop it")


def parse_public_prefix_workload(args: argparse.Namespace) -> PublicPrefixWorkload:
    """The workload's shape from its flags, each defaulting to `PublicPrefixWorkload`'s."""
    minimums = {"system_tokens": 0, "public_tokens": 0}
    values = {
        dest: parse_int(getattr(args, dest), flag, minimum=minimums.get(dest, 1))
        for flag, dest in PUBLIC_PREFIX_FLAGS.items()
        if getattr(args, dest) is not None
    }
    seed = parse_int(args.seed, "--seed", minimum=0)
    return replace(PublicPrefixWorkload(), **values, seed=seed)


def _or_default(text: str | None, defaults: dict[str, str], key: str) -> str:
    return defaults[key] if text is None else text


def parse_int(text: str, flag: str, minimum: int) -> int:
    """An integer flag value of at least `minimum`, or one error line saying so."""
    try:
        value = int(text)
    except ValueError:
        raise SimulateInputError(
            f"{flag} {text!r} is not an integer; give a whole number of at least {minimum}"
        ) from None
    if value < minimum:
        raise SimulateInputError(f"{flag} {value} is below {minimum}; give at least {minimum}")
    return value


def parse_float(text: str, flag: str, minimum: float, *, strict: bool) -> float:
    """A finite number flag above (`strict`) or at least `minimum`."""
    try:
        value = float(text)
    except ValueError:
        raise SimulateInputError(f"{flag} {text!r} is not a number") from None
    too_small = value <= minimum if strict else value < minimum
    if too_small or not math.isfinite(value):
        bound = "above" if strict else "at least"
        raise SimulateInputError(
            f"{flag} {text!r} is out of range; give a finite number {bound} {minimum:g}"
        )
    return value


def parse_replica_counts(text: str) -> tuple[int, ...]:
    """`1,2,4,8` -> (1, 2, 4, 8): positive, distinct, kept in the order given."""
    counts: list[int] = []
    for item in text.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) < 1:
            raise SimulateInputError(
                f"--replicas {text!r}: {item!r} is not a positive integer; "
                "give a comma-separated list such as 1,2,4,8,16"
            )
        if int(item) not in counts:
            counts.append(int(item))
    return tuple(counts)


def parse_policies(text: str) -> tuple[str, ...]:
    """`round_robin,cache_aware` -> names checked against the known policies."""
    names: list[str] = []
    for item in text.split(","):
        name = item.strip()
        if name not in POLICY_NAMES:
            raise SimulateInputError(
                f"--policies: unknown policy {name!r}; choose from {','.join(POLICY_NAMES)}"
            )
        if name not in names:
            names.append(name)
    return tuple(names)


def capacity_blocks(text: str, flag: str, block_tokens: int) -> int | None:
    """A capacity in tokens as whole blocks; 0 means unbounded (None)."""
    tokens = parse_int(text, flag, minimum=0)
    if tokens == 0:
        return None
    if tokens < block_tokens:
        raise SimulateInputError(
            f"{flag} {tokens} holds no {block_tokens}-token block; "
            f"give at least {block_tokens}, or 0 for unbounded"
        )
    return tokens // block_tokens


def parse_time_model(args: argparse.Namespace) -> TimeModel:
    """The preset's speeds, with any explicitly given flag taking precedence."""
    preset = PRESETS.get(args.preset)
    if preset is None:
        raise SimulateInputError(
            f"--preset {args.preset!r} is unknown; choose from {', '.join(PRESETS)}"
        )
    prefill = preset.prefill_tokens_per_s
    if args.prefill_tokens_per_s is not None:
        prefill = parse_float(args.prefill_tokens_per_s, "--prefill-tokens-per-s", 0, strict=True)
    kv_bytes = preset.kv_bytes_per_token
    if args.kv_bytes_per_token is not None:
        kv_bytes = parse_int(args.kv_bytes_per_token, "--kv-bytes-per-token", minimum=1)
    return TimeModel(
        prefill_tokens_per_s=prefill,
        kv_bytes_per_token=kv_bytes,
        restore_gb_per_s=parse_float(args.restore_gb_per_s, "--restore-gb-per-s", 0, strict=True),
        restore_latency_s=parse_float(
            args.restore_latency_ms, "--restore-latency-ms", 0, strict=False
        )
        / 1000.0,
    )


def parse_policy_params(args: argparse.Namespace) -> PolicyParams:
    """Tuning of `prefix_affinity` and `cache_aware`."""
    return PolicyParams(
        affinity_key_blocks=parse_int(args.affinity_key_blocks, "--affinity-key-blocks", 1),
        affinity_load_factor=parse_float(
            args.affinity_load_factor, "--affinity-load-factor", 1.0, strict=False
        ),
        cache_threshold=parse_float(args.cache_threshold, "--cache-threshold", 0.0, strict=False),
        balance_abs_threshold=parse_int(
            args.balance_abs_threshold, "--balance-abs-threshold", minimum=0
        ),
        balance_rel_threshold=parse_float(
            args.balance_rel_threshold, "--balance-rel-threshold", 1.0, strict=False
        ),
    )
