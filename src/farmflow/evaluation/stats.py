"""Win rate against reference outputs (AlpacaFarm/AlpacaEval definitions).

Each evaluation row is a pair (output_1 = reference, output_2 = evaluated output) judged
by the evaluation annotator pool (p_sim^eval: no label noise). With preference p in
[1, 2] (1: reference wins, 2: evaluated output wins, 1.5: tie):

* preferences may arrive as ints, floats or numeric strings; the legacy 0 is a tie (1.5);
  missing, malformed or out-of-range values are dropped and counted in n_invalid;
* win_rate = 100 · mean(p − 1), so ties count 0.5;
* standard_error = 100 · std(p − 1, ddof=1) / sqrt(n);
* n_wins / n_wins_base / n_draws count p > 1.5, p < 1.5 and p == 1.5;
* discrete_win_rate = 100 · (n_wins + n_draws / 2) / n_total;
* avg_length = mean characters of the evaluated outputs, truncated to an int;
* mean_gold = mean gold reward of the evaluated outputs (synthetic farm only);
* gold_standard_error = std(gold, ddof=1) / sqrt(number of outputs with a gold reward).
"""

from __future__ import annotations

import math
from typing import Sequence


def parse_preference(value: object) -> float | None:
    """A preference in [1, 2] from an int, float or numeric string; legacy 0 means a tie (1.5).

    None for a missing, non-numeric, NaN or out-of-range value (the caller counts those).
    """
    if value is None or isinstance(value, bool):
        return None
    try:
        p = float(value.strip()) if isinstance(value, str) else float(value)
    except (TypeError, ValueError):
        return None
    if math.isnan(p):
        return None
    if p == 0.0:
        return 1.5
    return p if 1.0 <= p <= 2.0 else None


def _mean_sem(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error of the mean (ddof 1); NaN where there are too few values."""
    n = len(values)
    if n == 0:
        return float("nan"), float("nan")
    mean = sum(values) / n
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else float("nan")
    return mean, sd / math.sqrt(n)


def win_rate_stats(
    preferences: Sequence[object], outputs: Sequence[str], golds: Sequence[float | None] = ()
) -> dict[str, float]:
    """Summary statistics of one evaluated model, as AlpacaEval defines them (module doc).

    Unusable preferences (missing, malformed, out of [1, 2]) are left out of every
    statistic but counted in `n_invalid`; avg_length is over all evaluated outputs.
    """
    parsed = [parse_preference(p) for p in preferences]
    prefs = [p for p in parsed if p is not None]
    n = len(prefs)
    if n == 0:
        raise ValueError(
            f"no valid preferences to compute a win rate from ({len(parsed)} rows, all missing or malformed)"
        )
    mean, sem = _mean_sem([p - 1.0 for p in prefs])
    n_wins, n_base, n_draws = sum(p > 1.5 for p in prefs), sum(p < 1.5 for p in prefs), sum(p == 1.5 for p in prefs)
    gold_mean, gold_sem = _mean_sem([g for g in golds if g is not None])
    return {
        "win_rate": 100.0 * mean,
        "standard_error": 100.0 * sem,
        "n_wins": float(n_wins),
        "n_wins_base": float(n_base),
        "n_draws": float(n_draws),
        "n_total": float(n),
        "n_invalid": float(len(parsed) - n),
        "discrete_win_rate": 100.0 * (n_wins + 0.5 * n_draws) / n,
        "avg_length": float(int(sum(len(o) for o in outputs) / max(1, len(outputs)))),
        "mean_gold": gold_mean,
        "gold_standard_error": gold_sem,
    }


def alpaca_eval_winrate(rows: Sequence[dict], where: str = "annotations") -> dict[str, float]:
    """Leaderboard statistics of an AlpacaEval annotations file (rows with preference, output_2)."""
    missing = [i for i, r in enumerate(rows) if "preference" not in r or "output_2" not in r]
    if missing:
        raise ValueError(
            f"{where}: row {missing[0]} has no 'preference' or 'output_2' field ({len(missing)} such rows)"
        )
    stats = win_rate_stats([r["preference"] for r in rows], [r["output_2"] or "" for r in rows])
    stats.pop("mean_gold")
    stats.pop("gold_standard_error")
    return stats
