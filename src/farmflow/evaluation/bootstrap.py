"""Bootstrap intervals for win rates, paired differences and ranking correlations (numpy only).

Scores come as arrays of shape ``(K, n)``: K replicates of an experiment (seeds) × n evaluation prompts, the same
prompts in the same order in every array that is compared (a 1-d array is one replicate). A preference p in [1, 2]
enters as its score p − 1 (win 1, tie 0.5, loss 0), so a mean score × 100 is a win rate.

Every bootstrap draw resamples the prompts (n with replacement) and, with K > 1, the replicates (K with replacement),
with the *same* indices for every arm: a method and SFT are compared on the same prompts and the same replicate
(paired), so what the prompts have in common (an easy prompt is easy for both) cancels out. Resampling both levels
(a two-way bootstrap) counts the variance between seeds as well as between prompts; it is slightly conservative
(the prompt-level noise is counted in both levels). Intervals are percentile intervals.

Hand-checkable facts the tests pin down: identical arms give a difference of exactly 0 with a zero-width interval;
arms that differ by a constant c give exactly c, also zero-width.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

N_BOOT = 2000
"""Bootstrap draws per interval (the 2.5% and 97.5% percentiles move by ~0.1 SE between seeds at 2000)."""
Z95 = 1.959963984540054
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)
"""Student's t 97.5% quantiles for 1..10 degrees of freedom (above 10: `t975` interpolates toward 1.96)."""


def t975(df: int) -> float:
    """The 97.5% quantile of Student's t with `df` degrees of freedom (exact to 3 decimals up to 10, then ≤ 0.5%)."""
    if df < 1:
        return math.nan
    if df <= len(_T975):
        return _T975[df - 1]
    return Z95 + 2.4 / df  # 2.228 at 10, 2.08 at 20 (exact 2.086), 2.04 at 60 (2.000): within 2%


def as_matrix(scores: Sequence | np.ndarray) -> np.ndarray:
    """Scores as a float ``(K, n)`` array (a 1-d array is one replicate)."""
    a = np.asarray(scores, dtype=float)
    if a.ndim == 1:
        a = a[None, :]
    if a.ndim != 2 or a.shape[1] == 0:
        raise ValueError(f"scores must be (replicates, prompts) with at least one prompt, got shape {a.shape}")
    return a


