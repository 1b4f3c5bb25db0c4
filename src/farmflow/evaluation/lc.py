"""Length-controlled win rate: AlpacaEval 2's procedure (the default) or a ridge variant.

`method="alpaca_eval"` (default) is AlpacaEval 2's GLM (`glm_lc`, `glm_difficulty`; its numbers
reproduce the published leaderboard, docs/evaluation.md). `method="ridge"` is the estimator
below: the same counterfactual with an L2-penalized (MAP) fit, a standardized difficulty and
leave-one-run-out difficulty tables, meant for a few runs where a table fitted on the run itself
would hand its own outcomes back. The difficulty tables of the two methods are on different
scales (alpaca_eval: raw per-instruction effects, higher = easier; ridge: standardized, higher =
harder); use one method throughout.

Ridge: an automatic judge prefers longer outputs. To ask "what would the win rate be if the
evaluated outputs had the reference's length?", fit a logistic model of the judge's
preference y in [0, 1] (preference − 1: 1 = the evaluated output wins) on instruction x:

    logit P(y = 1) = θ + φ · tanh(Δlen_x / sd(Δlen)) + ψ · γ_x

* Δlen_x = characters of the evaluated output − characters of the reference output,
  standardized by its standard deviation over the run (tanh keeps huge differences bounded);
* γ_x is the difficulty of instruction x, fixed before the run is fitted (below);
* θ (model quality), φ (length effect) and ψ (how much difficulty matters for this model)
  belong to the run. θ is free; φ and ψ get an L2 penalty (a Gaussian prior, MAP),
  `penalty` (default 0.2, prior sd ≈ 2.2 logits).

The LC win rate is the model's prediction with the length difference set to zero,
averaged over the run's instructions: 100 · mean_x sigmoid(θ + ψ · γ_x).

Instruction difficulty comes from the other annotated runs available (several models judged
against the same references): logit P(y_rx = 1) = θ_r + φ_r · tanh(Δlen_rx / sd_r) + u_x,
with L2 penalties on φ_r (`penalty`) and u_x (`difficulty_penalty`, default 1: prior sd 1
logit). The per-instruction effects are standardized to mean 0 and sd 1 over instructions
and negated (γ_x = −z(u_x) enters the run's model: higher = harder; ψ is in logits per sd of difficulty);
instructions outside the table get γ_x = 0 (average difficulty). A run's own labels never
enter its difficulty table (leave-one-run-out): with one label per instruction, γ_x fitted on
the run itself is a shrunk copy of its own outcome, and ψ · γ_x then hands the outcome back,
undoing most of the length control (a simulated run whose true LC is 41 came out at 55, near
its raw 56.5). Without other runs, γ = 0: the length term alone.

Standard error: the delta method with influence functions. The estimate is a mean of
per-row predictions at the fitted parameters, so its per-row influence is the row's
prediction minus the mean (instruction sampling) plus the row's score pushed through the
inverse Hessian (parameter uncertainty, a sandwich estimate that stays valid for
fractional preferences). The difficulty table is treated as fixed.

The fit is penalized Newton–Raphson with step halving. The per-instruction difficulty
block of the Hessian is diagonal, so each step solves a small dense system (Schur
complement) whatever the number of instructions.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from farmflow.evaluation.stats import parse_preference

METHODS = ("alpaca_eval", "ridge")

PENALTY = 0.2  # L2 on the length and difficulty coefficients of a run (prior sd ≈ 2.2 logits)
DIFFICULTY_PENALTY = 1.0  # L2 on the per-instruction effects (prior sd 1 logit)
INTERCEPT_PENALTY = 1e-6  # keeps θ finite when a run wins (or loses) every instruction


def _nll(eta: np.ndarray, y: np.ndarray) -> float:
    return float(np.sum(np.logaddexp(0.0, eta) - y * eta))


def fit_logistic(
    X: np.ndarray,
    y: np.ndarray,
    penalty: np.ndarray,
    groups: np.ndarray | None = None,
    n_groups: int = 0,
    group_penalty: float = 1.0,
    max_iter: int = 200,
    tol: float = 1e-10,
) -> tuple[np.ndarray, np.ndarray]:
    """Penalized logistic regression with soft labels y in [0, 1], by Newton–Raphson.

    logit = X @ w + g[groups]; loss = Σ log-loss + ½ Σ penalty·w² + ½ group_penalty·Σ g².
    Returns (w, g); g is empty without groups.
    """
    n, p = X.shape
    w, g = np.zeros(p), np.zeros(n_groups)
    has_groups = groups is not None and n_groups > 0

    def eta_of(w_: np.ndarray, g_: np.ndarray) -> np.ndarray:
        return X @ w_ + (g_[groups] if has_groups else 0.0)

    def loss_of(w_: np.ndarray, g_: np.ndarray) -> float:
        return _nll(eta_of(w_, g_), y) + 0.5 * float(penalty @ w_**2) + 0.5 * group_penalty * float(g_ @ g_)

    loss = loss_of(w, g)
    for _ in range(max_iter):
        q = 1.0 / (1.0 + np.exp(-eta_of(w, g)))
        r, h = q - y, q * (1.0 - q)
        grad_w = X.T @ r + penalty * w
        A = (X * h[:, None]).T @ X + np.diag(penalty)
        if has_groups:
            grad_g = np.bincount(groups, r, n_groups) + group_penalty * g
            D = np.bincount(groups, h, n_groups) + group_penalty
            C = np.stack([np.bincount(groups, h * X[:, j], n_groups) for j in range(p)])  # p × G
            S = A - (C / D) @ C.T
            dw = np.linalg.solve(S, grad_w - C @ (grad_g / D))
            dg = (grad_g - C.T @ dw) / D
        else:
            dw, dg = np.linalg.solve(A, grad_w), np.zeros(0)
        step = 1.0
        while True:  # step halving: the penalized loss never increases
            w_new, g_new = w - step * dw, g - step * dg
            new = loss_of(w_new, g_new)
            if new <= loss + 1e-12 or step < 1e-6:
                break
            step /= 2
        w, g, loss = w_new, g_new, new
        if max(np.abs(step * dw).max(initial=0.0), np.abs(step * dg).max(initial=0.0)) < tol:
            break
    return w, g


def length_feature(delta_len: Sequence[float]) -> np.ndarray:
    """tanh of the length difference standardized by its sd over the run (0 if it never varies)."""
    d = np.asarray(delta_len, dtype=float)
    sd = float(d.std()) if len(d) > 1 else 0.0
    return np.tanh(d / sd) if sd > 0 else np.zeros_like(d)


def _clean(
    instructions: Sequence[str], preferences: Sequence[object], delta_len: Sequence[float]
) -> tuple[list[str], np.ndarray, np.ndarray]:
    xs, y, d, _ = _clean_kept(instructions, preferences, delta_len)
    return xs, y, d


def _clean_kept(
    instructions: Sequence[str], preferences: Sequence[object], delta_len: Sequence[float]
) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Rows with a usable preference: instructions, labels in [0, 1], length differences, kept mask."""
    parsed = [parse_preference(p) for p in preferences]
    kept = np.array([p is not None for p in parsed], dtype=bool)
    rows = [(x, p - 1.0, float(d)) for x, p, d in zip(instructions, parsed, delta_len, strict=True) if p is not None]
    return [r[0] for r in rows], np.array([r[1] for r in rows]), np.array([r[2] for r in rows]), kept


