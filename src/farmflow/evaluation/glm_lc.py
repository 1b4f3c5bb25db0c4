"""AlpacaEval 2's length-controlled win rate (Dubois et al. 2024, "Length-Controlled AlpacaEval";
alpaca_eval's GLM `length_controlled_v1`), our own implementation of its procedure.

The judge's preference p in [0, 1] for the evaluated output (AlpacaEval preference − 1) on
instruction x is modelled, per evaluated model, by a logistic GLM without intercept:

    logit P = w_len · tanh(Δ_x / sd(Δ)) + w_diff · d_x + w_model · not_gamed

* Δ_x = characters of the reference output − characters of the evaluated output (the order
  AlpacaEval uses: a longer evaluated output gives a negative Δ and w_len < 0), divided by its
  sample standard deviation (n − 1) over the model's rows;
* d_x is the instruction difficulty, fixed before the model is fitted (`glm_difficulty`);
* not_gamed is 1 on the model's rows and 0 on the gamed-baseline rows (below), so w_model is
  the model's quality and the gamed rows only inform w_len and w_diff.

The fit (sklearn `LogisticRegression`, liblinear, L1 on all three coefficients, as alpaca_eval):
soft labels by duplicating each row, once with label 1 and weight p·s, once with label 0 and
weight (1 − p)·s (s = the row's sample weight); the inverse penalty C is chosen among 10
values, logspace(−4, 4), by 5-fold cross-validation with both copies of a row in the same fold,
scored by the weighted soft log loss; then refitted on all rows with that C.

Gamed-baseline regularization: the rows of the baseline's deliberately verbose and concise
variants judged against the baseline join every model's fit with not_gamed = 0 and sample
weight λ/2 each (λ = 0.2): they pull w_len and w_diff toward what pure length gaming does,
which is what keeps a model that games length from buying LC win rate. When the gamed
variants' judgments are not available, a stand-in takes their place (`gamed_standin`): for each
instruction two rows with tanh(∓ len_ref / sd(len_ref)) — what any pure rescaling of the
reference output gives after standardization — and soft labels
sigmoid(GAMED_LEN_COEF · t + GAMED_DIFF_COEF · d), the length and difficulty slopes of
AlpacaEval 2's published fits of gpt4_1106_preview_verbose and _concise (mean of the two).

LC win rate = 100 · mean over the model's rows of the prediction at Δ = 0 with not_gamed = 1:
sigmoid(w_model + w_diff · d_x). Its standard error is the standard error of the mean of those
per-instruction predictions (n − 1), the way AlpacaEval's win-rate SE treats preferences; it
does not include the uncertainty of the fitted coefficients.
"""

from __future__ import annotations

import math
from typing import Iterable

import numpy as np

CS = np.logspace(-4, 4, 10)  # sklearn LogisticRegressionCV's default grid, as alpaca_eval uses it
N_SPLITS = 5  # alpaca_eval: GroupKFold(5)
GAMED_LAMBDA = 0.2  # alpaca_eval `regularize_to_baseline_lambda`
GAMED_LEN_COEF = -1.61  # mean length slope of the published gpt4_1106_preview_verbose/_concise fits
GAMED_DIFF_COEF = 0.76  # mean difficulty slope of the same fits
SEED = 123  # liblinear's coordinate order (alpaca_eval's random_state)
PARALLEL_MIN_ROWS = 20_000
"""Labelled rows (both copies of each, as fitted) from which the cross-validation fits run in worker processes,
one per CPU (joblib's loky). A joint difficulty fit over 8 runs of 1,860 instructions (~30,000 rows) then takes half
as long on 2 cores; smaller fits take milliseconds each, less than handing them to a worker. Processes, not
threads: liblinear keeps its random state in a process global. Every fit seeds it, so results are the same bit for
bit either way."""


def sigmoid(x: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -x))


