"""Present results: the contract JSON object and a human-readable table.

The JSON keys `results[].policy, replicas, shared_store, token_hit_rate,
local_hit_rate, store_hit_rate` and `ideal_token_hit_rate` are the docs/design.md §8
contract; every other key is an addition and may grow.

`--workload public-prefix` prints its own object: `without_public` and `with_public`
(each with `stored_bytes`, `prefill_tokens`, `hit_rate` and the other counters), then
`stored_bytes_ratio` and `prefill_tokens_ratio`, both "with over without".
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvshare.simulate.engine import SimResult
from kvshare.simulate.options import PublicPrefixOptions, SimulateOptions
from kvshare.simulate.public_prefix import PublicPrefixComparison, PublicPrefixRun
from kvshare.simulate.timing import TimeModel


def _capacity_tokens(capacity_blocks: int | None, block_tokens: int) -> int:
    return 0 if capacity_blocks is None else capacity_blocks * block_tokens


def result_entry(result: SimResult, ideal_token_hit_rate: float) -> dict[str, Any]:
    """One `results[]` object: the contract keys first, then the time model's figures."""
    config = result.config
    recovered = result.token_hit_rate / ideal_token_hit_rate if ideal_token_hit_rate else 1.0
    return {
        "policy": config.policy,
        "replicas": config.replicas,
        "shared_store": config.shared_store,
        "token_hit_rate": result.token_hit_rate,
        "local_hit_rate": result.local_hit_rate,
        "store_hit_rate": result.store_hit_rate,
        "fraction_of_ideal": recovered,
        "scenario": config.scenario,
        "requests": result.requests,
        "input_tokens": result.input_tokens,
        "reused_tokens": result.reused_tokens,
        "local_hit_tokens": result.local_hit_tokens,
        "store_hit_tokens": result.store_hit_tokens,
        "prefill_tokens": result.prefill_tokens,
        "prefill_gpu_s": result.prefill_gpu_s,
        "restore_s": result.restore_s,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p99_s": result.ttft_p99_s,
        "load_max_over_mean": result.load_imbalance,
        "replicas_started": result.replicas_started,
        "replica_capacity_tokens": _capacity_tokens(
            config.replica_capacity_blocks, config.block_tokens
        ),
        "store_capacity_tokens": _capacity_tokens(
            config.store_capacity_blocks, config.block_tokens
        ),
    }


def build_report(
    results: Sequence[SimResult], ideal_token_hit_rate: float, options: SimulateOptions
) -> dict[str, Any]:
    """The whole `--json` object."""
    return {
        "results": [result_entry(result, ideal_token_hit_rate) for result in results],
        "ideal_token_hit_rate": ideal_token_hit_rate,
        "trace": str(options.trace),
        "block_tokens": options.block_tokens,
        "scenario": options.scenario,
        "seed": options.seed,
        "time_model": time_model_entry(options.preset, options.time_model),
    }


def time_model_entry(preset: str, time_model: TimeModel) -> dict[str, Any]:
    """The `time_model` object: the preset's name and the speeds actually used."""
    return {
        "preset": preset,
        "prefill_tokens_per_s": time_model.prefill_tokens_per_s,
        "kv_bytes_per_token": time_model.kv_bytes_per_token,
        "restore_gb_per_s": time_model.restore_gb_per_s,
        "restore_latency_ms": time_model.restore_latency_s * 1000.0,
        "break_even_restore_gb_per_s": time_model.break_even_restore_gb_per_s,
    }


def public_prefix_run_entry(run: PublicPrefixRun) -> dict[str, Any]:
    """One run of the public-prefix workload: what the store holds, then the hit counters.

    `hit_rate` is `token_hit_rate` under the name the workload's contract uses.
    """
    result = run.result
    return {
        "stored_bytes": run.stored_bytes,
        "stored_blocks": result.store_blocks,
        "public_prefix_blocks": run.public_prefix_blocks,
        "private_blocks": run.private_blocks,
        "prefill_tokens": result.prefill_tokens,
        "hit_rate": result.token_hit_rate,
        "token_hit_rate": result.token_hit_rate,
        "local_hit_rate": result.local_hit_rate,
        "store_hit_rate": result.store_hit_rate,
        "requests": result.requests,
        "input_tokens": result.input_tokens,
        "reused_tokens": result.reused_tokens,
        "local_hit_tokens": result.local_hit_tokens,
        "store_hit_tokens": result.store_hit_tokens,
        "prefill_gpu_s": result.prefill_gpu_s,
        "restore_s": result.restore_s,
        "ttft_p50_s": result.ttft_p50_s,
        "ttft_p99_s": result.ttft_p99_s,
    }


