"""Leaderboards: one row per evaluated method, as a table, Markdown and a plot.

`leaderboard_rows` turns evaluations (their metrics and judged rows) into leaderboard
rows: win rate ± SE, discrete win rate, LC win rate ± SE, mean gold reward ± SE (synthetic
farm; NaN in the real farm, which has no gold reward), average length, n, annotator and
reference (`reference_label`). The LC win rate's instruction
difficulty is pooled over the other runs judged by the same annotator against the same
references (the evaluations on the board plus any `peer_runs`, e.g. the other
evaluations in the store), leaving out the row's own run (`farmflow.evaluation.lc`: a
run's own labels in its difficulty undo the length control).
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Any, Sequence

from farmflow.config import METHODS
from farmflow.evaluation.lc import instruction_difficulty, length_controlled_winrate, run_of_rows

COLUMNS = (
    "method",
    "family",
    "win_rate",
    "standard_error",
    "discrete_win_rate",
    "lc_win_rate",
    "lc_standard_error",
    "mean_gold",
    "gold_standard_error",
    "avg_length",
    "n",
    "annotator",
    "reference",
    "evaluation_key",
)
FAMILY_COLOURS = {"baseline": "#9e9e9e", "sft": "#4c72b0", "reward model": "#dd8452", "preferences": "#55a868"}


def method_family(method: str) -> str:
    """Colour group of a method in plots: baseline, sft, or what it learns from (`farmflow.config.METHODS`): the
    reward model or the preferences. `method` is a leaderboard name: best-of-n's carries its n (``best_of_16``)."""
    if method in ("untrained", "reference") or method.startswith(("sft (", "writer: ")):  # the study's baselines
        return "baseline"
    if method == "sft":
        return "sft"
    name = re.sub(r"_\d+$", "_n", method)
    return next((m.learns_from for m in METHODS.values() if name.startswith(m.name)), "preferences")


def annotator_label(config: dict[str, Any] | None) -> str:
    """A short name for an annotator config (an AnnotatorConfig dumped to JSON)."""
    if not config:
        return "unknown"
    noise = config.get("label_noise") or 0
    suffix = f", noise {noise:g}" if noise else ""
    if config.get("preset"):
        return f"{config['preset']}{suffix}"
    if config.get("kind") == "hf":
        return f"hf judge {(config.get('hf') or {}).get('model', '?')}{suffix}"
    if config.get("kind") == "api":
        models = sorted({a.get("model", "?") for a in config.get("api_pool") or []})
        return f"api pool ({len(config.get('api_pool') or [])}: {', '.join(models)}){suffix}"
    pool = config.get("pool") or []
    if len(pool) == 1:
        return f"oracle {pool[0].get('name', '?')}{suffix}"
    return f"oracle pool ({len(pool)}){suffix}"


MEASURED_JUDGES: dict[str, str] = {
    "smollm2-135m-instruct": "agrees with GPT-4 on 54.0% (95% CI 47.1-60.8) of 200 AlpacaEval pairs, a fair coin "
    "50%, 'the longer answer wins' 71.0%: a plumbing check, not a quality signal (docs/evaluation.md)",
}
"""hf judge model -> its measured agreement with reference labels (`farmflow eval annotators --judge hf:MODEL`)."""


def judge_quality(label: str | None) -> str | None:
    """What is known of how good the judge of an annotator label is: for an hf judge its measured agreement with GPT-4
    on AlpacaEval pairs, or how to measure it; None for the oracle and API pools (see docs/annotators.md)."""
    if not label or not label.startswith("hf judge "):
        return None
    model = label.removeprefix("hf judge ").split(",")[0]
    return MEASURED_JUDGES.get(model) or (
        f"agreement with human or GPT-4 labels not measured: farmflow eval annotators --judge hf:{model} FILE"
    )


def reference_label(data_key: str, data_config: dict[str, Any] | None = None) -> str:
    """What the evaluated outputs were judged against: the data artifact and, in the real farm, the
    evaluation set its references came from (e.g. the AlpacaEval file of Davinci003 outputs)."""
    label = f"reference outputs of data {data_key[:12]}"
    cfg = data_config or {}
    if cfg.get("source") == "local" and cfg.get("eval_path"):
        return f"{label} ({Path(cfg['eval_path']).name})"
    if cfg.get("source") == "hub":
        return f"{label} ({cfg.get('hub_name')}: alpaca_farm_evaluation)"
    return label


def _nan(x: object) -> float:
    return math.nan if x is None else float(x)