def soft_log_loss(p: np.ndarray, q: np.ndarray, weight: np.ndarray) -> float:
    """Mean of weight · (log loss of the soft label p under the predicted probability q)."""
    q = np.clip(q, 1e-15, 1 - 1e-15)
    return float(-np.mean(weight * (p * np.log(q) + (1 - p) * np.log(1 - q))))


def _liblinear(X, y: np.ndarray, weight: np.ndarray, C: float) -> np.ndarray:
    from sklearn.linear_model import LogisticRegression

    model = LogisticRegression(C=C, l1_ratio=1.0, solver="liblinear", fit_intercept=False, random_state=SEED)
    for label in (0.0, 1.0):  # a class with no weight at all (every label 0 or every label 1): liblinear drops it
        absent = y == label  # and prints a warning to stdout per fit; a negligible weight keeps it present
        if absent.any() and not weight[absent].any():
            weight = np.where(absent, 1e-9, weight)
    model.fit(X, y, sample_weight=weight)
    return model.coef_[0]


def _held_out_loss(X_train, y_train, w_train, X_test, p_test, w_test, C: float) -> float:
    """Soft log loss on a held-out fold of the fit at C on the other folds."""
    return soft_log_loss(p_test, sigmoid(X_test @ _liblinear(X_train, y_train, w_train, C)), w_test)


def _map(fn, args: Iterable[tuple], parallel: bool) -> list:
    """fn(*a) for each a, in order: in this process, or in worker processes (PARALLEL_MIN_ROWS)."""
    if not parallel:
        return [fn(*a) for a in args]
    from joblib import Parallel, cpu_count, delayed

    return Parallel(n_jobs=cpu_count())(delayed(fn)(*a) for a in args)


def fit_soft_logistic(
    X, p: np.ndarray, sample_weight: np.ndarray | None = None, n_splits: int = N_SPLITS, Cs: np.ndarray = CS
) -> tuple[np.ndarray, float]:
    """L1 logistic regression without intercept on soft labels p in [0, 1], C by grouped CV (module doc).

    X: dense array or scipy sparse matrix (n × k). Returns (coefficients, chosen C). With one C,
    or n_splits = 0: the fit at the first C alone; fewer rows than folds: one row per fold.
    """
    from scipy import sparse
    from sklearn.model_selection import GroupKFold

    p = np.asarray(p, dtype=float)
    n = len(p)
    n_splits = min(n_splits, n)  # fewer rows than folds: one row per fold
    w = np.ones(n) if sample_weight is None else np.asarray(sample_weight, dtype=float)
    Xd = sparse.vstack([X, X], format="csr") if sparse.issparse(X) else np.vstack([X, X])
    yd = np.r_[np.ones(n), np.zeros(n)]
    sw, pd, wd = np.r_[p * w, (1 - p) * w], np.r_[p, p], np.r_[w, w]
    if n_splits >= 2 and len(Cs) > 1:
        folds = GroupKFold(n_splits).split(Xd, yd, np.r_[np.arange(n), np.arange(n)])
        fits = ((Xd[tr], yd[tr], sw[tr], Xd[te], pd[te], wd[te], C) for tr, te in folds for C in Cs)  # made as used
        losses = _map(_held_out_loss, fits, parallel=Xd.shape[0] >= PARALLEL_MIN_ROWS)
        scores = np.asarray(losses).reshape(-1, len(Cs)).sum(axis=0)
        C = float(Cs[int(np.argmin(scores))])  # first of the best, as LogisticRegressionCV's argmax
    else:
        C = float(np.atleast_1d(Cs)[0])
    return _liblinear(Xd, yd, sw, C), C


def length_feature(len_reference, len_model) -> np.ndarray:
    """tanh((len_reference − len_model) / sd), sd the sample sd over the rows (0 where it does not vary)."""
    d = np.asarray(len_reference, dtype=float) - np.asarray(len_model, dtype=float)
    sd = float(d.std(ddof=1)) if len(d) > 1 else 0.0
    return np.tanh(d / sd) if sd > 0 else np.zeros_like(d)


