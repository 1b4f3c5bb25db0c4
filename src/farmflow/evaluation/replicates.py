"""The leaderboard of a replicated comparison: means over replicates, intervals, differences to SFT, rank ranges.

Input: for each replicate r (a seed of the whole experiment, `evaluation.replicates`), its leaderboard rows
(`leaderboard.leaderboard_rows`) and each method's evaluation rows (prompt id → preference, gold reward). Output: one
row per method with every column of a leaderboard row, so tools reading leaderboards (the runs table, the history,
the CLI's table) read these too, and more columns (`INTERVAL_COLUMNS`):

* win_rate, mean_gold, discrete and LC win rates, avg_length: means over the replicates;
* standard_error, win_rate_low/high: the two-way bootstrap over prompts and replicates (`bootstrap`), so the history's
  "moved by more than 2 combined SEs" compares intervals that include the seed-to-seed variance;
* replicate_sd, replicate_low/high: the spread of the K replicate win rates, mean ± t(K−1)·sd/√K (NaN for K = 1);
* diff_to_sft, diff_low/high, diff_standard_error: the paired bootstrap of the method's score minus SFT's on the same
  prompts and replicates; `resolved` is 'better' or 'worse' when the 95% interval excludes 0, else 'tied';
  resolvable_difference: the half-width of that interval (the smallest difference this evaluation resolves);
* gold_diff_to_sft, gold_diff_low/high: the same for the gold reward (synthetic farm);
* rank_best, rank_worst: the best and worst rank the win-rate intervals allow (1 = best): a method ranks below every
  method whose interval lies entirely above its own, above every one whose interval lies entirely below.

Further columns (costs...) can be added by other functions: renderers show the columns they know and ignore others.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from farmflow.evaluation.bootstrap import N_BOOT, bootstrap_mean, paired_bootstrap, t975
from farmflow.evaluation.leaderboard import FAMILY_COLOURS, method_family
from farmflow.evaluation.stats import parse_preference

BASELINE = "sft"
INTERVAL_COLUMNS = (
    "replicates",
    "win_rate_low",
    "win_rate_high",
    "replicate_sd",
    "replicate_low",
    "replicate_high",
    "gold_low",
    "gold_high",
    "diff_to_sft",
    "diff_low",
    "diff_high",
    "diff_standard_error",
    "resolvable_difference",
    "resolved",
    "gold_diff_to_sft",
    "gold_diff_low",
    "gold_diff_high",
    "rank_best",
    "rank_worst",
)
"""Columns a replicated leaderboard row has beyond a leaderboard row's (`farmflow.evaluation.leaderboard.COLUMNS`)."""


def score_matrix(runs: Sequence[Sequence[dict]], field: str = "preference") -> tuple[list[str], np.ndarray]:
    """(prompt ids, scores (K, n)) from K evaluation tables of one method: score p − 1 for preferences (`field`
    'preference'), the value itself for 'gold_2'. Only prompts with a usable value in every replicate are kept."""
    by_id = []
    for rows in runs:
        values = {}
        for r in rows:
            v = parse_preference(r.get(field)) if field == "preference" else r.get(field)
            if v is not None and not (isinstance(v, float) and math.isnan(v)):
                values[r["id"]] = v - 1.0 if field == "preference" else float(v)
        by_id.append(values)
    ids = sorted(set.intersection(*(set(v) for v in by_id))) if by_id else []
    return ids, np.array([[v[i] for i in ids] for v in by_id], dtype=float).reshape(len(by_id), len(ids))


def aligned(
    evaluations: dict[str, Sequence[Sequence[dict]]], field: str = "preference"
) -> tuple[list[str], dict[str, np.ndarray]]:
    """Every method's (K, n) scores on the prompts that all of them have (the pairing of the bootstrap)."""
    per = {m: score_matrix(runs, field) for m, runs in evaluations.items()}
    common = sorted(set.intersection(*(set(ids) for ids, _ in per.values()))) if per else []
    out = {}
    for m, (ids, scores) in per.items():
        index = {i: j for j, i in enumerate(ids)}
        out[m] = scores[:, [index[i] for i in common]]
    return common, out


def replicate_interval(values: Sequence[float]) -> tuple[float, float, float]:
    """(sd, low, high) of the mean of K replicate values: mean ± t(K−1)·sd/√K; NaN for K < 2."""
    v = np.asarray([x for x in values if x is not None and not math.isnan(x)], dtype=float)
    if len(v) < 2:
        return math.nan, math.nan, math.nan
    sd = float(v.std(ddof=1))
    half = t975(len(v) - 1) * sd / math.sqrt(len(v))
    return sd, float(v.mean() - half), float(v.mean() + half)


