"""Two-sample statistics for the timing audit, in plain Python (no scipy on a server).

`ks_2samp(x, y)`: the two-sample Kolmogorov-Smirnov statistic D = sup |F_x - F_y| over
the pooled values (ties: both empirical distributions step past a tied value before
they are compared), and its two-sided p-value from the asymptotic Kolmogorov
distribution with the usual small-sample correction (Stephens 1970; Numerical Recipes
`probks`):

    en = sqrt(n*m / (n + m)),  p = Q((en + 0.12 + 0.11/en) * D),
    Q(t) = 2 * sum_{j>=1} (-1)^(j-1) exp(-2 j^2 t^2)                    (t >= 1.18)
         = 1 - sqrt(2 pi)/t * sum_{j>=1} exp(-(2j-1)^2 pi^2 / (8 t^2))    (t < 1.18)

Both series are the same function; each is used where it converges in a few terms.
This tracks scipy's `ks_2samp(method="asymp")` (kstwo.sf(D, round(n*m/(n+m)))) to
within about 0.02 for the sample sizes the audit uses
(tests/unit/kvshare/audit/test_audit_stats.py).

`auc(x, y)`: the ROC area of "x is larger than y", P(X > Y) + P(X = Y)/2, from the
Mann-Whitney U with midranks for ties. 0.5: indistinguishable; 1.0: every x larger;
0.0: every x smaller (as telling as 1.0: a verdict reads |auc - 0.5|).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

SERIES_SWITCH = 1.18  # where the two series of Q meet (each needs a few terms there)
SERIES_TERMS = 100
SERIES_EPS = 1e-16


@dataclass(frozen=True)
class KsResult:
    statistic: float
    pvalue: float


def ks_statistic(x: Sequence[float], y: Sequence[float]) -> float:
    """sup over t of |F_x(t) - F_y(t)|; both samples must be non-empty."""
    _check(x, y)
    a, b = sorted(x), sorted(y)
    n, m = len(a), len(b)
    i = j = 0
    d = 0.0
    while i < n and j < m:
        value = min(a[i], b[j])
        while i < n and a[i] == value:  # step past every tie in both samples first
            i += 1
        while j < m and b[j] == value:
            j += 1
        d = max(d, abs(i / n - j / m))
    return d


def kolmogorov_sf(t: float) -> float:
    """Q(t) = P(K > t) for the Kolmogorov distribution K (module docstring)."""
    if t <= 0.0:
        return 1.0
    if t < SERIES_SWITCH:
        s = 0.0
        for j in range(1, SERIES_TERMS):
            term = math.exp(-((2 * j - 1) ** 2) * math.pi**2 / (8.0 * t * t))
            s += term
            if term < SERIES_EPS:
                break
        return _clip(1.0 - math.sqrt(2.0 * math.pi) / t * s)
    s = 0.0
    for j in range(1, SERIES_TERMS):
        term = math.exp(-2.0 * j * j * t * t)
        s += term if j % 2 else -term
        if term < SERIES_EPS:
            break
    return _clip(2.0 * s)


def ks_2samp(x: Sequence[float], y: Sequence[float]) -> KsResult:
    """Two-sided two-sample KS test: D and its asymptotic p-value (module docstring)."""
    d = ks_statistic(x, y)
    en = math.sqrt(len(x) * len(y) / (len(x) + len(y)))
    return KsResult(d, kolmogorov_sf((en + 0.12 + 0.11 / en) * d))


def auc(x: Sequence[float], y: Sequence[float]) -> float:
    """P(X > Y) + P(X = Y)/2 = U_x / (n m), U_x from midranks of the pooled sample."""
    _check(x, y)
    pooled = sorted([(v, 0) for v in x] + [(v, 1) for v in y])
    rank_sum_x = 0.0
    start = 0
    while start < len(pooled):
        end = start
        while end < len(pooled) and pooled[end][0] == pooled[start][0]:
            end += 1
        midrank = (start + 1 + end) / 2.0  # ranks start+1 .. end share their mean
        rank_sum_x += midrank * sum(1 for _, side in pooled[start:end] if side == 0)
        start = end
    n, m = len(x), len(y)
    u_x = rank_sum_x - n * (n + 1) / 2.0
    return u_x / (n * m)


def _check(x: Sequence[float], y: Sequence[float]) -> None:
    if not x or not y:
        raise ValueError(f"both samples need values (got {len(x)} and {len(y)})")


def _clip(p: float) -> float:
    return min(1.0, max(0.0, p))
