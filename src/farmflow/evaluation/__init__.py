"""Evaluation: AlpacaEval-exact win rates, length control, leaderboards, annotator analysis.

* `stats`: win-rate statistics exactly as AlpacaEval defines them (`win_rate_stats`);
* `lc`: the length-controlled win rate (`length_controlled_winrate`, docs/evaluation.md);
* `leaderboard`: Markdown tables and plots of evaluated methods;
* `analysis`: annotator agreement, bias, variance, preferences, price; ranking correlations;
* `overopt`: over-optimization curves (proxy reward, win rate, gold reward vs pressure).

This module also judges a policy's outputs against the reference outputs
(`evaluate_outputs`, the evaluate stage's plain function).
"""

from __future__ import annotations

from typing import Sequence

import pyarrow as pa

from farmflow.annotators import annotate
from farmflow.config import AnnotatorConfig
from farmflow.evaluation.lc import instruction_difficulty, lc_of_rows, length_controlled_winrate, run_of_rows
from farmflow.evaluation.leaderboard import (
    annotator_label,
    leaderboard_markdown,
    leaderboard_rows,
    method_family,
    plot_leaderboard,
)
from farmflow.evaluation.stats import alpaca_eval_winrate, parse_preference, win_rate_stats
from farmflow.progress import progress
from farmflow.storage.schemas import SCHEMAS

# 3: LC win rate in the metrics; 4: gold_standard_error; 5: LC without the run's own labels; 6: AlpacaEval 2's GLM
VERSION = "6"

LEADERBOARD_LIBRARIES = ("sklearn.linear_model", "sklearn.model_selection", "matplotlib.pyplot")
"""What building a leaderboard imports when it runs (the length-controlled win rate's GLM, `glm_lc`; the plots), which
every run does: the CLI imports them while Prefect's temporary API starts, where they cost no wall time."""


def evaluate_outputs(
    outputs: Sequence[dict],
    references: Sequence[dict],
    annotator: AnnotatorConfig,
    store_uri: str | None = None,
) -> tuple[pa.Table, dict[str, float]]:
    """Judge each output against the reference output of the same instruction.

    `outputs` rows: id, instruction, input, output, generator, task. `references` rows: id,
    output (the eval split of the instructions table). Returns the ``evaluation`` table
    and the summary statistics (`win_rate_stats`, the reference's mean gold reward, and the
    LC win rate: the length term alone, since a run's own labels never set its difficulty). API and hf annotators
    use the row cache of the store at `store_uri`.
    """
    ref_by_id = {r["id"]: r["output"] for r in references}
    missing = [o["id"] for o in outputs if o["id"] not in ref_by_id]
    if missing:
        raise ValueError(f"{len(missing)} evaluated outputs have no reference output (first: {missing[0]!r})")
    pairs = [
        {
            "id": o["id"],
            "split": "eval",
            "instruction": o["instruction"],
            "input": o["input"],
            "task": o["task"],
            "output_1": ref_by_id[o["id"]],
            "output_2": o["output"],
        }
        for o in outputs
    ]
    if annotator.kind != "oracle":  # minutes for an API pool or an hf judge; the offline pool takes milliseconds
        with progress("evaluate: annotate", len(pairs), unit="pair") as bar:
            judged = annotate(pairs, annotator, store_uri, progress=bar.update)[0].to_pylist()
    else:
        judged = annotate(pairs, annotator, store_uri)[0].to_pylist()
    generator = {o["id"]: o["generator"] for o in outputs}
    rows = [
        {
            k: r[k]
            for k in (
                "id",
                "instruction",
                "input",
                "output_1",
                "output_2",
                "annotator",
                "preference",
                "gold_1",
                "gold_2",
            )
        }
        | {"generator": generator[r["id"]]}
        for r in judged
    ]
    table = pa.Table.from_pylist(rows, schema=SCHEMAS["evaluation"])
    stats = win_rate_stats([r["preference"] for r in rows], [r["output_2"] for r in rows], [r["gold_2"] for r in rows])
    ref_gold = [r["gold_1"] for r in rows if r["gold_1"] is not None]
    stats["reference_mean_gold"] = sum(ref_gold) / len(ref_gold) if ref_gold else float("nan")
    lc = lc_of_rows(rows)  # no other runs here: the length term alone; leaderboards pool the other runs
    stats.update({k: lc[k] for k in ("lc_win_rate", "lc_standard_error", "lc_length_coef")})
    return table, stats


__all__ = [
    "LEADERBOARD_LIBRARIES",
    "VERSION",
    "alpaca_eval_winrate",
    "annotator_label",
    "leaderboard_rows",
    "evaluate_outputs",
    "instruction_difficulty",
    "lc_of_rows",
    "leaderboard_markdown",
    "length_controlled_winrate",
    "method_family",
    "parse_preference",
    "plot_leaderboard",
    "run_of_rows",
    "win_rate_stats",
]
