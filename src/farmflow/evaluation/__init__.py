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
* mean_gold = mean gold reward of the evaluated outputs (synthetic farm only).
"""

from __future__ import annotations

import math
from typing import Sequence

import pyarrow as pa

from farmflow.annotators import annotate_pairs
from farmflow.config import AnnotatorConfig
from farmflow.storage.schemas import SCHEMAS

VERSION = "2"  # 2: discrete win rate and n_invalid in the metrics


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


def win_rate_stats(preferences: Sequence[object], outputs: Sequence[str], golds: Sequence[float | None] = ()) -> dict[str, float]:
    """Summary statistics of one evaluated model, as AlpacaEval defines them (module doc).

    Unusable preferences (missing, malformed, out of [1, 2]) are left out of every
    statistic but counted in `n_invalid`; avg_length is over all evaluated outputs.
    """
    parsed = [parse_preference(p) for p in preferences]
    prefs = [p for p in parsed if p is not None]
    n = len(prefs)
    if n == 0:
        raise ValueError(f"no valid preferences to compute a win rate from ({len(parsed)} rows, all missing or malformed)")
    wins = [p - 1.0 for p in prefs]
    mean = sum(wins) / n
    sd = math.sqrt(sum((w - mean) ** 2 for w in wins) / (n - 1)) if n > 1 else float("nan")
    n_wins, n_base, n_draws = sum(p > 1.5 for p in prefs), sum(p < 1.5 for p in prefs), sum(p == 1.5 for p in prefs)
    known = [g for g in golds if g is not None]
    return {
        "win_rate": 100.0 * mean,
        "standard_error": 100.0 * sd / math.sqrt(n),
        "n_wins": float(n_wins),
        "n_wins_base": float(n_base),
        "n_draws": float(n_draws),
        "n_total": float(n),
        "n_invalid": float(len(parsed) - n),
        "discrete_win_rate": 100.0 * (n_wins + 0.5 * n_draws) / n,
        "avg_length": float(int(sum(len(o) for o in outputs) / max(1, len(outputs)))),
        "mean_gold": sum(known) / len(known) if known else float("nan"),
    }


def alpaca_eval_winrate(rows: Sequence[dict], where: str = "annotations") -> dict[str, float]:
    """Leaderboard statistics of an AlpacaEval annotations file (rows with preference, output_2)."""
    missing = [i for i, r in enumerate(rows) if "preference" not in r or "output_2" not in r]
    if missing:
        raise ValueError(f"{where}: row {missing[0]} has no 'preference' or 'output_2' field ({len(missing)} such rows)")
    stats = win_rate_stats([r["preference"] for r in rows], [r["output_2"] or "" for r in rows])
    stats.pop("mean_gold")
    return stats


def evaluate_outputs(outputs: Sequence[dict], references: Sequence[dict], annotator: AnnotatorConfig) -> tuple[pa.Table, dict[str, float]]:
    """Judge each output against the reference output of the same instruction.

    `outputs` rows: id, instruction, input, output, generator, task. `references` rows: id,
    output (the eval split of the instructions table). Returns the ``evaluation`` table
    and the summary statistics (plus the reference's mean gold reward).
    """
    ref_by_id = {r["id"]: r["output"] for r in references}
    missing = [o["id"] for o in outputs if o["id"] not in ref_by_id]
    if missing:
        raise ValueError(f"{len(missing)} evaluated outputs have no reference output (first: {missing[0]!r})")
    pairs = [
        {"id": o["id"], "split": "eval", "instruction": o["instruction"], "input": o["input"], "task": o["task"],
         "output_1": ref_by_id[o["id"]], "output_2": o["output"]}
        for o in outputs
    ]
    judged = annotate_pairs(pairs, annotator).to_pylist()
    generator = {o["id"]: o["generator"] for o in outputs}
    rows = [
        {k: r[k] for k in ("id", "instruction", "input", "output_1", "output_2", "annotator", "preference", "gold_1", "gold_2")}
        | {"generator": generator[r["id"]]}
        for r in judged
    ]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["evaluation"])
    stats = win_rate_stats([r["preference"] for r in rows], [r["output_2"] for r in rows], [r["gold_2"] for r in rows])
    ref_gold = [r["gold_1"] for r in rows if r["gold_1"] is not None]
    stats["reference_mean_gold"] = sum(ref_gold) / len(ref_gold) if ref_gold else float("nan")
    return table, stats


# ------------------------------------------------------------------ leaderboards
def method_family(method: str) -> str:
    """Colour group of a method in plots: baseline, sft, reward-model or preference methods."""
    if method in ("untrained", "reference"):
        return "baseline"
    if method == "sft":
        return "sft"
    if method.startswith(("best_of", "expert_iteration", "ppo", "quark")):
        return "reward model"
    return "preferences"


def leaderboard_markdown(rows: Sequence[dict], title: str = "Leaderboard") -> str:
    """A Markdown table of leaderboard rows (already sorted)."""
    def num(x: object, fmt: str) -> str:
        return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)

    lines = [f"### {title}", "", "| method | win rate | ± SE | mean gold | avg length | n |", "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['method']} | {num(r['win_rate'], '.1f')} | {num(r['standard_error'], '.1f')} | "
            f"{num(r.get('mean_gold'), '.3f')} | {r['avg_length']} | {r['n']} |"
        )
    return "\n".join(lines) + "\n"


def plot_leaderboard(rows: Sequence[dict], path: str, title: str = "Win rate vs reference") -> None:
    """Horizontal bars of win rate ± SE, best at the top, coloured by method family (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colours = {"baseline": "#9e9e9e", "sft": "#4c72b0", "reward model": "#dd8452", "preferences": "#55a868"}
    ordered = sorted(rows, key=lambda r: r["win_rate"])
    fig, ax = plt.subplots(figsize=(6, 0.5 * len(ordered) + 1.2), dpi=120)
    ax.barh(
        [r["method"] for r in ordered], [r["win_rate"] for r in ordered],
        xerr=[0 if math.isnan(r["standard_error"]) else r["standard_error"] for r in ordered],
        color=[colours[method_family(r["method"])] for r in ordered], capsize=3,
    )
    ax.axvline(50, color="black", lw=0.8, ls="--")
    ax.set_xlim(0, 100)
    ax.set_xlabel("win rate vs reference outputs (%), ± 1 SE")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours.values()]
    ax.legend(handles, list(colours), loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