def gamed_standin(len_reference, difficulty) -> tuple[np.ndarray, np.ndarray]:
    """Stand-in gamed-baseline rows (X with columns length, difficulty, not_gamed = 0; soft labels), module doc."""
    ref = np.asarray(len_reference, dtype=float)
    d = np.asarray(difficulty, dtype=float)
    sd = float(ref.std(ddof=1)) if len(ref) > 1 else 0.0
    t = np.tanh(ref / sd) if sd > 0 else np.zeros_like(ref)
    Xs, ps = [], []
    for sign in (-1.0, 1.0):  # verbose: the variant is longer (Δ < 0); concise: shorter
        Xs.append(np.column_stack([sign * t, d, np.zeros_like(t)]))
        ps.append(sigmoid(GAMED_LEN_COEF * sign * t + GAMED_DIFF_COEF * d))
    return np.vstack(Xs), np.concatenate(ps)


def gamed_rows(variants: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """Gamed-baseline rows from the judged variants: each {"preferences", "len_1", "len_2", "difficulty"}."""
    Xs, ps = [], []
    for v in variants:
        t = length_feature(v["len_1"], v["len_2"])
        Xs.append(np.column_stack([t, np.asarray(v["difficulty"], dtype=float), np.zeros_like(t)]))
        ps.append(np.asarray(v["preferences"], dtype=float) - 1.0)
    return np.vstack(Xs), np.concatenate(ps)


def glm_lc(
    preferences,
    len_reference,
    len_model,
    difficulty=None,
    gamed: tuple[np.ndarray, np.ndarray] | None = None,
    gamed_lambda: float = GAMED_LAMBDA,
    n_splits: int = N_SPLITS,
) -> dict[str, float]:
    """LC win rate of one model (module doc); rows with a missing preference (None/NaN) are left out.

    preferences: AlpacaEval preferences in [1, 2] (0, a tie in old files, reads as 1.5);
    difficulty: per row (None: 0 everywhere); gamed: (X, p) from `gamed_rows`, or None for the
    stand-in (`gamed_standin`), or gamed_lambda = 0 for no gamed-baseline regularization.
    Returns lc_win_rate, lc_standard_error, lc_length_coef, lc_difficulty_coef, lc_model_coef, lc_C.
    """
    pref = np.array([math.nan if v is None else float(v) for v in preferences])
    pref = np.where(pref == 0.0, 1.5, pref)
    keep = ~np.isnan(pref)
    if not keep.any():
        raise ValueError("no valid preferences to compute a length-controlled win rate from")
    ref, mod = np.asarray(len_reference, dtype=float)[keep], np.asarray(len_model, dtype=float)[keep]
    d = np.zeros(len(ref)) if difficulty is None else np.asarray(difficulty, dtype=float)[keep]
    p = pref[keep] - 1.0
    X = np.column_stack([length_feature(ref, mod), d, np.ones(len(p))])
    weight = np.ones(len(p))
    if gamed_lambda:
        Xg, pg = gamed if gamed is not None else gamed_standin(ref, d)
        X, p = np.vstack([Xg, X]), np.r_[pg, p]
        weight = np.r_[np.full(len(pg), gamed_lambda / 2), weight]
    coef, C = fit_soft_logistic(X, p, weight, n_splits)
    lc = sigmoid(coef[2] + coef[1] * d)
    se = float(lc.std(ddof=1) / math.sqrt(len(lc))) if len(lc) > 1 else math.nan
    return {
        "lc_win_rate": 100.0 * float(lc.mean()),
        "lc_standard_error": 100.0 * se,
        "lc_length_coef": float(coef[0]),
        "lc_difficulty_coef": float(coef[1]),
        "lc_model_coef": float(coef[2]),
        "lc_C": C,
    }
