"""The leaderboard table and the summary a run prints (`farmflow run`, `farmflow demo`)."""

from __future__ import annotations

from farmflow.cli.output import emit, say, text

# (column, leaderboard field): the table's columns, in order
BOARD = (
    ("method", "method"),
    ("win rate", "win_rate"),
    ("± SE", "standard_error"),
    ("discrete", "discrete_win_rate"),
    ("LC win rate", "lc_win_rate"),
    ("LC ± SE", "lc_standard_error"),
    ("mean gold", "mean_gold"),
    ("gold ± SE", "gold_standard_error"),
    ("avg length", "avg_length"),
    ("n", "n"),
)


def one(x) -> str:
    """A percentage with one decimal, or a dash."""
    return "—" if x is None or x != x else f"{x:.1f}"


def print_board(rows: list[dict], title: str, fmt: str = "table") -> None:
    """The leaderboard rows in `fmt`: json and csv carry the fields' values under the fields' names (the leaderboard
    schema's), table and md show them rounded."""
    columns = [c for c, _ in BOARD]
    percent = {c: one for c, f in BOARD if "win_rate" in f or f in ("standard_error", "lc_standard_error")}
    emit(
        columns,
        [[r.get(f) for _, f in BOARD] for r in rows],
        fmt,
        title=title,
        cells=percent,
        right=columns[1:],
        fold={"method": 10},
        keys=[f for _, f in BOARD],
    )


def reward_line(rm: dict) -> str:
    names = {
        "heldout_accuracy": "vs labels",
        "heldout_accuracy_unnoised": "vs un-noised labels",
        "heldout_gold_accuracy": "vs gold",
    }
    return (
        "reward model, held-out val pairs: accuracy "
        + ", ".join(f"{names.get(k, k)} {v:.3f}" for k, v in rm.items())
        + " (per task family, beside baselines: farmflow reward-report)"
    )


def print_summary(summary: dict, wall: float, log: str | None = None) -> None:
    """A run's leaderboard, the judge, the reward model's accuracy, its stages and where its artifacts are."""
    from farmflow.evaluation.leaderboard import judge_quality

    print_board(summary["leaderboard"], f"Leaderboard ({summary['preset']}, vs reference outputs)")
    for judge in sorted({r["annotator"] for r in summary["leaderboard"] if r.get("annotator")}):
        note = judge_quality(judge)
        say(f"judged by {judge}" + (f"; the judge {note}" if note else ""))
    say(f"reference outputs: mean gold {text(summary['reference_mean_gold'])}")
    if summary["reward_model"]:
        say(reward_line(summary["reward_model"]))
    waited = lambda s: s.get("waited_seconds", 0.0)  # noqa: E731
    emit(
        ["stage", "seconds", "waiting", "cached", "key"],
        [
            [
                s["stage"],
                f"{s['seconds']:.1f}",
                f"{waited(s):.1f}" if waited(s) >= 0.05 else "",
                "cached" if s["cached"] else "",
                s["key"][:12],
            ]
            for s in summary["stages"]
        ],
        title="Stages",
        caption="seconds include waiting: stages that load a model take turns (one device)",
        right=["seconds", "waiting"],
    )
    say(f"wall time {wall:.1f}s; artifacts in {summary['store']}" + (f"; log {log}" if log else ""))
    for name, uri in summary["artifacts"].items():
        say(f"  {name}: {uri}")