def build_public_prefix_report(
    comparison: PublicPrefixComparison, options: PublicPrefixOptions
) -> dict[str, Any]:
    """The whole `--json` object of `--workload public-prefix`."""
    workload = comparison.workload
    with_public = comparison.with_public
    return {
        "workload": "public-prefix",
        "without_public": public_prefix_run_entry(comparison.without_public),
        "with_public": public_prefix_run_entry(with_public)
        | {
            "published_blocks": with_public.published_blocks,
            "publish_prefill_tokens": with_public.published_blocks * options.block_tokens,
        },
        "stored_bytes_ratio": comparison.stored_bytes_ratio,
        "prefill_tokens_ratio": comparison.prefill_tokens_ratio,
        "stored_bytes_saved": comparison.without_public.stored_bytes - with_public.stored_bytes,
        "block_bytes": with_public.block_bytes,
        "tenants": workload.tenants,
        "public_tokens": workload.public_tokens,
        "system_tokens": workload.system_tokens,
        "conversations": workload.conversations,
        "turns": workload.turns,
        "turn_tokens": workload.turn_tokens,
        "policy": options.policy,
        "replicas": options.replicas,
        "shared_store": True,
        "replica_capacity_tokens": _capacity_tokens(
            options.replica_capacity_blocks, options.block_tokens
        ),
        "block_tokens": options.block_tokens,
        "seed": workload.seed,
        "time_model": time_model_entry(options.preset, options.time_model),
    }


_HEADER = (
    f"{'policy':<16}{'replicas':>8}  {'store':<5}{'hit':>7}{'local':>7}{'store':>7}"
    f"{'%ideal':>8}{'ttft p50':>10}{'ttft p99':>10}{'prefill':>10}{'max/mean':>9}"
)


def format_table(results: Sequence[SimResult], ideal_token_hit_rate: float) -> str:
    """Aligned text: one row per configuration, rates in percent, times in seconds."""
    lines = [_HEADER]
    for result in results:
        config = result.config
        recovered = result.token_hit_rate / ideal_token_hit_rate if ideal_token_hit_rate else 1.0
        lines.append(
            f"{config.policy:<16}{config.replicas:>8}  {'yes' if config.shared_store else 'no':<5}"
            f"{result.token_hit_rate:>7.1%}{result.local_hit_rate:>7.1%}"
            f"{result.store_hit_rate:>7.1%}{recovered:>8.1%}"
            f"{result.ttft_p50_s:>9.3f}s{result.ttft_p99_s:>9.3f}s"
            f"{result.prefill_gpu_s:>9.0f}s{result.load_imbalance:>9.3f}"
        )
    lines.append(f"ideal (one unbounded cache): {ideal_token_hit_rate:.1%} token hit rate")
    return "\n".join(lines)


_PUBLIC_PREFIX_HEADER = (
    f"{'run':<16}{'stored blocks':>14}{'P blocks':>10}{'private':>9}{'stored GB':>11}"
    f"{'prefill tokens':>16}{'hit':>7}"
)


def format_public_prefix_table(
    comparison: PublicPrefixComparison, options: PublicPrefixOptions
) -> str:
    """Aligned text: the workload, one row per run, then the ratios (with over without)."""
    workload = comparison.workload
    without, with_public = comparison.without_public, comparison.with_public
    lines = [
        f"public-prefix: {workload.tenants} tenants x {workload.conversations} conversations"
        f" x {workload.turns} turns ({without.result.requests} requests), {options.policy}"
        f" over {options.replicas} replicas, unbounded shared store",
        f"P {workload.public_tokens:,} tokens ({with_public.published_blocks} whole"
        f" {options.block_tokens}-token blocks), system {workload.system_tokens:,},"
        f" turns ~{workload.turn_tokens:,}; {options.preset}"
        f" {options.time_model.kv_bytes_per_token:,} B/token, {without.block_bytes:,} B/block",
        _PUBLIC_PREFIX_HEADER,
        _public_prefix_row("without public", without),
        _public_prefix_row("with public", with_public),
        f"with / without: stored bytes {comparison.stored_bytes_ratio:.3f}"
        f" ({(without.stored_bytes - with_public.stored_bytes) / 1e9:,.2f} GB saved),"
        f" prefill tokens {comparison.prefill_tokens_ratio:.3f}",
        f"the publisher prefilled P's {with_public.published_blocks} blocks once"
        f" ({with_public.published_blocks * options.block_tokens:,} tokens, not counted above)",
    ]
    return "\n".join(lines)


def _public_prefix_row(name: str, run: PublicPrefixRun) -> str:
    result = run.result
    return (
        f"{name:<16}{result.store_blocks:>14,}{run.public_prefix_blocks:>10,}"
        f"{run.private_blocks:>9,}{run.stored_bytes / 1e9:>11.2f}"
        f"{result.prefill_tokens:>16,}{result.token_hit_rate:>7.1%}"
    )