def draws(k: int, n: int, n_boot: int = N_BOOT, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Bootstrap indices: replicates ``(n_boot, k)`` (all draws use replicate order 0..k-1 when k == 1) and prompts
    ``(n_boot, n)``."""
    rng = np.random.default_rng(seed)
    reps = rng.integers(0, k, size=(n_boot, k)) if k > 1 else np.zeros((n_boot, 1), dtype=int)
    return reps, rng.integers(0, n, size=(n_boot, n))


def resampled_means(scores: np.ndarray, reps: np.ndarray, prompts: np.ndarray) -> np.ndarray:
    """The mean of `scores` (K, n) under each bootstrap draw: shape (n_boot,)."""
    per_prompt = scores[reps].mean(axis=1)  # (n_boot, n): the drawn replicates' mean on each prompt
    return np.take_along_axis(per_prompt, prompts, axis=1).mean(axis=1)


def draws_interval(estimate: float, boot: np.ndarray, confidence: float) -> dict[str, float]:
    """`estimate` with the central `confidence` range of its draws `boot` (widened to hold the estimate): estimate,
    low, high, se (the draws' standard deviation)."""
    lo, hi = np.quantile(boot, [(1 - confidence) / 2, (1 + confidence) / 2])
    # a constant statistic must give a zero-width interval exactly (quantile interpolation can add rounding)
    lo, hi = (estimate, estimate) if np.ptp(boot) == 0 else (float(lo), float(hi))
    return {
        "estimate": float(estimate),
        "low": float(min(lo, estimate)),
        "high": float(max(hi, estimate)),
        "se": float(boot.std(ddof=1)) if len(boot) > 1 else math.nan,
    }


def bootstrap_mean(
    scores: Sequence | np.ndarray, n_boot: int = N_BOOT, confidence: float = 0.95, seed: int = 0
) -> dict[str, float]:
    """Mean of `scores` (K, n) with its bootstrap interval: estimate, low, high, se (the bootstrap SE)."""
    a = as_matrix(scores)
    reps, prompts = draws(*a.shape, n_boot=n_boot, seed=seed)
    return draws_interval(float(a.mean()), resampled_means(a, reps, prompts), confidence)


def paired_bootstrap(
    a: Sequence | np.ndarray,
    b: Sequence | np.ndarray,
    n_boot: int = N_BOOT,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """mean(a) − mean(b) with a paired bootstrap interval (module doc): estimate, low, high, se, and
    excludes_zero (1.0 when the interval lies entirely above or below 0, else 0.0).

    `a` and `b`: (K, n) scores on the same prompts, replicate r of `a` paired with replicate r of `b` (e.g. a method
    and the SFT model it was trained from, judged with the same seed)."""
    a, b = as_matrix(a), as_matrix(b)
    if a.shape != b.shape:
        raise ValueError(f"paired arms need the same (replicates, prompts) shape, got {a.shape} and {b.shape}")
    d = a - b
    reps, prompts = draws(*d.shape, n_boot=n_boot, seed=seed)
    out = draws_interval(float(d.mean()), resampled_means(d, reps, prompts), confidence)
    out["excludes_zero"] = float(out["low"] > 0 or out["high"] < 0)
    return out


def rankdata(x: np.ndarray) -> np.ndarray:
    """Ranks 1..m along the last axis, ties (NaNs among them) given their average rank (as scipy.stats.rankdata)."""
    x = np.asarray(x, dtype=float)
    m = x.shape[-1]
    order = np.argsort(x, axis=-1, kind="stable")
    xs = np.take_along_axis(x, order, axis=-1)
    same = (xs[..., 1:] == xs[..., :-1]) | (np.isnan(xs[..., 1:]) & np.isnan(xs[..., :-1]))  # as the one before
    at = np.broadcast_to(np.arange(m), xs.shape)
    first = np.maximum.accumulate(np.where(np.concatenate([np.zeros_like(same[..., :1]), same], -1), 0, at), -1)
    last = np.flip(
        np.minimum.accumulate(
            np.flip(np.where(np.concatenate([same, np.zeros_like(same[..., :1])], -1), m, at), -1), -1
        ),
        -1,
    )
    ranks = np.empty_like(x)
    np.put_along_axis(ranks, order, (first + last) / 2 + 1, axis=-1)  # a tie group's ranks first+1 … last+1
    return ranks


def pearson(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Pearson correlation along the last axis (NaN where either side is constant)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    xc, yc = x - x.mean(axis=-1, keepdims=True), y - y.mean(axis=-1, keepdims=True)
    denom = np.sqrt((xc**2).sum(axis=-1) * (yc**2).sum(axis=-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (xc * yc).sum(axis=-1) / np.where(denom > 0, denom, 1.0), np.nan)


def spearman(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Spearman rank correlation along the last axis: Pearson of the (average-tie) ranks."""
    return pearson(rankdata(x), rankdata(y))


def ranking_agreement(
    arm_x: Sequence | np.ndarray,
    arm_y: Sequence | np.ndarray,
    n_boot: int = N_BOOT,
    confidence: float = 0.95,
    seed: int = 0,
) -> dict[str, float]:
    """Spearman and Pearson between two arms' method win rates, with bootstrap intervals over prompts (and replicates).

    `arm_x`, `arm_y`: scores of shape (methods, K, n), the same methods, replicates and prompts in both (the same
    outputs judged by two annotators). Each draw resamples prompts and replicates once for every method and both
    arms. Returns spearman, spearman_low, spearman_high, pearson, pearson_low, pearson_high, methods."""
    x, y = np.asarray(arm_x, dtype=float), np.asarray(arm_y, dtype=float)
    if x.ndim == 2:
        x, y = x[:, None, :], y[:, None, :]
    if x.shape != y.shape or x.ndim != 3 or x.shape[0] < 2:
        raise ValueError(f"arms must be (methods ≥ 2, replicates, prompts) of one shape, got {x.shape} and {y.shape}")
    m, k, n = x.shape
    reps, prompts = draws(k, n, n_boot=n_boot, seed=seed)
    bx = np.stack([resampled_means(x[i], reps, prompts) for i in range(m)], axis=1)  # (n_boot, methods)
    by = np.stack([resampled_means(y[i], reps, prompts) for i in range(m)], axis=1)
    mx, my = x.mean(axis=(1, 2)), y.mean(axis=(1, 2))
    out: dict[str, float] = {"methods": float(m)}
    for name, fn in (("spearman", spearman), ("pearson", pearson)):
        boot = fn(bx, by)
        boot = boot[~np.isnan(boot)]
        point = float(fn(mx, my))
        iv = draws_interval(point, boot, confidence) if len(boot) else {"low": math.nan, "high": math.nan}
        out |= {name: point, f"{name}_low": iv["low"], f"{name}_high": iv["high"]}
    return out


def resolvable_difference(se_difference: float, confidence: float = 0.95) -> float:
    """The smallest difference an interval of this SE tells from 0: its half-width, z·SE (1.96·SE at 95%)."""
    z = {0.95: Z95, 0.9: 1.6448536269514722, 0.99: 2.5758293035489004}.get(confidence, Z95)
    return z * se_difference


def eval_size_for(target: float, n: int, half_width: float) -> int:
    """Evaluation prompts needed for a 95% half-width of `target` when `n` prompts gave `half_width`
    (a half-width shrinks as 1/sqrt(n))."""
    if not (half_width > 0 and target > 0 and n > 0):
        return n
    return int(math.ceil(n * (half_width / target) ** 2))
