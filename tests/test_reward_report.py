"""The reward-model report: accuracies against hand-computed numbers, the pool's Bayes optimum, the flow on micro."""

from __future__ import annotations

import math
import random

import pytest

from farmflow.annotators import build_pool
from farmflow.annotators.oracle import pool_preference, sigmoid
from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.data import gold_reward
from farmflow.data.synthetic import correct_output, sample_task, task_to_json
from farmflow.evaluation.reward_report import report_markdown, report_rows
from farmflow.storage.schemas import SCHEMAS

A, B = '{"family": "arithmetic"}', '{"family": "sort"}'
ROWS = [
    {"preference": 2.0, "noised": False, "gold_1": 0.0, "gold_2": 1.0, "task": A},  # right on all three targets
    {"preference": 1.0, "noised": True, "gold_1": 0.0, "gold_2": 1.0, "task": A},  # a coin flip says 1; gold says 2
    {
        "preference": 1.0,
        "noised": False,
        "gold_1": 0.5,
        "gold_2": 0.5,
        "task": B,
    },  # gold tie: left out of the gold target
    {"preference": 2.0, "noised": False, "gold_1": 1.0, "gold_2": 0.0, "task": B},  # the annotator disagrees with gold
]
SCORES = ([0.0, 0.0, 1.0, 0.0], [1.0, 1.0, 0.0, 1.0])  # prefers output_2 except on row 2


def _cell(rows, scorer, family, target):
    (hit,) = [r for r in rows if (r["scorer"], r["family"], r["target"]) == (scorer, family, target)]
    return hit["accuracy"], hit["standard_error"], hit["pairs"]


def test_report_rows_hand_computed():
    rows = report_rows(ROWS, {"rm": SCORES, "flat": ([0.0] * 4, [0.0] * 4)})
    assert all(set(r) == set(SCHEMAS["reward_report"].names) for r in rows)
    assert len(rows) == 2 * 3 * 4  # 2 scorers × (all, arithmetic, sort) × 4 targets
    assert _cell(rows, "rm", "all", "labels") == pytest.approx((3 / 4, math.sqrt(0.75 * 0.25 / 4), 4))
    assert _cell(rows, "rm", "all", "unnoised") == pytest.approx((1.0, 0.0, 3))
    assert _cell(rows, "rm", "all", "gold") == pytest.approx((2 / 3, math.sqrt(2 / 9 / 3), 3))
    assert _cell(rows, "rm", "arithmetic", "labels") == pytest.approx((0.5, math.sqrt(0.25 / 2), 2))
    assert _cell(rows, "rm", "arithmetic", "unnoised") == pytest.approx((1.0, 0.0, 1))
    assert _cell(rows, "rm", "sort", "gold") == pytest.approx((0.0, 0.0, 1))
    assert _cell(rows, "rm", "all", "gold_ties") == pytest.approx((1.0, 0.0, 1))  # row 2 only
    assert _cell(rows, "rm", "arithmetic", "gold_ties")[2] == 0
    acc, se, n = _cell(rows, "flat", "all", "labels")  # a scorer that ties everything counts no pair
    assert n == 0 and math.isnan(acc) and math.isnan(se)
    md = report_markdown(rows, "T")
    assert "| rm | 0.750 ± 0.217 (4) | 1.000 ± 0.000 (3) | 0.667 ± 0.272 (3) | 1.000 ± 0.000 (1) |" in md
    assert "Per task family, against unnoised labels:" in md and "| rm | 1.000 ± 0.000 | 1.000 ± 0.000 |" in md
    assert "| flat | — (0) | — (0) | — (0) | — (0) |" in md


def test_gold_ties_target_is_the_judged_labels_on_pairs_of_equal_gold():
    rows = [
        {"preference": 2.0, "noised": False, "gold_1": 0.5, "gold_2": 0.5, "task": A},  # judged tie of gold: counted
        {"preference": 1.0, "noised": False, "gold_1": 0.2, "gold_2": 0.2, "task": A},  # judged tie of gold: counted
        {"preference": 2.0, "noised": True, "gold_1": 0.5, "gold_2": 0.5, "task": A},  # a coin flip: left out
        {"preference": 1.0, "noised": False, "gold_1": 0.0, "gold_2": 1.0, "task": A},  # gold differs: left out
        {"preference": 1.5, "noised": False, "gold_1": 1.0, "gold_2": 1.0, "task": A},  # the annotator tied: left out
    ]
    longer = ([1.0, 1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0, 2.0])  # always output_2
    assert _cell(report_rows(rows, {"longer": longer}, by_family=False), "longer", "all", "gold_ties") == pytest.approx(
        (0.5, math.sqrt(0.25 / 2), 2)
    )


def test_report_rows_on_real_data_has_no_gold_target_and_no_families():
    real = [{"preference": p, "noised": False, "gold_1": None, "gold_2": None, "task": ""} for p in (2.0, 1.0, 1.5)]
    rows = report_rows(real, {"rm": ([0.0, 0.0, 0.0], [1.0, 1.0, 1.0])})
    assert {(r["family"], r["target"]) for r in rows} == {("all", "labels"), ("all", "unnoised")}
    assert _cell(rows, "rm", "all", "labels") == pytest.approx((0.5, math.sqrt(0.25 / 2), 2))
    with pytest.raises(ValueError, match="scorer 'rm': 2/3 scores for 3 pairs"):
        report_rows(real, {"rm": ([0.0, 0.0], [1.0, 1.0, 1.0])})


