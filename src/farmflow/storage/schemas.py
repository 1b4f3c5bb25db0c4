"""The explicit Parquet schema of every table kind in the store.

Writers cast to these schemas, so a missing or mistyped column fails at write time with
the table kind and column named, never later in a reader.
"""

from __future__ import annotations

import pyarrow as pa

_STR, _F, _I, _B = pa.string(), pa.float64(), pa.int64(), pa.bool_()

# the columns of a leaderboard row (evaluation.leaderboard_rows), shared by every table that holds leaderboard rows
_LEADERBOARD = [
    ("method", _STR),
    ("family", _STR),
    ("win_rate", _F),
    ("standard_error", _F),
    ("discrete_win_rate", _F),
    ("lc_win_rate", _F),
    ("lc_standard_error", _F),
    ("mean_gold", _F),
    ("gold_standard_error", _F),
    ("avg_length", _I),
    ("n", _I),
    ("annotator", _STR),
    ("reference", _STR),
    ("evaluation_key", _STR),
]

# what a leaderboard row cost (farmflow.evaluation.cost): compute seconds to train, to answer the evaluation set and to
# judge it, their sum, the API spend on its annotations and judgments, and whether it is on the win rate vs cost
# Pareto frontier; null where its stages' records are not in the store.
_COST = [
    ("train_seconds", _F),
    ("answer_seconds", _F),
    ("judge_seconds", _F),
    ("wall_seconds", _F),
    ("api_usd", _F),
    ("api_requests", _F),
    ("pareto", _B),
]

