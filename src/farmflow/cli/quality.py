"""`farmflow leaderboard --judge human[:NAME]` and `--cost`: a leaderboard re-judged by people's labels, and each
row's cost beside its quality (`farmflow.evaluation.human`, `farmflow.evaluation.cost`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from farmflow.cli.errors import UsageError
from farmflow.cli.output import emit, print_json, say

COST_BOARD = (
    ("method", "method"),
    ("win rate", "win_rate"),
    ("± SE", "standard_error"),
    ("train s", "train_seconds"),
    ("answer s", "answer_seconds"),
    ("judge s", "judge_seconds"),
    ("wall s", "wall_seconds"),
    ("API $", "api_usd"),
    ("API requests", "api_requests"),
    ("Pareto", "pareto"),
)


def people_labels(st, judge: str) -> list[dict]:
    """The labels of `judge`: ``human`` (every person) or ``human:NAME``."""
    from farmflow.labeling.labels import all_labels

    if judge != "human" and not judge.startswith("human:"):
        raise UsageError(f"--judge {judge!r}: use human (every person's labels) or human:NAME")
    rows = [r for r in all_labels(st) if judge == "human" or r["annotator"] == judge]
    if not rows:
        raise UsageError(f"--judge {judge}: no such labels in {st.root} (farmflow label serve --pairs ...)")
    return rows


def human_board(st, rows: list[dict], judge: str) -> tuple[list[dict], dict]:
    """The leaderboard rows re-judged by people (win rate over the pairs they labeled, n those pairs), best first;
    and the Spearman correlation of the two rankings with its bootstrap interval."""
    from farmflow.evaluation.cost import by_evaluation
    from farmflow.evaluation.human import human_preferences, human_win_rates, ranking_agreement

    humans = human_preferences(people_labels(st, judge))
    evaluations = by_evaluation(st, rows)
    out = []
    for r in rows:
        stats = human_win_rates(evaluations.get(r["evaluation_key"], []), humans)
        out.append(
            r
            | {
                "win_rate": stats["win_rate"],
                "standard_error": stats["standard_error"],
                "discrete_win_rate": stats.get("discrete_win_rate", math.nan),
                "lc_win_rate": math.nan,
                "lc_standard_error": math.nan,
                "n": int(stats["n_total"]),
                "annotator": judge,
                "simulated_win_rate": r["win_rate"],
            }
        )
    if not any(r["n"] for r in out):
        raise UsageError(
            f"--judge {judge}: people labeled none of this leaderboard's evaluation pairs "
            "(farmflow label serve --pairs LEADERBOARD_KEY labels them)"
        )
    ranks = ranking_agreement({r["method"]: evaluations.get(r["evaluation_key"], []) for r in rows}, humans)
    out.sort(key=lambda r: -r["win_rate"] if r["n"] else math.inf)
    return out, ranks


def ranking_line(ranks: dict) -> str:
    if ranks["methods"] < 2 or math.isnan(ranks["spearman"]):
        return f"ranking under people vs the simulated judge: {ranks['methods']} method(s) with labels, no correlation"
    return (
        f"ranking under people vs the simulated judge over {ranks['methods']} methods: Spearman "
        f"{ranks['spearman']:.2f} (95% interval {ranks['ci_low']:.2f} to {ranks['ci_high']:.2f}; {ranks['interval']})"
    )


def cost_board(st, rows: list[dict], title: str, fmt: str, plot: Optional[Path], as_json: bool = False) -> list:
    """Print the rows with their cost columns (and write the quality–cost plot to `plot`); returns the rows."""
    from farmflow.evaluation.cost import best_of_n_curve, by_evaluation, cost_rows, plot_cost
    from farmflow.labeling.labels import simulated_labels

    records = st.records()
    costed = cost_rows(rows, records, simulated_labels(st), by_evaluation(st, rows))
    bon = next((r for r in costed if r["method"].startswith("best_of_")), None)
    curve = best_of_n_curve(records, bon["evaluation_key"]) if bon else []
    if plot:
        plot_cost(costed, str(plot), curve, title)
    if as_json:
        print_json({"leaderboard": costed, "best_of_n_curve": curve})
        return costed
    one = lambda x: "—" if x is None or x != x else f"{x:.1f}"  # noqa: E731
    emit(
        [c for c, _ in COST_BOARD],
        [[r.get(f) for _, f in COST_BOARD] for r in costed],
        fmt,
        title=title + ": quality and cost",
        cells={
            **{c: one for c, f in COST_BOARD[1:7]},
            "API $": lambda x: "—" if x is None or x != x else f"{x:.4f}",
            "API requests": lambda x: "—" if x is None or x != x else f"{x:.0f}",
            "Pareto": lambda x: "★" if x else "",
        },
        right=[c for c, _ in COST_BOARD[1:]],
        keys=[f for _, f in COST_BOARD],
    )
    if fmt == "table":
        say("seconds: compute recorded by each stage, shared stages counted in every row built on them; ★ Pareto")
        if curve:
            points = (f"n={p['n']} {p['win_rate']:.1f}% {p['wall_seconds']:.0f}s" for p in curve)
            say("best-of-n over n: " + ", ".join(points))
        if plot:
            say(f"plot: {plot}")
    return costed
