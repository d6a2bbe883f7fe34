"""`--plot FILE`: hit rate and TTFT against replica count, per policy, store on and off.

matplotlib is imported inside `write_plot`, so `kvshare simulate` without `--plot`
(and `kvshare --help`) never loads it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvshare.simulate.engine import SimResult
from kvshare.simulate.errors import SimulateInputError

_PANELS = (
    ("token_hit_rate", "token hit rate", False),
    ("ttft_p50_s", "TTFT p50 (s)", True),
    ("ttft_p99_s", "TTFT p99 (s)", True),
)


def _series(
    results: Sequence[SimResult],
) -> dict[tuple[str, bool], list[SimResult]]:
    """Results grouped by (policy, store), each sorted by replica count."""
    grouped: dict[tuple[str, bool], list[SimResult]] = {}
    for result in results:
        grouped.setdefault((result.config.policy, result.config.shared_store), []).append(result)
    for points in grouped.values():
        points.sort(key=lambda result: result.config.replicas)
    return grouped


def write_plot(
    results: Sequence[SimResult], ideal_token_hit_rate: float, path: Path, title: str
) -> None:
    """Draw one PNG with a panel per metric; solid lines with the store, dashed without."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(_PANELS), figsize=(15, 5.4), constrained_layout=True)
    grouped = _series(results)
    replica_counts = sorted({result.config.replicas for result in results})
    for axis, panel in zip(axes, _PANELS, strict=True):
        _draw_panel(axis, panel, grouped, replica_counts)
    axes[0].axhline(ideal_token_hit_rate, color="black", linestyle=":", label="ideal")
    axes[0].set_ylim(0, 1)
    handles, labels = axes[0].get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncol=5, fontsize="small")
    figure.suptitle(title)
    try:
        figure.savefig(path, dpi=110)
    except OSError as error:
        raise SimulateInputError(
            f"cannot write plot {path} ({error.strerror}); pass --plot with a writable path"
        ) from None
    finally:
        plt.close(figure)


def _draw_panel(
    axis: Any,
    panel: tuple[str, str, bool],
    grouped: dict[tuple[str, bool], list[SimResult]],
    replica_counts: list[int],
) -> None:
    metric, label, log_scale = panel
    policies = list(dict.fromkeys(policy for policy, _ in grouped))
    for (policy, shared_store), points in grouped.items():
        axis.plot(
            [point.config.replicas for point in points],
            [getattr(point, metric) for point in points],
            color=f"C{policies.index(policy) % 10}",
            linestyle="-" if shared_store else "--",
            marker="o" if shared_store else "x",
            label=f"{policy} {'+ store' if shared_store else 'local only'}",
        )
    axis.set_xscale("log", base=2)
    axis.set_xticks(replica_counts, [str(count) for count in replica_counts])
    axis.set_xlabel("replicas")
    axis.set_ylabel(label)
    axis.grid(True, alpha=0.3)
    if log_scale:
        axis.set_yscale("log")