def test_pool_preference_averages_annotators_and_shown_orders():
    task = sample_task("arithmetic", random.Random(3))
    right = correct_output(task)
    wrong = right.replace(
        str(task.params["a"] + task.params["b"] if task.params["op"] == "+" else task.params["a"] - task.params["b"]),
        "99",
    )
    row = {
        "instruction": task.instruction,
        "input": task.input,
        "task": task_to_json(task),
        "output_1": wrong,
        "output_2": right,
    }
    delta = gold_reward(row["task"], right) - gold_reward(row["task"], wrong)
    assert delta > 0
    pool = build_pool(
        AnnotatorConfig(
            pool=[
                OracleAnnotatorConfig(name="a", sharpness=2.0, position_bias=0.5),
                OracleAnnotatorConfig(name="b", sharpness=1.0),
            ]
        )
    )
    # "a" shown (wrong, right): sigmoid(2Δ − 0.5); shown (right, wrong): 1 − sigmoid(−2Δ − 0.5) = sigmoid(2Δ + 0.5);
    # "b": sigmoid(Δ)
    expected = (sigmoid(2 * delta - 0.5) + sigmoid(2 * delta + 0.5) + 2 * sigmoid(delta)) / 4
    assert pool_preference(pool, row) == pytest.approx(expected, rel=1e-12)
    flipped = {**row, "output_1": right, "output_2": wrong}
    assert pool_preference(pool, flipped) == pytest.approx(1 - expected, rel=1e-12)
    assert pool_preference(pool, {**row, "output_1": right}) == 0.5  # identical outputs: a tie


@pytest.mark.usefixtures("prefect_harness")
def test_reward_report_flow_micro(micro_config):
    from farmflow.flows.reward_report import reward_report_flow
    from farmflow.storage import open_store
    from farmflow.tasks.core import EXECUTED

    summary = reward_report_flow(advanced=micro_config)
    rows = summary["report"]
    scorers = {r["scorer"] for r in rows}
    assert scorers == {"reward_model", "longer_output", "policy_loglik", "gold", "pool_bayes"}
    store = open_store(micro_config.store.location)
    (rm_ref,) = [r for r in store.list() if r.stage == "train_reward"]
    # the report's reward-model row is the same measurement train_reward logged
    assert _cell(rows, "reward_model", "all", "labels")[0] == pytest.approx(rm_ref.metrics["heldout_accuracy"])
    assert _cell(rows, "reward_model", "all", "unnoised")[0] == pytest.approx(
        rm_ref.metrics["heldout_accuracy_unnoised"]
    )
    assert _cell(rows, "gold", "all", "gold")[:1] == (1.0,)
    bayes, _, n = _cell(rows, "pool_bayes", "all", "unnoised")
    assert (
        n > 0 and bayes >= _cell(rows, "gold", "all", "unnoised")[0] - 0.1
    )  # the optimum is not worse than gold by much
    assert {r["family"] for r in rows} >= {"all", "arithmetic"}
    assert "| reward_model |" in summary["markdown"] and summary["artifact"].endswith(summary["stages"][-1]["key"])
    from farmflow.storage.sql import connect

    con = connect(store)  # DuckDB: the reward_report view holds the same rows
    assert con.execute("SELECT count(*) FROM reward_report").fetchone()[0] == len(rows)
    assert (
        con.execute(
            "SELECT accuracy FROM reward_report WHERE scorer = 'gold' AND family = 'all' AND target = 'gold'"
        ).fetchone()[0]
        == 1.0
    )
    # real-farm preferences (no task, no gold): the reward model and the two model-free baselines, no families
    import pyarrow as pa

    from farmflow.tasks.analysis import reward_report_task

    prefs = store.get("annotate", store.record(rm_ref)["inputs"]["preferences"])
    real = [r | {"task": "", "gold_1": None, "gold_2": None} for r in store.read_table(prefs).to_pylist()]
    real_ref = store.put_table(
        "annotate", "real-like", pa.Table.from_pylist(real, schema=SCHEMAS["preferences"]), "preferences"
    )
    sft_ref = store.get("sft", store.record(rm_ref)["inputs"]["sft"])
    report = reward_report_task.fn(
        micro_config.store.location,
        {"annotation": micro_config.annotation.model_dump(mode="json")},
        preferences=real_ref,
        sft=sft_ref,
        reward=rm_ref,
        batch_size=7,
    )
    real_rows = store.read_table(report).to_pylist()
    assert {r["scorer"] for r in real_rows} == {"reward_model", "longer_output", "policy_loglik"}
    assert {(r["family"], r["target"]) for r in real_rows} == {("all", "labels"), ("all", "unnoised")}
    assert _cell(real_rows, "reward_model", "all", "labels")[0] == pytest.approx(rm_ref.metrics["heldout_accuracy"])
    before = dict(EXECUTED)
    again = reward_report_flow(advanced=micro_config)
    assert dict(EXECUTED) == before and repr(again["report"]) == repr(
        rows
    )  # all cached: nothing executes a second time (repr: NaN cells)
    # the report's key leaves out the annotation section's operational fields, so changing them does not rerun it
    ops = micro_config.model_copy(
        update={"annotation": micro_config.annotation.model_copy(update={"max_in_flight": 3, "timeout_s": 5.0})}
    )
    assert reward_report_flow(advanced=ops)["artifact"] == summary["artifact"] and dict(EXECUTED) == before
