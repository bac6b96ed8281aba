"""Statistics across repeated runs (seeds): a metric's mean with its 95 % confidence interval, and paired
comparisons of two arms run on the same seeds (benchmarks/introspection.py; docs/introspection.md).

    mean_ci        mean ± t_{(1+level)/2, k−1} · s / √k   (Student's t; s the sample standard deviation)
    paired_t       t = mean(d) / (s_d / √k) on the per-seed differences d = a − b, df = k − 1, two-sided p
    sign_flip      exact permutation test of the same differences: under "no difference" each d_i's sign is a fair
                   coin, so p = share of the 2^k sign patterns whose |mean| is at least the observed |mean(d)|

The t distribution comes from scipy when it is installed, else from `t_cdf` / `t_ppf` here (the regularised
incomplete beta function by its continued fraction, and bisection); tests check both against scipy and tables.
NaN values (a metric undefined on a seed, e.g. AUROC without a wrong answer) are left out, pairwise.
"""
from __future__ import annotations

import itertools
import math

import numpy as np

LEVEL = 0.95
MAX_EXACT = 20          # sign_flip enumerates 2^k patterns


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularised incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        for aa in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularised incomplete beta function, for a, b > 0 and 0 ≤ x ≤ 1."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def _scipy_t():
    """scipy's t distribution, or None without scipy (not a dependency of prisma-jax)."""
    try:
        from scipy import stats
    except ImportError:
        return None
    return stats.t


def t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with `df` degrees of freedom: 1 − ½ I_{df/(df+t²)}(df/2, ½) for t ≥ 0."""
    dist = _scipy_t()
    return _t_cdf(t, df) if dist is None else float(dist.cdf(t, df))


def _t_cdf(t: float, df: float) -> float:
    if math.isinf(t):
        return 1.0 if t > 0 else 0.0
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_ppf(q: float, df: float) -> float:
    """The q-quantile of Student's t with `df` degrees of freedom."""
    dist = _scipy_t()
    return _t_ppf(q, df) if dist is None else float(dist.ppf(q, df))


def _t_ppf(q: float, df: float) -> float:
    if not 0.0 < q < 1.0:
        raise ValueError(f"a quantile needs 0 < q < 1, got {q}")
    if q < 0.5:
        return -_t_ppf(1.0 - q, df)
    lo, hi = 0.0, 1.0
    while _t_cdf(hi, df) < q:
        hi *= 2.0
    for _ in range(200):                        # bisection to float precision
        mid = 0.5 * (lo + hi)
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if _t_cdf(mid, df) < q else (lo, mid)
    return 0.5 * (lo + hi)


def _finite(x) -> np.ndarray:
    x = np.asarray([np.nan if v is None else v for v in x], np.float64)
    return x[np.isfinite(x)]


def mean_ci(values, level: float = LEVEL) -> dict:
    """{mean, half (the CI's half-width), lo, hi, sd, n} of the finite values; half is NaN below 2 values."""
    x = _finite(values)
    n = len(x)
    mean = float(x.mean()) if n else float("nan")
    sd = float(x.std(ddof=1)) if n > 1 else float("nan")
    half = t_ppf(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n) if n > 1 else float("nan")
    return {"mean": mean, "half": half, "lo": mean - half, "hi": mean + half, "sd": sd, "n": n}


def _pairs(a, b) -> np.ndarray:
    a = np.asarray([np.nan if v is None else v for v in a], np.float64)
    b = np.asarray([np.nan if v is None else v for v in b], np.float64)
    if a.shape != b.shape:
        raise ValueError(f"paired values need equal lengths, got {len(a)} and {len(b)}")
    d = a - b
    return d[np.isfinite(d)]


def paired_t(a, b) -> dict:
    """Paired t-test of a against b (same seeds, element by element): {mean_diff, t, df, p} (p two-sided).
    Differences all equal: t = ±inf and p = 0, or t NaN and p = 1 when they are all 0."""
    d = _pairs(a, b)
    n = len(d)
    if n < 2:
        return {"mean_diff": float(d.mean()) if n else float("nan"), "t": float("nan"), "df": n - 1,
                "p": float("nan"), "n": n}
    mean, sd = float(d.mean()), float(d.std(ddof=1))
    if sd == 0.0:
        t = float("nan") if mean == 0.0 else math.copysign(math.inf, mean)
        return {"mean_diff": mean, "t": t, "df": n - 1, "p": 1.0 if mean == 0.0 else 0.0, "n": n}
    t = mean / (sd / math.sqrt(n))
    return {"mean_diff": mean, "t": t, "df": n - 1, "p": 2.0 * (1.0 - t_cdf(abs(t), n - 1)), "n": n}


def sign_flip(a, b) -> dict:
    """Exact two-sided sign-flip permutation test of the paired differences d = a − b: {mean_diff, p, n}.
    p = #{s ∈ {±1}^k : |Σ s_i d_i| ≥ |Σ d_i|} / 2^k (sums equal to float round-off count as ties, i.e. ≥).
    With k pairs the smallest p possible is 2 / 2^k (1/16 at k = 5)."""
    d = _pairs(a, b)
    n = len(d)
    if n > MAX_EXACT:
        raise ValueError(f"sign_flip enumerates 2^k sign patterns; k = {n} is above {MAX_EXACT}")
    if n == 0:
        return {"mean_diff": float("nan"), "p": float("nan"), "n": 0}
    signs = np.array(list(itertools.product((1.0, -1.0), repeat=n)))
    sums = np.abs(signs @ d)
    observed = abs(float(d.sum()))
    tol = 1e-12 * max(1.0, float(np.abs(d).sum()))
    return {"mean_diff": float(d.mean()), "p": float(np.mean(sums >= observed - tol)), "n": n}


def compare(a, b, level: float = LEVEL) -> dict:
    """Two arms on the same seeds: each arm's `mean_ci`, the differences' `mean_ci`, `paired_t` and `sign_flip`."""
    d = _pairs(a, b)
    return {"a": mean_ci(a, level), "b": mean_ci(b, level), "diff": mean_ci(d, level),
            "paired_t": paired_t(a, b), "sign_flip": sign_flip(a, b)}
