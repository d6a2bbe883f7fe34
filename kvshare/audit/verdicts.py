"""What the timing audit's statistics mean: a comparison of two arms' timings (ROC AUC
and the KS p-value, kvshare.audit.stats), whether it shows a channel (`leaks`),
whether a positive control separates, and the verdicts a report gives.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvshare.audit.stats import auc, ks_2samp

CONTROL_AUC = 0.7  # the control separates when its auc is at least this
MAX_SKEW = 0.1  # a comparison passes when |auc - 0.5| <= this ...
KS_ALPHA = 0.01  # ... and its KS p-value is at least this

PASS, CHANNEL, INCONCLUSIVE = "pass", "channel", "inconclusive"

Comparison = dict[str, Any]  # {"auc": float, "ks_p": float, "probes": int}
Report = dict[str, Any]


def compare(x: Sequence[int], y: Sequence[int]) -> Comparison:
    """auc of "x slower than y", the KS p-value, and the probes per arm."""
    return {"auc": auc(x, y), "ks_p": ks_2samp(x, y).pvalue, "probes": min(len(x), len(y))}


def leaks(c: Comparison) -> bool:
    return bool(abs(c["auc"] - 0.5) > MAX_SKEW or c["ks_p"] < KS_ALPHA)


def separates(c: Comparison) -> bool:
    return bool(c["auc"] >= CONTROL_AUC)


def worst(comparisons: Sequence[Comparison]) -> Comparison:
    """The most telling comparison: the largest |auc - 0.5| (ties: the smallest p)."""
    return max(comparisons, key=lambda c: (abs(c["auc"] - 0.5), -c["ks_p"]))


def weakest(comparisons: Sequence[Comparison]) -> Comparison:
    return min(comparisons, key=lambda c: c["auc"])
