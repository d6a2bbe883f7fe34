"""Present results: the contract JSON object and a human-readable table.

The JSON keys `results[].policy, replicas, shared_store, token_hit_rate,
local_hit_rate, store_hit_rate` and `ideal_token_hit_rate` are the docs/design.md §8
contract; every other key is an addition and may grow.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvshare.simulate.engine import SimResult
from kvshare.simulate.options import SimulateOptions


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
    time_model = options.time_model
    return {
        "results": [result_entry(result, ideal_token_hit_rate) for result in results],
        "ideal_token_hit_rate": ideal_token_hit_rate,
        "trace": str(options.trace),
        "block_tokens": options.block_tokens,
        "scenario": options.scenario,
        "seed": options.seed,
        "time_model": {
            "preset": options.preset,
            "prefill_tokens_per_s": time_model.prefill_tokens_per_s,
            "kv_bytes_per_token": time_model.kv_bytes_per_token,
            "restore_gb_per_s": time_model.restore_gb_per_s,
            "restore_latency_ms": time_model.restore_latency_s * 1000.0,
            "break_even_restore_gb_per_s": time_model.break_even_restore_gb_per_s,
        },
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