def _check(method: str) -> None:
    if method not in METHODS:
        raise ValueError(f"unknown LC method {method!r}; use one of {', '.join(METHODS)}")


def _glm_runs(runs: Sequence[dict]) -> list[dict]:
    """Runs in `glm_difficulty`'s form (lengths from delta_len and, where given, len_reference)."""
    out = []
    for r in runs:
        xs, y, d, kept = _clean_kept(r["instructions"], r["preferences"], r["delta_len"])
        given = r.get("len_reference")
        ref = np.asarray(np.zeros(len(kept)) if given is None else given, dtype=float)[kept]
        out.append({"keys": xs, "preferences": y + 1.0, "len_1": ref, "len_2": ref + d})
    return out


def instruction_difficulty(
    runs: Sequence[dict],
    penalty: float = PENALTY,
    difficulty_penalty: float = DIFFICULTY_PENALTY,
    method: str = "alpaca_eval",
) -> dict[str, float]:
    """Difficulty of each instruction from several annotated runs.

    Each run: {"instructions": [...], "preferences": [...], "delta_len": [...]} (one model
    judged against the reference outputs; preferences as in AlpacaEval, 1 to 2), optionally
    "len_reference" (the reference outputs' lengths). alpaca_eval: `glm_difficulty.joint_difficulty`
    (centred per-instruction effects, higher = easier). ridge: higher difficulty = the evaluated
    models lose more often on that instruction than their own quality and length explain; mean 0
    and sd 1 over the instructions seen (penalty and difficulty_penalty apply to it alone).
    """
    _check(method)
    if method == "alpaca_eval":
        from farmflow.evaluation.glm_difficulty import joint_difficulty

        return joint_difficulty(_glm_runs(runs))[0] if runs else {}
    keys: dict[str, int] = {}
    Xs, ys, gs = [], [], []
    cleaned = [_clean(r["instructions"], r["preferences"], r["delta_len"]) for r in runs]
    cleaned = [c for c in cleaned if len(c[1])]
    if not cleaned:
        return {}
    R = len(cleaned)
    for i, (xs, y, d) in enumerate(cleaned):
        X = np.zeros((len(y), 2 * R))
        X[:, 2 * i], X[:, 2 * i + 1] = 1.0, length_feature(d)
        Xs.append(X)
        ys.append(y)
        gs.append(np.array([keys.setdefault(x, len(keys)) for x in xs]))
    pen = np.tile([INTERCEPT_PENALTY, penalty], R)
    _, g = fit_logistic(np.vstack(Xs), np.concatenate(ys), pen, np.concatenate(gs), len(keys), difficulty_penalty)
    sd = float(g.std())
    z = -(g - g.mean()) / sd if sd > 1e-12 else np.zeros_like(g)
    return {x: float(z[k]) for x, k in keys.items()}