SCHEMAS: dict[str, pa.Schema] = {
    # data stage: every instruction of every split; `output` is the demonstration (sft),
    # the reference output (eval) or empty; `task` holds the synthetic task as JSON
    # (null in the real farm) so the gold reward can be computed later.
    "instructions": pa.schema(
        [
            ("id", _STR),
            ("split", _STR),
            ("family", _STR),
            ("instruction", _STR),
            ("input", _STR),
            ("output", _STR),
            ("task", _STR),
        ]
    ),
    # two samples of the SFT policy per PREF/val instruction.
    "pairs": pa.schema(
        [
            ("id", _STR),
            ("split", _STR),
            ("instruction", _STR),
            ("input", _STR),
            ("output_1", _STR),
            ("output_2", _STR),
            ("task", _STR),
        ]
    ),
    # preference in [1, 2]: 1 means output_1 preferred, 2 output_2 (AlpacaFarm convention).
    # p_1_shown_first / p_1_shown_second: the hf judge's probability that output_1 is better when it is
    # shown as (a) / as (b) (null for other annotators); their mean is 2 - preference, their gap the position bias.
    "preferences": pa.schema(
        [
            ("id", _STR),
            ("split", _STR),
            ("instruction", _STR),
            ("input", _STR),
            ("output_1", _STR),
            ("output_2", _STR),
            ("task", _STR),
            ("annotator", _STR),
            ("preference", _F),
            ("noised", _B),
            ("swapped", _B),
            ("gold_1", _F),
            ("gold_2", _F),
            ("p_1_shown_first", _F),
            ("p_1_shown_second", _F),
        ]
    ),
    # per-pair sequence log-probs of both outputs under a frozen policy (DPO's reference).
    "logps": pa.schema([("id", _STR), ("logp_1", _F), ("logp_2", _F)]),
    # one output per evaluation instruction, from a policy or a reranker.
    "outputs": pa.schema(
        [
            ("id", _STR),
            ("instruction", _STR),
            ("input", _STR),
            ("output", _STR),
            ("generator", _STR),
            ("task", _STR),
            ("score", _F),
        ]
    ),
    # per-instruction judgement against the reference: output_1 = reference, output_2 = evaluated.
    "evaluation": pa.schema(
        [
            ("id", _STR),
            ("instruction", _STR),
            ("input", _STR),
            ("output_1", _STR),
            ("output_2", _STR),
            ("generator", _STR),
            ("annotator", _STR),
            ("preference", _F),
            ("gold_1", _F),
            ("gold_2", _F),
        ]
    ),
    # the row-level annotation cache (a row log under _rows/annotations/, one chunk per
    # append): one judged pair per row, outputs in canonical order (sorted), preference
    # relative to that order (1: output_1 preferred, 2: output_2; null when failed).
    "annotations": pa.schema(
        [
            ("key", _STR),
            ("annotator", _STR),
            ("annotator_hash", _STR),
            ("model", _STR),
            ("instruction", _STR),
            ("input", _STR),
            ("output_1", _STR),
            ("output_2", _STR),
            ("preference", _F),
            ("status", _STR),
            ("error", _STR),
            ("raw_completion", _STR),
            ("prompt_tokens", _I),
            ("completion_tokens", _I),
            ("price_usd", _F),
            ("latency_s", _F),
            ("created", pa.timestamp("us", tz="UTC")),
            # what `farmflow annotations reparse` needs to read a stored completion again: the answer
            # format, this pair's number among the `items` of its request, and whether output_2
            # (canonical) was shown first
            ("prompt_format", _STR),
            ("item", _I),
            ("items", _I),
            ("swapped", _B),
            # the hf judge's P(output_1 better) with output_1 shown as (a) / as (b), canonical order
            # (null for API judges)
            ("p_1_shown_first", _F),
            ("p_1_shown_second", _F),
        ]
    ),
    # one row per evaluated method (evaluation.leaderboard_rows) with its cost; mean_gold is NaN without a gold reward.
    "leaderboard": pa.schema([*_LEADERBOARD, *_COST]),
    # a replicated comparison (evaluation.replicates): a leaderboard row per method (means over the replicates) plus
    # bootstrap intervals, the paired difference to SFT and the rank range (farmflow.evaluation.replicates).
    "replicate_leaderboard": pa.schema(
        [
            *_LEADERBOARD,
            ("replicates", _I),
            ("win_rate_low", _F),
            ("win_rate_high", _F),
            ("replicate_sd", _F),
            ("replicate_low", _F),
            ("replicate_high", _F),
            ("gold_low", _F),
            ("gold_high", _F),
            ("diff_to_sft", _F),
            ("diff_low", _F),
            ("diff_high", _F),
            ("diff_standard_error", _F),
            ("resolvable_difference", _F),
            ("resolved", _STR),
            ("gold_diff_to_sft", _F),
            ("gold_diff_low", _F),
            ("gold_diff_high", _F),
            ("rank_best", _I),
            ("rank_worst", _I),
        ]
    ),
    # the validation study (farmflow.evaluation.study): one row per method, its win rate under the simulated arm
    # (p_sim^eval) and the human-like arm with 95% bootstrap intervals, its difference to SFT under each, its ranks.
    "validation_study": pa.schema(
        [
            ("method", _STR),
            ("family", _STR),
            ("replicates", _I),
            ("n", _I),
            ("sim_win_rate", _F),
            ("sim_low", _F),
            ("sim_high", _F),
            ("human_win_rate", _F),
            ("human_low", _F),
            ("human_high", _F),
            ("mean_gold", _F),
            ("sim_diff_to_sft", _F),
            ("sim_diff_low", _F),
            ("sim_diff_high", _F),
            ("sim_resolved", _STR),
            ("human_diff_to_sft", _F),
            ("human_diff_low", _F),
            ("human_diff_high", _F),
            ("human_resolved", _STR),
            ("sim_rank", _F),
            ("human_rank", _F),
            ("gold_rank", _F),
            # the human-like arm's expectation (its label noise removed): NaN / '' where not computed
            ("expected_win_rate", _F),
            ("expected_low", _F),
            ("expected_high", _F),
            ("expected_diff_to_sft", _F),
            ("expected_diff_low", _F),
            ("expected_diff_high", _F),
            ("expected_resolved", _STR),
            ("expected_rank", _F),
        ]
    ),
    # the validation study's findings (study_summary.parquet beside it): one quantity per row with its 95% interval
    # (NaN where none) and a word or two (e.g. 'present' / 'absent' for an over-optimization curve).
    "study_summary": pa.schema([("quantity", _STR), ("value", _F), ("low", _F), ("high", _F), ("detail", _STR)]),
    # the validation study's over-optimization curves pooled over seeds (study_curves.parquet, with curve_replicates
    # above 1): per reward model (labeller), family, judge ('gold': mean gold ×100) and pressure, the mean of the
    # seeds' values with a 95% Student-t interval over the seeds (NaN with one seed).
    "study_curves": pa.schema(
        [
            ("family", _STR),
            ("labeller", _STR),
            ("judge", _STR),
            ("pressure", _F),
            ("seeds", _I),
            ("mean", _F),
            ("low", _F),
            ("high", _F),
        ]
    ),
    # the runs (a row log under _rows/runs/, one chunk per flow run that ends in a leaderboard: compare runs,
    # nightly and manual, and single-method flows): the run (run_id: the last 8 hex digits of its flow-run id,
    # when, which flow, preset, config key, whether it publishes the trend, its leaderboard artifact) followed
    # by one leaderboard row per method with its cost; mean gold null where there is no gold reward (the real farm).
    "runs": pa.schema(
        [
            ("run_id", _STR),
            ("flow_run_id", _STR),
            ("flow_run_name", _STR),
            ("flow", _STR),
            ("run_at", pa.timestamp("us", tz="UTC")),
            ("preset", _STR),
            ("config_key", _STR),
            ("history", _B),
            ("leaderboard_key", _STR),
            *_LEADERBOARD,
            *_COST,
        ]
    ),
    # the leaderboard history as stores kept it before the runs table (_rows/leaderboard_history/, one chunk
    # per nightly run; no longer written): read through the `leaderboard_history` DuckDB view, which adds the
    # runs recorded with history (farmflow.storage.sql).
    "leaderboard_history": pa.schema(
        [
            ("run_at", pa.timestamp("us", tz="UTC")),
            ("flow_run_id", _STR),
            ("flow_run_name", _STR),
            ("preset", _STR),
            ("config_key", _STR),
            ("leaderboard_key", _STR),
            *_LEADERBOARD,
        ]
    ),
    # over-optimization curves (evaluation.overopt): one row per (point, annotator); a point is
    # one optimization pressure (best-of-n's n, a PPO step) with its evaluation-set outputs;
    # labeller: the annotator whose labels trained the reward model the point was optimized against.
    "overoptimization": pa.schema(
        [
            ("labeller", _STR),
            ("label", _STR),
            ("family", _STR),
            ("pressure", _F),
            ("annotator", _STR),
            ("proxy_reward", _F),
            ("win_rate", _F),
            ("standard_error", _F),
            ("lc_win_rate", _F),
            ("mean_gold", _F),
            ("avg_length", _I),
            ("n", _I),
            ("outputs_key", _STR),
            ("evaluation_key", _STR),
        ]
    ),
    # the feedback-size study (flows.feedback): one row per (method, share of the PREF pairs); sft at 0 pairs;
    # reward_accuracy: the reward model's held-out accuracy (NaN where none was trained).
    "feedback": pa.schema(
        [
            ("method", _STR),
            ("fraction", _F),
            ("pairs", _I),
            ("win_rate", _F),
            ("standard_error", _F),
            ("mean_gold", _F),
            ("reward_accuracy", _F),
            ("evaluation_key", _STR),
        ]
    ),
    # every candidate best-of-n drew (an extra table of its artifact, candidates.parquet):
    # candidate `sample` of output row `id`, and its reward; rows prompt-major.
    "candidates": pa.schema([("id", _STR), ("sample", _I), ("output", _STR), ("reward", _F)]),
    # reward-model report (evaluation.reward_report): one row per (scorer, task family, target);
    # family "all" is every held-out pair; pairs = pairs counted (label and score ties left out).
    "reward_report": pa.schema(
        [("scorer", _STR), ("family", _STR), ("target", _STR), ("accuracy", _F), ("standard_error", _F), ("pairs", _I)]
    ),
}


def conform(table: pa.Table, kind: str, where: str = "") -> pa.Table:
    """Select and cast `table`'s columns to the schema of `kind`; one clear error otherwise."""
    if kind not in SCHEMAS:
        raise ValueError(f"unknown table kind {kind!r}; known: {', '.join(sorted(SCHEMAS))}")
    schema = SCHEMAS[kind]
    missing = [f.name for f in schema if f.name not in table.column_names]
    if missing:
        raise ValueError(f"{where or kind} table is missing column(s) {missing} required by schema {kind!r}")
    cols = []
    for f in schema:
        try:
            cols.append(table.column(f.name).cast(f.type))
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as err:
            raise ValueError(f"{where or kind} table: column {f.name!r} cannot be read as {f.type}: {err}") from None
    return pa.Table.from_arrays(cols, schema=schema)
