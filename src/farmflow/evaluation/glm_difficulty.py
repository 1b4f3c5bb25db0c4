"""Instruction difficulty for AlpacaEval 2's length-controlled GLM, from a set of judged runs.

AlpacaEval (notebooks/instruction_difficulty.ipynb in tatsu-lab/alpaca_eval) fits one logistic
GLM jointly over every judged model m and instruction x, with soft labels p_mx in [0, 1]:

    logit P = a_m · tanh(Δ_mx / sd_m(Δ)) + b_m + u_x + c · not_gamed_m

(per-model length slope a_m and bias b_m, a per-instruction effect u_x, and a term that is 0
for the baseline's deliberately verbose/concise variants), with the same fitter as the
per-model fit (`glm_lc.fit_soft_logistic`: L1 on every coefficient, C by 5-fold grouped
cross-validation, liblinear). The instruction effects use treatment coding: the first
instruction is the reference level (u = 0) and the L1 penalty shrinks every u_x toward it.
The difficulty table is u; higher = the evaluated outputs win more often (the per-model fit's
coefficient takes the sign).

We centre the table to mean 0 over the instructions: its location is arbitrary (a shift is
absorbed by the per-model quality term) and the gamed-baseline stand-in (`glm_lc`) is
defined for a centred table. An instruction outside the table gets 0.

AlpacaEval's published numbers use one table fitted in early 2024 on the models of that time
(`instruction_difficulty.csv` of its Hugging Face dataset, not shipped with its code); this
module fits the table from the runs at hand, so every model's LC depends a little on the set
of runs the table came from.
"""

from __future__ import annotations

from typing import Hashable, Sequence

import numpy as np

from farmflow.evaluation.glm_lc import CS, N_SPLITS, fit_soft_logistic, length_feature


def joint_difficulty(
    runs: Sequence[dict], n_splits: int = N_SPLITS, Cs: np.ndarray = CS
) -> tuple[dict[Hashable, float], float]:
    """Difficulty of each instruction from judged runs (module doc). Returns (key → centred difficulty, chosen C).

    Each run: {"keys": instruction keys, "preferences": AlpacaEval preferences in [1, 2]
    (None/NaN rows left out), "len_1": reference lengths, "len_2": evaluated lengths, and
    optionally "gamed": True for a gamed variant of the baseline}.
    """
    from scipy import sparse

    runs = [r for r in runs if len(r["keys"])]
    if not runs:
        return {}, float("nan")
    keys = sorted({k for r in runs for k in r["keys"]}, key=lambda k: (str(type(k)), k))
    col_of = {k: i for i, k in enumerate(keys)}
    R = len(runs)
    n_cols = 2 * R + len(keys) - 1 + 1  # slopes, biases, instructions but the first, not_gamed
    rows, cols, vals, labels = [], [], [], []
    start = 0
    for m, run in enumerate(runs):
        pref = np.array([np.nan if v is None else float(v) for v in run["preferences"]])
        pref = np.where(pref == 0.0, 1.5, pref)
        keep = ~np.isnan(pref)
        t = length_feature(np.asarray(run["len_1"], dtype=float)[keep], np.asarray(run["len_2"], dtype=float)[keep])
        x = np.array([col_of[k] for k, ok in zip(run["keys"], keep) if ok])
        n = len(t)
        r = np.arange(start, start + n)
        rows += [r, r]
        cols += [np.full(n, m), np.full(n, R + m)]
        vals += [t, np.ones(n)]
        if not run.get("gamed", False):
            rows.append(r)
            cols.append(np.full(n, n_cols - 1))
            vals.append(np.ones(n))
        nz = x > 0
        rows.append(r[nz])
        cols.append(2 * R + x[nz] - 1)
        vals.append(np.ones(int(nz.sum())))
        labels.append(pref[keep] - 1.0)
        start += n
    X = sparse.csr_matrix((np.concatenate(vals), (np.concatenate(rows), np.concatenate(cols))), shape=(start, n_cols))
    coef, C = fit_soft_logistic(X, np.concatenate(labels), n_splits=n_splits, Cs=Cs)
    u = np.r_[0.0, coef[2 * R : 2 * R + len(keys) - 1]]
    u -= u.mean()
    return {k: float(u[i]) for k, i in col_of.items()}, C