def rank_ranges(lows: Sequence[float], highs: Sequence[float]) -> list[tuple[int, int]]:
    """(best, worst) rank of each item given intervals (1 = best, higher is better): items whose interval lies entirely
    above rank ahead of it, items whose interval lies entirely below rank behind it."""
    m = len(lows)
    return [
        (
            1 + sum(lows[j] > highs[i] for j in range(m) if j != i),
            m - sum(highs[j] < lows[i] for j in range(m) if j != i),
        )
        for i in range(m)
    ]


def _mean(rows: Sequence[dict], key: str) -> float:
    v = [r.get(key) for r in rows]
    v = [float(x) for x in v if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return sum(v) / len(v) if v else math.nan


def interval_rows(
    boards: Sequence[Sequence[dict]],
    evaluations: dict[str, Sequence[Sequence[dict]]],
    baseline: str = BASELINE,
    n_boot: int = N_BOOT,
    seed: int = 0,
) -> list[dict]:
    """Rows of a replicated leaderboard (module doc), best mean win rate first.

    `boards[r]`: replicate r's leaderboard rows; `evaluations[method][r]`: replicate r's evaluation rows of the method
    (id, preference, gold_2). The bootstrap pairs every method with `baseline` on the prompts all methods share."""
    methods = list(dict.fromkeys(r["method"] for board in boards for r in board))
    _, prefs = aligned(evaluations)
    _, golds = aligned(evaluations, "gold_2")
    has_gold = all(g.size for g in golds.values())
    out = []
    for i, method in enumerate(methods):
        rows = [r for board in boards for r in board if r["method"] == method]
        first = rows[0]
        wr = bootstrap_mean(prefs[method], n_boot, seed=seed)
        sd, rlo, rhi = replicate_interval([r["win_rate"] for r in rows])
        row = {
            **first,
            "win_rate": 100 * wr["estimate"],
            "standard_error": 100 * wr["se"],
            "discrete_win_rate": _mean(rows, "discrete_win_rate"),
            "lc_win_rate": _mean(rows, "lc_win_rate"),
            "lc_standard_error": _mean(rows, "lc_standard_error"),
            "mean_gold": _mean(rows, "mean_gold"),
            "gold_standard_error": math.nan,
            "avg_length": int(round(_mean(rows, "avg_length"))),
            "n": int(prefs[method].shape[1]),
            "evaluation_key": ",".join(r["evaluation_key"] for r in rows),
            "replicates": len(rows),
            "win_rate_low": 100 * wr["low"],
            "win_rate_high": 100 * wr["high"],
            "replicate_sd": sd,
            "replicate_low": rlo,
            "replicate_high": rhi,
            "gold_low": math.nan,
            "gold_high": math.nan,
        }
        if has_gold:
            g = bootstrap_mean(golds[method], n_boot, seed=seed)
            row |= {
                "mean_gold": g["estimate"],
                "gold_standard_error": g["se"],
                "gold_low": g["low"],
                "gold_high": g["high"],
            }
        row |= difference_columns(prefs, golds if has_gold else {}, method, baseline, n_boot, seed + i + 1)
        out.append(row)
    out.sort(key=lambda r: -r["win_rate"])
    for row, (best, worst) in zip(
        out, rank_ranges([r["win_rate_low"] for r in out], [r["win_rate_high"] for r in out])
    ):
        row["rank_best"], row["rank_worst"] = best, worst
    return out


def difference_columns(
    prefs: dict[str, np.ndarray], golds: dict[str, np.ndarray], method: str, baseline: str, n_boot: int, seed: int
) -> dict[str, float | str]:
    """diff_* and gold_diff_* columns of `method` against `baseline` (NaN and '' without a baseline, or for it)."""
    nan = math.nan
    empty = {
        "diff_to_sft": nan,
        "diff_low": nan,
        "diff_high": nan,
        "diff_standard_error": nan,
        "resolvable_difference": nan,
        "resolved": "",
        "gold_diff_to_sft": nan,
        "gold_diff_low": nan,
        "gold_diff_high": nan,
    }
    if baseline not in prefs or method == baseline:
        return empty
    d = paired_bootstrap(prefs[method], prefs[baseline], n_boot, seed=seed)
    out = {
        "diff_to_sft": 100 * d["estimate"],
        "diff_low": 100 * d["low"],
        "diff_high": 100 * d["high"],
        "diff_standard_error": 100 * d["se"],
        "resolvable_difference": 100 * (d["high"] - d["low"]) / 2,
        "resolved": ("better" if d["low"] > 0 else "worse") if d["excludes_zero"] else "tied",
        "gold_diff_to_sft": nan,
        "gold_diff_low": nan,
        "gold_diff_high": nan,
    }
    if golds:
        g = paired_bootstrap(golds[method], golds[baseline], n_boot, seed=seed)
        out |= {"gold_diff_to_sft": g["estimate"], "gold_diff_low": g["low"], "gold_diff_high": g["high"]}
    return out


def _f(x: object, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _range(row: dict) -> str:
    best, worst = row.get("rank_best"), row.get("rank_worst")
    return "—" if best is None else (f"{best}" if best == worst else f"{best}–{worst}")


MARK = {"better": "▲", "worse": "▼", "tied": "", "": ""}
"""A difference to SFT whose 95% interval excludes 0: ▲ above SFT, ▼ below."""


def interval_markdown(rows: Sequence[dict], title: str = "Leaderboard") -> str:
    """A Markdown table of replicated leaderboard rows: win rate [95% CI], difference to SFT [95% CI] with its mark,
    mean gold [95% CI], rank range; what the evaluation resolves below."""
    k = max((int(r.get("replicates") or 1) for r in rows), default=1)
    lines = [
        f"### {title}",
        "",
        "| rank | method | win rate [95% CI] | Δ vs SFT [95% CI] | | mean gold [95% CI] | Δ gold vs SFT | avg length |",
        "|---|---|---:|---:|---|---:|---:|---:|",
    ]
    for r in rows:
        diff = (
            f"{_f(r.get('diff_to_sft'), '+.1f')} [{_f(r.get('diff_low'), '+.1f')}, {_f(r.get('diff_high'), '+.1f')}]"
            if r.get("resolved")
            else "—"
        )
        gold_diff = (
            f"{_f(r.get('gold_diff_to_sft'), '+.3f')} [{_f(r.get('gold_diff_low'), '+.3f')}, "
            f"{_f(r.get('gold_diff_high'), '+.3f')}]"
            if r.get("resolved") and not math.isnan(r.get("gold_diff_to_sft", math.nan))
            else "—"
        )
        lines.append(
            f"| {_range(r)} | {r['method']} | {_f(r['win_rate'], '.1f')} [{_f(r.get('win_rate_low'), '.1f')}, "
            f"{_f(r.get('win_rate_high'), '.1f')}] | {diff} | {MARK.get(r.get('resolved', ''), '')} | "
            f"{_f(r.get('mean_gold'), '.3f')} [{_f(r.get('gold_low'), '.3f')}, {_f(r.get('gold_high'), '.3f')}] | "
            f"{gold_diff} | {r['avg_length']} |"
        )
    n = max((int(r["n"]) for r in rows), default=0)
    resolvable = [r["resolvable_difference"] for r in rows if not math.isnan(r.get("resolvable_difference", math.nan))]
    lines += [
        "",
        f"{k} replicate(s) × {n} evaluation prompts. Intervals: bootstrap over prompts"
        + (" and replicates" if k > 1 else "")
        + "; Δ paired on the same prompts and replicates (▲/▼: the 95% interval excludes 0). "
        "Ranks: the range the win-rate intervals allow.",
    ]
    if resolvable:
        lines.append(
            f"This evaluation resolves differences to SFT of about {float(np.median(resolvable)):.1f} points "
            "(the median half-width of the Δ intervals); smaller ones read as ties."
        )
    return "\n".join(lines) + "\n"


def plot_intervals(rows: Sequence[dict], path: str, title: str = "Difference to SFT") -> None:
    """Two panels (PNG): each method's win rate with its 95% interval, and its paired difference to SFT with its 95%
    interval (a line at 0; coloured by method family)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: r["win_rate"])
    y = np.arange(len(ordered))
    colours = [FAMILY_COLOURS[method_family(r["method"])] for r in ordered]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 0.45 * len(ordered) + 1.6), dpi=120, sharey=True)
    for ax, (est, lo, hi), label in (
        (left, ("win_rate", "win_rate_low", "win_rate_high"), "win rate vs reference (%), 95% interval"),
        (right, ("diff_to_sft", "diff_low", "diff_high"), "win-rate difference to SFT (points), paired 95% interval"),
    ):
        for yi, r, c in zip(y, ordered, colours):
            if r.get(est) is None or math.isnan(r[est]):
                continue
            ax.errorbar(r[est], yi, xerr=[[r[est] - r[lo]], [r[hi] - r[est]]], fmt="o", color=c, capsize=3)
        ax.set_xlabel(label, fontsize=8)
        ax.grid(alpha=0.3)
    left.axvline(50, color="black", lw=0.8, ls="--")
    right.axvline(0, color="black", lw=0.8)
    left.set_yticks(y, [f"{r['method']} {MARK.get(r.get('resolved', ''), '')}" for r in ordered])
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