def leaderboard_rows(entries: Sequence[dict], peer_runs: dict[str, list[dict]] | None = None) -> list[dict]:
    """Leaderboard rows, best win rate first.

    Each entry: method, metrics (the evaluate stage's), rows (its ``evaluation`` table as
    dicts), annotator, reference, group (same group = same annotator and references),
    evaluation_key. `peer_runs[group]`: more runs (`lc.run_of_rows`) for the difficulty.
    """
    runs = [run_of_rows(e["rows"]) for e in entries]
    out = []
    for e, run in zip(entries, runs):
        m = e["metrics"]
        pooled = [r for r, other in zip(runs, entries) if other["group"] == e["group"]] + list(
            (peer_runs or {}).get(e["group"], [])
        )
        others = [r for r in pooled if r is not run and r != run]  # leave-one-run-out
        lc = length_controlled_winrate(
            run["instructions"],
            run["preferences"],
            run["delta_len"],
            instruction_difficulty(others) if others else None,
            len_reference=run["len_reference"],
        )
        out.append(
            {
                "method": e["method"],
                "family": method_family(e["method"]),
                "win_rate": m["win_rate"],
                "standard_error": m["standard_error"],
                "discrete_win_rate": _nan(m.get("discrete_win_rate")),
                "lc_win_rate": lc["lc_win_rate"],
                "lc_standard_error": lc["lc_standard_error"],
                "mean_gold": _nan(m.get("mean_gold")),
                "gold_standard_error": _nan(m.get("gold_standard_error")),
                "avg_length": int(m["avg_length"]),
                "n": int(m["n_total"]),
                "annotator": e["annotator"],
                "reference": e["reference"],
                "evaluation_key": e["evaluation_key"],
            }
        )
    out.sort(key=lambda r: -r["win_rate"])
    return out


def _num(x: object, fmt: str) -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def leaderboard_markdown(rows: Sequence[dict], title: str = "Leaderboard") -> str:
    """A Markdown table of leaderboard rows (already sorted), with the annotator and references below."""
    lines = [
        f"### {title}",
        "",
        "| method | win rate | ± SE | discrete | LC win rate | ± SE | mean gold | ± SE | avg length | n |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {_num(r['win_rate'], '.1f')} | {_num(r['standard_error'], '.1f')} | "
            f"{_num(r.get('discrete_win_rate'), '.1f')} | {_num(r.get('lc_win_rate'), '.1f')} | "
            f"{_num(r.get('lc_standard_error'), '.1f')} | {_num(r.get('mean_gold'), '.3f')} | "
            f"{_num(r.get('gold_standard_error'), '.3f')} | {r['avg_length']} | {r['n']} |"
        )
    judges = sorted({(r.get("annotator"), r.get("reference")) for r in rows if r.get("annotator")})
    if judges:
        lines.append("")
        lines += [f"Annotator: {a}; reference: {ref}." for a, ref in judges]
        lines += [f"The judge {note}." for note in sorted({judge_quality(a) for a, _ in judges} - {None})]
    note = resolution_note(rows)
    if note:
        lines += ["", note]
    return "\n".join(lines) + "\n"


def resolution_note(rows: Sequence[dict]) -> str | None:
    """What an evaluation of this size resolves: the median SE of a win rate over the rows, and the smallest difference
    between two methods' win rates that is more than noise at 95% (1.96·√2·SE for two independent estimates; a paired
    comparison on the same prompts, `--replicates`, often resolves less). None without standard errors."""
    ses = sorted(r["standard_error"] for r in rows if r.get("standard_error") and not math.isnan(r["standard_error"]))
    if not ses:
        return None
    se, n = ses[len(ses) // 2], max(int(r.get("n") or 0) for r in rows)
    return (
        f"With {n} evaluation prompts a win rate's SE is about {se:.1f} points: two methods must differ by more than "
        f"{1.96 * math.sqrt(2) * se:.1f} points to be told apart (95%; paired intervals: --replicates)."
    )


def plot_leaderboard(rows: Sequence[dict], path: str, title: str = "Win rate vs reference") -> None:
    """Horizontal bars of win rate ± SE, best at the top, coloured by method family; LC win rate as a diamond (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: r["win_rate"])
    se = lambda x: 0 if x is None or math.isnan(x) else x  # noqa: E731
    fig, ax = plt.subplots(figsize=(6.5, 0.5 * len(ordered) + 1.4), dpi=120)
    y = range(len(ordered))
    ax.barh(
        list(y),
        [r["win_rate"] for r in ordered],
        xerr=[se(r["standard_error"]) for r in ordered],
        color=[FAMILY_COLOURS[method_family(r["method"])] for r in ordered],
        capsize=3,
    )
    lc = [
        (i, r["lc_win_rate"])
        for i, r in zip(y, ordered)
        if r.get("lc_win_rate") is not None and not math.isnan(r["lc_win_rate"])
    ]
    if lc:
        ax.scatter(
            [v for _, v in lc], [i for i, _ in lc], marker="D", color="black", s=18, zorder=3, label="LC win rate"
        )
    ax.set_yticks(list(y), [r["method"] for r in ordered])
    ax.axvline(50, color="black", lw=0.8, ls="--")
    ax.set_xlim(0, 100)
    ax.set_xlabel("win rate vs reference outputs (%), ± 1 SE")
    ax.set_title(title)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in FAMILY_COLOURS.values()]
    labels = list(FAMILY_COLOURS)
    if lc:
        handles.append(plt.Line2D([], [], marker="D", color="black", ls=""))
        labels.append("LC win rate")
    ax.legend(handles, labels, loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