def length_controlled_winrate(
    instructions: Sequence[str],
    preferences: Sequence[object],
    delta_len: Sequence[float],
    difficulty: dict[str, float] | None = None,
    penalty: float = PENALTY,
    method: str = "alpaca_eval",
    len_reference: Sequence[float] | None = None,
) -> dict[str, float]:
    """LC win rate and its standard error for one run (module doc).

    `difficulty`: instruction → difficulty (`instruction_difficulty` of the same method); None: no
    difficulty term. Rows with an unusable preference are left out (as in `win_rate_stats`); a run
    whose labels are all equal (all wins, losses or ties) has nothing to adjust: LC = its win rate.
    `len_reference` (alpaca_eval): the reference outputs' lengths, which the gamed-baseline
    stand-in needs (without them it has no length term). Returns lc_win_rate, lc_standard_error and
    the fitted coefficients lc_intercept (θ; alpaca_eval: the model term), lc_length_coef (φ),
    lc_difficulty_coef (ψ) and lc_length_sd.
    """
    _check(method)
    xs, y, d, kept = _clean_kept(instructions, preferences, delta_len)
    n = len(y)
    if n == 0:
        raise ValueError("no valid preferences to compute a length-controlled win rate from")
    gam = np.array([(difficulty or {}).get(x, 0.0) for x in xs])
    out = {"lc_length_sd": float(d.std()) if n > 1 else 0.0}
    if np.all(y == y[0]):  # all wins, all losses or all ties: nothing to adjust
        return out | {
            "lc_win_rate": 100.0 * float(y[0]),
            "lc_standard_error": 0.0 if n > 1 else math.nan,
            "lc_intercept": math.nan,
            "lc_length_coef": 0.0,
            "lc_difficulty_coef": 0.0,
        }
    if method == "alpaca_eval":
        from farmflow.evaluation.glm_lc import glm_lc

        ref = np.asarray(len_reference, dtype=float)[kept] if len_reference is not None else np.zeros(n)
        fit = glm_lc(y + 1.0, ref, ref + d, gam)
        return (
            out
            | {k: fit[k] for k in ("lc_win_rate", "lc_standard_error", "lc_length_coef", "lc_difficulty_coef")}
            | {"lc_intercept": fit["lc_model_coef"]}
        )
    X = np.column_stack([np.ones(n), length_feature(d), gam])
    pen = np.array([INTERCEPT_PENALTY, penalty, penalty])
    w, _ = fit_logistic(X, y, pen)
    q = 1.0 / (1.0 + np.exp(-(X @ w)))
    f = 1.0 / (1.0 + np.exp(-(w[0] + w[2] * gam)))  # length difference set to zero
    lc = float(f.mean())
    # delta method: per-row influence of the mean prediction (instruction sampling + parameters)
    H = (X * (q * (1 - q))[:, None]).T @ X + np.diag(pen)
    grad_f = np.array([np.mean(f * (1 - f)), 0.0, np.mean(f * (1 - f) * gam)])
    scores = X * (q - y)[:, None]
    influence = (f - lc) / n - scores @ np.linalg.solve(H, grad_f)
    se = float(np.sqrt(n / (n - 1) * np.sum(influence**2))) if n > 1 else math.nan
    return out | {
        "lc_win_rate": 100.0 * lc,
        "lc_standard_error": 100.0 * se,
        "lc_intercept": float(w[0]),
        "lc_length_coef": float(w[1]),
        "lc_difficulty_coef": float(w[2]),
    }


def run_of_rows(rows: Sequence[dict]) -> dict:
    """A run for `instruction_difficulty` from evaluation/annotation rows (instruction, input, output_1, output_2,
    preference)."""
    return {
        "instructions": [instruction_key(r) for r in rows],
        "preferences": [r.get("preference") for r in rows],
        "delta_len": [len(r.get("output_2") or "") - len(r.get("output_1") or "") for r in rows],
        "len_reference": [len(r.get("output_1") or "") for r in rows],
    }


def instruction_key(row: dict) -> str:
    """What identifies an instruction across runs: its text and its input."""
    return f"{row.get('instruction') or ''}\x1f{row.get('input') or ''}"


def lc_of_rows(
    rows: Sequence[dict], difficulty_runs: Sequence[dict] = (), penalty: float = PENALTY, method: str = "alpaca_eval"
) -> dict[str, float]:
    """LC win rate of one run's rows, with a difficulty table when other runs are given.

    `difficulty_runs` are runs (`run_of_rows`) judged by the same annotator against the same
    references. alpaca_eval: one table fitted over them and this run (as `farmflow eval
    leaderboard` fits one over every run); ridge: over the others alone (leave-one-run-out).
    No other run: no difficulty term.
    """
    run = run_of_rows(rows)
    others = [r for r in difficulty_runs if r is not run and r != run]
    pooled = others + [run] if method == "alpaca_eval" else others
    difficulty = instruction_difficulty(pooled, penalty, method=method) if others else None
    out = length_controlled_winrate(
        run["instructions"], run["preferences"], run["delta_len"], difficulty, penalty, method, run["len_reference"]
    )
    return out | {"lc_difficulty_runs": float(len(others))}
