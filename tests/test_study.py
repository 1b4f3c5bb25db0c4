"""The validation study: the human-like arm's calibration, findings on hand-made cases, the flow on synthetic-micro."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from prefect_server import all_artifacts

from farmflow import tasks
from farmflow.evaluation.bootstrap import N_BOOT, spearman
from farmflow.evaluation.study import (
    agreement,
    calibrate_sharpness,
    curves_markdown,
    curves_over_seeds,
    gold_differences,
    human_like_annotator,
    is_method,
    is_writer,
    labelled_arm_agreement,
    labelled_arm_size,
    majority,
    over_seeds,
    overoptimization_findings,
    proxy_fall_correlations,
    proxy_findings,
    resolution_rows,
    simulated_agreement,
    study_markdown,
    study_rows,
    study_summary,
    top_agreement,
    top_candidates,
    writers,
)


def test_leave_one_out_agreement_as_computed_by_hand():
    # q = sigmoid(s·Δ) = 3/4 at Δ = 0.1, s = ln 3 / 0.1. The mode of three judgements prefers the better output with
    # m = q³ + 3q²(1 − q) = 27/64 + 27/64 = 27/32; a held-out judgement agrees with it with qm + (1 − q)(1 − m)
    # = 81/128 + 5/128 = 86/128
    s = math.log(3) / 0.1
    assert majority(np.array([0.75]))[0] == pytest.approx(27 / 32)
    assert agreement(np.array([0.1, -0.1]), s) == pytest.approx(86 / 128)
    # against a single other judgement it is two judgements agreeing: q² + (1 − q)² = 9/16 + 1/16
    assert agreement(np.array([0.1, -0.1]), s, others=1) == pytest.approx(0.625)
    # a tied mode of two others is broken by a coin: m = q² + q(1 − q) = q
    assert majority(np.array([0.75]), others=2)[0] == pytest.approx(0.75)
    assert agreement(np.array([math.nan]), 1.0) == 1.0  # the same output twice: always a tie
    assert agreement(np.array([0.0]), 50.0) == 0.5  # equal gold: a coin flip


def test_calibrated_sharpness_gives_the_human_agreement():
    # every pair Δ = 0.1. With t = 2q − 1 the leave-one-out agreement is 1/2 + (3t² − t⁴)/4, so agreement 0.657 has
    # t² = (3 − √(9 − 16·0.157)) / 2 = 0.22642, q = 0.73792, s = logit(q) / 0.1 = 10.35
    s, reached = calibrate_sharpness(np.full(50, 0.1), 0.657)
    q = (1 + math.sqrt((3 - math.sqrt(9 - 16 * 0.157)) / 2)) / 2
    assert q == pytest.approx(0.73792, abs=1e-5)
    assert s == pytest.approx(math.log(q / (1 - q)) / 0.1, rel=5e-3)  # 3 significant digits
    assert reached == agreement(np.full(50, 0.1), s) == pytest.approx(0.657, abs=2e-3)  # 10.4, not 10.35
    # half the pairs of equal gold cap agreement at (1 + 0.5) / 2 = 0.75: below 0.657 is still reachable, 0.8 is not
    capped = np.array([0.1] * 10 + [0.0] * 10)
    assert calibrate_sharpness(capped, 0.7)[1] == pytest.approx(0.7, abs=1e-3)
    s_max, best = calibrate_sharpness(capped, 0.8)
    assert s_max == 1e4 and best == pytest.approx(0.75)
    judge = human_like_annotator(s, seed=3)
    assert judge.label_noise == 0 and judge.seed == 3 and len(judge.pool) == 1
    assert (judge.pool[0].length_bias, judge.pool[0].list_bias, judge.pool[0].position_bias) == (0, 0, 0)


def test_simulated_labels_scored_against_the_human_like_mode():
    # sharpness ln 3 / 0.1: on a pair 0.1 better on the second the human-like mode prefers it with m = 27/32
    s = math.log(3) / 0.1
    rows = [
        {"id": "a", "output_1": "x", "output_2": "y", "gold_1": 0.5, "gold_2": 0.6, "preference": 2.0},  # 27/32
        {"id": "b", "output_1": "x", "output_2": "y", "gold_1": 0.5, "gold_2": 0.6, "preference": 1.0},  # 5/32
        {"id": "c", "output_1": "x", "output_2": "y", "gold_1": 0.5, "gold_2": 0.6, "preference": 1.5},  # 1/2
        {"id": "d", "output_1": "x", "output_2": "x", "gold_1": 0.5, "gold_2": 0.5, "preference": 1.5},  # tie, tie
        {"id": "e", "output_1": "x", "output_2": "y", "gold_1": 0.5, "gold_2": 0.6, "preference": None},  # left out
    ]
    assert simulated_agreement(rows, s) == pytest.approx((27 / 32 + 5 / 32 + 0.5 + 1.0) / 4)
    assert simulated_agreement(rows[:1], 1e4) == pytest.approx(1.0)  # a sure mode, a label that matches it


def test_gold_differences_need_gold():
    rows = [{"id": "a", "output_1": "x", "output_2": "y", "gold_1": 0.2, "gold_2": 0.5}]
    assert gold_differences(rows)[0] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="no gold reward"):
        gold_differences([{"id": "b", "output_1": "x", "output_2": "y", "gold_1": None, "gold_2": None}])


def _rows(prefs, gold=0.5):
    return [{"id": f"p{i}", "preference": p, "gold_2": gold} for i, p in enumerate(prefs)]


def test_study_rows_rank_methods_under_both_arms():
    n = 40
    sim = {
        "untrained": [_rows([1.0] * n, 0.0)],
        "sft": [_rows([1.0, 2.0] * (n // 2), 0.5)],
        "dpo": [_rows([2.0] * n, 0.7)],
    }
    human = {  # the human-like arm agrees on the order
        "untrained": [_rows([1.0] * n)],
        "sft": [_rows([1.0] * (n // 2) + [2.0] * (n // 2))],
        "dpo": [_rows([2.0] * (n - 4) + [1.0] * 4)],
    }
    sim["sft (4 epochs)"], human["sft (4 epochs)"] = [_rows([1.0] * n, 0.1)], [_rows([1.0] * n)]
    rows = {r["method"]: r for r in study_rows(sim, human, n_boot=300)}
    assert rows["dpo"]["sim_win_rate"] == 100.0 and rows["dpo"]["human_win_rate"] == 90.0
    assert math.isnan(rows["sft (4 epochs)"]["sim_rank"]) and rows["sft (4 epochs)"]["sim_resolved"] == "worse"
    assert rows["dpo"]["sim_resolved"] == "better" and rows["dpo"]["human_resolved"] == "better"
    assert (rows["dpo"]["sim_rank"], rows["sft"]["sim_rank"]) == (1.0, 2.0)
    assert (rows["dpo"]["gold_rank"], rows["dpo"]["human_rank"]) == (1.0, 1.0)
    assert math.isnan(rows["untrained"]["sim_rank"])  # left out of the rankings
    assert rows["sft"]["sim_resolved"] == "" and rows["dpo"]["mean_gold"] == pytest.approx(0.7)


def test_study_summary_compares_both_arms_with_gold():
    # three methods on 20 prompts, the reference "ref" scoring 0.5. Gold orders dpo (0.9) > sft (0.7) > ppo (0.6); the
    # simulator follows gold, the human-like arm reverses it
    def rows(gold, prefs, output):
        return [
            {
                "id": f"p{i}",
                "instruction": f"q{i}",
                "input": "",
                "output_1": "ref",
                "output_2": output,
                "gold_1": 0.5,
                "gold_2": gold,
                "preference": p,
            }
            for i, p in enumerate(prefs)
        ]

    gold = {"dpo": 0.9, "sft": 0.7, "ppo": 0.6}
    sim = {
        m: [rows(g, [2.0] * (10 + 3 * k) + [1.0] * (10 - 3 * k), f"{m} answer")]
        for k, (m, g) in zip((2, 1, 0), gold.items())
    }
    human = {
        m: [rows(g, [2.0] * (10 + 3 * k) + [1.0] * (10 - 3 * k), f"{m} answer")]
        for k, (m, g) in zip((0, 1, 2), gold.items())
    }
    sharpness = math.log(3) / 0.1  # q = 3/4 at Δ = 0.1: the mode of three prefers the better output with 27/32
    found = {
        f["quantity"]: f
        for f in study_summary(
            sim, human, study_rows(sim, human, n_boot=200), {"sharpness": sharpness, "agreement": 0.7}
        )
    }
    assert found["Spearman (sim, gold)"]["value"] == pytest.approx(1.0)
    assert found["Spearman (human-like, gold)"]["value"] == pytest.approx(-1.0)
    assert found["Spearman (sim, human-like)"]["value"] == pytest.approx(-1.0)
    # the arm's labels reverse gold here, but what it would converge to with many labels per pair follows gold (q
    # grows with Δ = 0.1, 0.2, 0.4), so against its expectation the simulator ranks exactly alike
    assert found["Spearman (sim, human-like expected)"]["value"] == pytest.approx(1.0)
    # the yardstick: the arm's expectation against arms drawn from it (the 20 labels per method are that draw's size)
    from farmflow.evaluation.study import expected_judgements

    q = expected_judgements(human, sharpness)
    same = [np.zeros((1, 20), dtype=bool)] * 3
    yardstick = labelled_arm_agreement([q[m] for m in gold], same, n_draws=N_BOOT)
    assert found["Spearman (human-like expected, human-like draws)"]["value"] == yardstick["spearman"]
    assert found["Pearson (human-like expected, human-like draws)"]["high"] == yardstick["pearson_high"]
    assert 0.5 < yardstick["spearman"] < 1.0  # q 0.75, 0.9, 0.99 on 20 pairs: mostly, not always, in gold's order
    size = found["judgements per pair for the yardstick to reach 0.9"]
    # 20 labels per system already give 0.91 here, so one judgement per pair reaches the goal
    assert yardstick["spearman"] > 0.9
    assert size["value"] == labelled_arm_size([q[m] for m in gold], same)["judgements"] == 1
    assert "1 × 20 labels per system" in size["detail"]
    assert found["human-like agreement (a judgement vs the mode of three others)"]["value"] == 0.7
    # output_2 is 0.1–0.4 of gold better on every pair: the human-like mode prefers it with m(Δ), so a label for
    # output_2 agrees with it with m and one for output_1 with 1 − m
    m = {x: majority(np.array([1 / (1 + math.exp(-sharpness * (g - 0.5)))]))[0] for x, g in gold.items()}
    expected = np.mean([m[x] if r["preference"] == 2.0 else 1 - m[x] for x, runs in sim.items() for r in runs[0]])
    assert found["p_sim^eval agreement with the human-like mode"]["value"] == pytest.approx(expected)
    # every method answer ("dpo answer") is longer than "ref": the longer output's share is that of labels for
    # output_2, 16 + 13 + 10 of 60 under either arm
    assert found["longer output preferred by p_sim^eval"]["value"] == pytest.approx(39 / 60)
    assert found["longer output preferred by human-like"]["value"] == pytest.approx(39 / 60)
    assert "Spearman (sim, human-like), pipeline systems" not in found  # no baselines, no second set


def test_the_expected_human_like_score_of_a_pair_is_q_of_its_gold_difference():
    from farmflow.evaluation.study import expected_judgements

    def row(i, gold_1, gold_2, same=False):
        out_2 = "a" if same else "b"
        return {"id": f"p{i}", "output_1": "a", "output_2": out_2, "gold_1": gold_1, "gold_2": gold_2}

    sharpness = math.log(3) / 0.1  # q = 3/4 at Δ = +0.1, 1/4 at Δ = −0.1
    human = {
        "sft": [[row(0, 0.5, 0.6), row(1, 0.6, 0.5), row(2, 0.5, 0.5, same=True)]],
        # the same prompts in another order, one more that sft lacks (left out: scores are paired on prompts)
        "dpo": [[row(2, 0.2, 0.4), row(1, 0.5, 0.5), row(0, 0.5, 0.7), row(3, 0.0, 1.0)]],
    }
    found = expected_judgements(human, sharpness)
    assert found["sft"][0].tolist() == pytest.approx([0.75, 0.25, 0.5])  # identical outputs: a sure tie
    assert found["dpo"][0].tolist() == pytest.approx([0.9, 0.5, 0.9])  # q(0.2) = 9/(9 + 1): the odds square
    # the labels play no part: rows without any and rows all for output_2 give the same expectation
    labelled = {m: [[r | {"preference": 2.0} for r in runs[0]]] for m, runs in human.items()}
    assert expected_judgements(labelled, sharpness)["dpo"].tolist() == found["dpo"].tolist()


def test_a_labelled_arm_drawn_from_its_expectation_agrees_with_it_as_computed_by_hand():
    one = np.zeros((1, 1), dtype=bool)
    # two systems judged once each, q = 0.6 and 0.4: the draw ranks them alike with 0.6·0.6, reversed with 0.4·0.4,
    # and ties them (no ranking, left out) otherwise, so Spearman averages (0.36 − 0.16) / 0.52
    c = labelled_arm_agreement([np.full((1, 1), 0.6), np.full((1, 1), 0.4)], [one, one], n_draws=40_000)
    assert c["spearman"] == pytest.approx(0.2 / 0.52, abs=0.02)
    assert (c["spearman_low"], c["spearman_high"]) == (-1.0, 1.0)
    # judgements without noise (q 0 or 1) are their expectation: every draw agrees exactly
    sure = [np.array([[1.0, 1.0, 0.0]]), np.array([[1.0, 0.0, 0.0]]), np.array([[0.0, 0.0, 0.0]])]
    none = [np.zeros((1, 3), dtype=bool)] * 3
    c = labelled_arm_agreement(sure, none, n_draws=50)
    assert (c["spearman"], c["spearman_low"], c["spearman_high"]) == (1.0, 1.0, 1.0)
    assert c["pearson"] == pytest.approx(1.0)
    # a pair of identical outputs is a tie (0.5) in every draw, not a coin: between a sure win and a sure loss it
    # keeps the middle rank (drawn as a coin it would tie one of the two and Spearman would fall to 0.87)
    middle = labelled_arm_agreement(
        [np.ones((1, 1)), np.full((1, 1), 0.5), np.zeros((1, 1))], [one, ~one, one], n_draws=50
    )
    assert middle["spearman"] == 1.0
    with pytest.raises(ValueError, match="systems"):
        labelled_arm_agreement([np.ones((1, 2))], [np.zeros((1, 2), dtype=bool)])


def test_the_yardstick_grows_with_judgements_per_pair_as_the_binomial_says():
    # two systems, one pair each, q = 0.6 and 0.4, each pair judged m times: the draw ranks them alike when the
    # first gets more of its m labels than the second, reversed when fewer, and ties them (left out) otherwise, so
    # the mean Spearman is (P(X > Y) − P(X < Y)) / (1 − P(X = Y)) with X ~ Bin(m, 0.6), Y ~ Bin(m, 0.4)
    def exact(m: int) -> float:
        x = [math.comb(m, k) * 0.6**k * 0.4 ** (m - k) for k in range(m + 1)]
        y = [math.comb(m, k) * 0.4**k * 0.6 ** (m - k) for k in range(m + 1)]
        above = sum(x[i] * y[j] for i in range(m + 1) for j in range(i))
        below = sum(x[i] * y[j] for i in range(m + 1) for j in range(i + 1, m + 1))
        return (above - below) / (above + below)

    assert (round(exact(1), 4), round(exact(5), 4), round(exact(6), 4)) == (0.3846, 0.5841, 0.6157)
    one = np.zeros((1, 1), dtype=bool)
    q = [np.full((1, 1), 0.6), np.full((1, 1), 0.4)]
    assert labelled_arm_agreement(q, [one, one], 100_000, judgements=6)["spearman"] == pytest.approx(exact(6), abs=0.01)
    # 0.6 lies between m = 5 and m = 6 (7 Monte Carlo SEs from either at 100,000 draws); 0.7 between 9 and 10
    found = labelled_arm_size(q, [one, one], goal=0.6, n_draws=100_000)
    assert found["judgements"] == 6
    assert found["spearman"] == pytest.approx(exact(6), abs=0.01)
    assert labelled_arm_size(q, [one, one], goal=0.7, n_draws=100_000)["judgements"] == 10
    # an arm without noise is at its goal with the labels it has; two systems 0.04 apart are not within 8 labels
    sure = [np.array([[1.0, 1.0]]), np.array([[1.0, 0.0]])]
    assert labelled_arm_size(sure, [np.zeros((1, 2), dtype=bool)] * 2)["judgements"] == 1
    close = labelled_arm_size([np.full((1, 1), 0.52), np.full((1, 1), 0.48)], [one, one], most=8)
    assert math.isnan(close["judgements"]) and 0 < close["spearman"] < 0.3
    with pytest.raises(ValueError, match="judgements"):
        labelled_arm_agreement(q, [one, one], judgements=0)


def test_study_rows_score_each_method_under_the_human_like_expectation_too():
    # 20 prompts; the reference scores 0.5 of gold, sft's answers 0.6, dpo's 0.7. Every human-like label went to the
    # reference: the arm ties them at 0, while its expectation is q(Δ) on every prompt
    sharpness = math.log(3) / 0.1  # q(0.1) = 3/4, q(0.2) = 9/10

    def rows(gold, pref):
        return [
            {"id": f"p{i}", "output_1": "ref", "output_2": f"{gold}", "gold_1": 0.5, "gold_2": gold, "preference": pref}
            for i in range(20)
        ]

    sim = {"sft": [rows(0.6, 2.0)], "dpo": [rows(0.7, 2.0)]}
    human = {"sft": [rows(0.6, 1.0)], "dpo": [rows(0.7, 1.0)]}
    found = {r["method"]: r for r in study_rows(sim, human, n_boot=200, sharpness=sharpness)}
    assert (found["sft"]["human_win_rate"], found["dpo"]["human_resolved"]) == (0.0, "tied")
    assert found["sft"]["expected_win_rate"] == pytest.approx(75.0)
    assert found["dpo"]["expected_win_rate"] == pytest.approx(90.0)
    # the same difference on every prompt: its interval is the point itself, so it is resolved
    assert found["dpo"]["expected_diff_to_sft"] == pytest.approx(15.0)
    assert found["dpo"]["expected_diff_low"] == pytest.approx(15.0) and found["dpo"]["expected_resolved"] == "better"
    assert (found["dpo"]["expected_rank"], found["sft"]["expected_rank"]) == (1.0, 2.0)
    assert found["sft"]["expected_resolved"] == ""  # the baseline itself
    # study.md: the expectation's win rate and difference beside the arms', its rank among the others
    lines = study_markdown(list(found.values()), []).splitlines()
    dpo = next(line for line in lines if line.startswith("| dpo |"))
    # ranks: both arms' win rates tie (100 and 100, 0 and 0); the expectation and gold put dpo first
    assert dpo.endswith("| 90.0, +15.0 [+15.0, +15.0] better | 1.5 / 1.5 / 1 / 1 |")
    # without the sharpness the columns are there, empty
    plain = {r["method"]: r for r in study_rows(sim, human, n_boot=200)}
    assert math.isnan(plain["dpo"]["expected_win_rate"]) and plain["dpo"]["expected_resolved"] == ""


def test_baselines_stay_out_of_the_methods_ranking():
    assert is_method("dpo") and is_method("sft") and is_method("best_of_16")
    assert not is_method("untrained") and not is_method("sft (4 epochs)")
    assert not is_method("writer: reference (error 0)") and is_writer("writer: reference (error 0)")
    assert not is_writer("sft (4 epochs)") and not is_writer("untrained")


def test_the_rankings_compare_methods_pipeline_systems_and_all_systems():
    from farmflow.evaluation.study import ranked_sets

    names = ["dpo", "sft", "untrained", "sft (4 epochs)", "writer: reference (error 0)"]
    sets = ranked_sets(names)
    assert {k: v[0] for k, v in sets.items()} == {
        "": ["dpo", "sft"],
        ", pipeline systems": ["dpo", "sft", "untrained", "sft (4 epochs)"],
        ", all systems": names,
    }
    assert (
        sets[", all systems"][1] == "5 systems: the methods and untrained, sft (4 epochs), writer: reference (error 0)"
    )
    # without writers the pipeline's systems are all systems: one set, not two equal ones
    assert list(ranked_sets(names[:4])) == ["", ", pipeline systems"]
    assert list(ranked_sets(["dpo", "sft"])) == [""]


def test_the_writers_are_the_farms_reference_policy_demonstrator_and_a_flawless_reference():
    from farmflow.config import DataConfig

    assert writers(DataConfig(reference_error_rate=0.9, demo_error_rate=0.2)) == {
        "writer: reference (error 0.9)": ("reference", 0.9),
        "writer: demonstrator (error 0.2)": ("demonstrator", 0.2),
        "writer: reference (error 0)": ("reference", 0.0),
    }


def test_the_write_stage_answers_every_eval_row_then_is_cached(tmp_path):
    from farmflow.config import DataConfig
    from farmflow.data import gold_reward, split_rows
    from farmflow.storage import open_store
    from farmflow.tasks import data_task, write_task

    store_uri = str(tmp_path / "store")
    data = data_task.fn(store_uri, DataConfig(sft_size=2, pref_size=2, unlabeled_size=0, val_size=2, eval_size=30))
    eval_rows = split_rows(open_store(store_uri).read_table(data), "eval")
    config = {"writer": "reference", "error_rate": 0.0, "generator": "writer: reference (error 0)", "seed": 7}
    tasks.EXECUTED.clear()
    ref = write_task.fn(store_uri, config, data=data)
    rows = open_store(store_uri).read_table(ref).to_pylist()
    assert [r["id"] for r in rows] == [r["id"] for r in eval_rows]
    assert {r["generator"] for r in rows} == {"writer: reference (error 0)"}
    # without mistakes every answer earns full gold
    assert [gold_reward(r["task"], r["output"]) for r in rows] == [1.0] * 30
    assert write_task.fn(store_uri, config, data=data) == ref and sum(tasks.EXECUTED.values()) == 1
    flawed = write_task.fn(store_uri, config | {"error_rate": 0.9}, data=data)
    golds = [gold_reward(r["task"], r["output"]) for r in open_store(store_uri).read_table(flawed).to_pylist()]
    assert flawed.key != ref.key and sum(golds) / len(golds) < 0.8
    # another seed: other draws of the same policy
    other = write_task.fn(store_uri, config | {"error_rate": 0.9, "seed": 8}, data=data)
    outs = [[r["output"] for r in open_store(store_uri).read_table(x).to_pylist()] for x in (flawed, other)]
    assert outs[0] != outs[1]


def test_what_the_evaluation_set_resolves_under_each_arm():
    # 400 prompts. SE from the 95% interval: (high − low) / 3.92. Paired half-widths to SFT: simulated 2 and 4 (median
    # 3: 400·(3/2)² = 900 prompts for 2 points), human-like 4 and 6 (median 5: 400·(5/2)² = 2,500)
    def row(method, sim, human, sim_half, human_half):
        nan = math.nan
        return {
            "method": method,
            "n": 400,
            "sim_low": 50 - sim,
            "sim_high": 50 + sim,
            "human_low": 50 - human,
            "human_high": 50 + human,
            "sim_diff_to_sft": 0.0 if sim_half else nan,
            "sim_diff_low": -sim_half if sim_half else nan,
            "sim_diff_high": sim_half if sim_half else nan,
            "human_diff_to_sft": 0.0 if human_half else nan,
            "human_diff_low": -human_half if human_half else nan,
            "human_diff_high": human_half if human_half else nan,
        }

    rows = [row("sft", 3.92, 7.84, 0, 0), row("dpo", 3.92, 7.84, 2, 4), row("ppo", 3.92, 7.84, 4, 6)]
    found = {f["quantity"]: f for f in resolution_rows(rows)}
    assert found["win rate SE (points)"]["value"] == pytest.approx(2.0)
    assert found["win rate SE (points), human-like"]["value"] == pytest.approx(4.0)
    assert found["resolvable difference to SFT (points)"]["value"] == pytest.approx(3.0)
    assert found["resolvable difference to SFT (points), human-like"]["value"] == pytest.approx(5.0)
    assert found["prompts to resolve 2 points"]["value"] == 900
    assert (found["prompts to resolve 2 points"]["low"], found["prompts to resolve 2 points"]["high"]) == (400, 1600)
    assert found["prompts to resolve 2 points, human-like"]["value"] == 2500


def test_overoptimization_is_present_only_when_the_peak_beats_the_end():
    n = 60
    peaked = [
        {"pressure": 1, "rows": _rows([1.0, 2.0] * (n // 2))},
        {"pressure": 4, "rows": _rows([2.0] * n)},
        {"pressure": 16, "rows": _rows([1.0] * n)},
    ]
    rising = [
        {"pressure": 1, "rows": _rows([1.0] * n)},
        {"pressure": 4, "rows": _rows([1.0, 2.0] * (n // 2))},
        {"pressure": 16, "rows": _rows([2.0] * n)},
    ]
    found = overoptimization_findings({("a", "best_of_n", "a"): peaked, ("g", "best_of_n", "g"): rising}, n_boot=300)
    assert found[0]["detail"].startswith("present (best at 4, last 16)")
    assert (found[0]["value"], found[0]["low"], found[0]["high"]) == (100.0, 100.0, 100.0)
    assert found[1]["detail"].startswith("absent (best at 16, last 16)") and found[1]["value"] == 0.0
    # out of sample: either half of the prompts puts the peaked curve's peak at n = 4, the rising one's at 16
    held = {f["quantity"]: f for f in found}
    a = held["out-of-sample over-optimization: best_of_n, reward model on a labels, judged by a"]
    assert a["value"] == 100.0 and a["detail"] == "present (peaks at 4 and 4 on the two halves, last 16)"
    g = held["out-of-sample over-optimization: best_of_n, reward model on g labels, judged by g"]
    assert g["value"] == 0.0 and g["detail"] == "absent (peaks at 16 and 16 on the two halves, last 16)"


def test_a_peak_chosen_out_of_sample_does_not_see_a_fall_in_noise():
    # two prompts, one to a half. Point a wins prompt 0 only, point b prompt 1 only, the last point neither: the best
    # of the curve's own means (a, 0.5) is 50 points above the last. Out of sample, prompt 0 is scored where prompt 1
    # peaks (b: 0) and prompt 1 where prompt 0 peaks (a: 0): no fall, whichever prompt lands in which half
    curve = [
        {"pressure": 1, "rows": _rows([2.0, 1.0])},
        {"pressure": 2, "rows": _rows([1.0, 2.0])},
        {"pressure": 4, "rows": _rows([1.0, 1.0])},
    ]
    found = {f["quantity"]: f for f in overoptimization_findings({("p_sim^ann", "best_of_n", "j"): curve}, n_boot=50)}
    assert found["over-optimization: best_of_n, reward model on p_sim^ann labels, judged by j"]["value"] == 50.0
    held = found["out-of-sample over-optimization: best_of_n, reward model on p_sim^ann labels, judged by j"]
    assert held["value"] == 0.0 and held["detail"].startswith("absent (peaks at 2 and 1 on the two halves")


def test_over_seeds_a_flat_curve_falls_from_its_own_best_point_but_not_out_of_sample():
    # 40 seeds of two flat curves (7 points, every label a fair coin, 200 prompts): the best of 7 noisy means lies
    # about 1.35 SE above the others, so the in-sample fall averages several points and its interval over the seeds
    # excludes 0; the out-of-sample fall and contrast average 0 within their intervals
    rng = np.random.default_rng(0)

    def flat():
        return [{"pressure": 2**k, "rows": _rows(list(rng.choice([1.0, 2.0], 200)))} for k in range(7)]

    per_seed = [
        overoptimization_findings({("p_sim^ann", "best_of_n", "j"): flat(), ("greedy", "best_of_n", "j"): flat()}, 100)
        for _ in range(40)
    ]
    pooled = {f["quantity"]: f for f in over_seeds(per_seed)}
    naive = pooled["over-optimization: best_of_n, reward model on greedy labels, judged by j, over 40 seeds"]
    assert naive["value"] > 3.0 and naive["low"] > 0
    for q in ("over-optimization: best_of_n, reward model on greedy labels", "over-optimization contrast: best_of_n"):
        held = next(f for k, f in pooled.items() if k.startswith(f"out-of-sample {q}"))
        assert held["low"] < 0 < held["high"] and abs(held["value"]) < 2.0, held
    contrast = pooled["out-of-sample over-optimization contrast: best_of_n, judged by j, over 40 seeds"]
    assert contrast["detail"].startswith("resolved on ")  # pooled as a contrast, counting resolved seeds


def test_the_fig5_contrast_is_p_sim_anns_fall_minus_greedys():
    # judged by one judge on 8 prompts. p_sim^ann's curve peaks at n = 4 with every label for output_2 and ends with
    # 2 of 8: a fall of 75 points. Greedy's peaks at n = 1 with 6 of 8 and ends with 4 of 8: a fall of 25 points. The
    # contrast, paired per prompt: 75 − 25 = 50 points
    n = 8
    ann = [
        {"pressure": 1, "rows": _rows([1.0] * n)},
        {"pressure": 4, "rows": _rows([2.0] * n)},
        {"pressure": 16, "rows": _rows([2.0] * 2 + [1.0] * 6)},
    ]
    greedy = [
        {"pressure": 1, "rows": _rows([2.0] * 6 + [1.0] * 2)},
        {"pressure": 4, "rows": _rows([2.0] * 5 + [1.0] * 3)},
        {"pressure": 16, "rows": _rows([2.0] * 4 + [1.0] * 4)},
    ]
    curves = {("p_sim^ann", "best_of_n", "j"): ann, ("greedy", "best_of_n", "j"): greedy}
    found = {f["quantity"]: f for f in overoptimization_findings(curves, n_boot=300)}
    assert found["over-optimization: best_of_n, reward model on p_sim^ann labels, judged by j"]["value"] == 75.0
    assert found["over-optimization: best_of_n, reward model on greedy labels, judged by j"]["value"] == 25.0
    contrast = found["over-optimization contrast: best_of_n, judged by j"]
    assert contrast["value"] == pytest.approx(50.0)
    assert contrast["low"] <= 50.0 <= contrast["high"]
    assert contrast["detail"].startswith(("resolved", "not resolved"))
    assert contrast["detail"].endswith("p_sim^ann's fall minus greedy's")
    # identical curves: the contrast is exactly 0 in every bootstrap draw
    same = overoptimization_findings({("p_sim^ann", "ppo", "j"): ann, ("greedy", "ppo", "j"): ann}, n_boot=300)
    c = {f["quantity"]: f for f in same}["over-optimization contrast: ppo, judged by j"]
    assert (c["value"], c["low"], c["high"]) == (0.0, 0.0, 0.0) and c["detail"].startswith("not resolved")
    # the paper's setup: each curve judged by its own labeller (no judge scores both, so no per-judge contrast)
    own = {("p_sim^ann", "best_of_n", "p_sim^ann"): ann, ("greedy", "best_of_n", "greedy"): greedy}
    contrasts = [f for f in overoptimization_findings(own, n_boot=300) if "contrast" in f["quantity"]]
    assert [(f["quantity"], f["value"]) for f in contrasts] == [
        ("over-optimization contrast: best_of_n, each judged by its labeller", pytest.approx(50.0)),
        # out of sample the peaks are the same on every prompt (n = 4 for p_sim^ann's, n = 1 for greedy's)
        ("out-of-sample over-optimization contrast: best_of_n, each judged by its labeller", pytest.approx(50.0)),
    ]
    # a lone labeller has no contrast
    alone = overoptimization_findings({("p_sim^ann", "ppo", "j"): ann}, n_boot=300)
    assert [f["quantity"] for f in alone] == [
        "over-optimization: ppo, reward model on p_sim^ann labels, judged by j",
        "out-of-sample over-optimization: ppo, reward model on p_sim^ann labels, judged by j",
    ]


def _seed(contrast: float, resolved: bool, fall_present: bool, ppo: bool = True) -> list[dict]:
    fall = {"quantity": "over-optimization: best_of_n, reward model on greedy labels, judged by gold", "value": 2.0}
    fall["detail"] = "present (best at 4, last 64)" if fall_present else "absent (best at 64, last 64)"
    c = {"quantity": "over-optimization contrast: best_of_n, judged by gold", "value": contrast}
    c["detail"] = f"{'resolved' if resolved else 'not resolved'}: p_sim^ann's fall minus greedy's"
    p = {"quantity": "over-optimization: ppo, reward model on greedy labels, judged by gold", "value": 1.0}
    p["detail"] = "absent (best at 18, last 18)"
    return [{"low": 0.0, "high": 0.0} | f for f in [fall, c] + ([p] if ppo else [])]


def test_findings_pooled_over_seeds_take_the_mean_with_a_t_interval_and_count_the_seeds():
    # contrasts 1, 2 and 6 over three seeds: mean 3, sd √7 (squared deviations 4 + 1 + 9 over 2 degrees of freedom),
    # half-width t(2)·√7/√3 = 4.303 · 1.5275 = 6.573; resolved on the first and the third, both p_sim^ann's way
    per_seed = [_seed(1.0, True, True), _seed(2.0, False, False), _seed(6.0, True, True, ppo=False)]
    pooled = {f["quantity"]: f for f in over_seeds(per_seed)}
    c = pooled["over-optimization contrast: best_of_n, judged by gold, over 3 seeds"]
    assert c["value"] == pytest.approx(3.0)
    assert (c["low"], c["high"]) == (pytest.approx(3.0 - 6.5726, abs=1e-3), pytest.approx(3.0 + 6.5726, abs=1e-3))
    assert c["detail"] == (
        "resolved on 2 of 3 seeds with p_sim^ann's fall the larger, on 0 with greedy's; Student t over seeds"
    )
    fall = pooled["over-optimization: best_of_n, reward model on greedy labels, judged by gold, over 3 seeds"]
    assert fall["value"] == 2.0 and (fall["low"], fall["high"]) == (2.0, 2.0)  # no spread between seeds
    assert fall["detail"] == "present on 2 of 3 seeds; Student t over seeds"
    # a curve the third seed did not draw is pooled over the two that did
    assert "over-optimization: ppo, reward model on greedy labels, judged by gold, over 2 seeds" in pooled
    # a contrast resolved the other way counts as greedy's
    other = over_seeds([_seed(-3.0, True, True), _seed(-1.0, True, True)])
    assert other[1]["detail"].startswith("resolved on 0 of 2 seeds with p_sim^ann's fall the larger, on 2 with")
    assert other[1]["value"] == -2.0


def test_the_curves_reward_models_are_reported_with_their_agreement_with_gold_and_its_gap():
    rows = {f["quantity"]: f for f in proxy_findings({"greedy": 0.80, "p_sim^ann": 0.65})}
    assert rows["reward model on p_sim^ann labels: held-out agreement with gold"]["value"] == 0.65
    assert rows["reward model on greedy labels: held-out agreement with gold"]["value"] == 0.80
    gap = rows["reward model agreement with gold: p_sim^ann's minus greedy's"]
    assert gap["value"] == pytest.approx(-0.15) and gap["detail"] == "p_sim^ann's reward model the weaker proxy"
    assert [f["quantity"] for f in proxy_findings({"greedy": 0.8})] == [
        "reward model on greedy labels: held-out agreement with gold"
    ]  # no gap without both
    # over three seeds: gaps −0.15, +0.05, −0.10 → mean −0.0667, sd 0.1041, half-width t(2)·sd/√3 = 0.2586
    per_seed = [proxy_findings({"p_sim^ann": a, "greedy": b}) for a, b in [(0.65, 0.80), (0.75, 0.70), (0.60, 0.70)]]
    pooled = {f["quantity"]: f for f in over_seeds(per_seed)}
    gap = pooled["reward model agreement with gold: p_sim^ann's minus greedy's, over 3 seeds"]
    assert gap["value"] == pytest.approx(-0.2 / 3)
    assert (gap["low"], gap["high"]) == (
        pytest.approx(-0.2 / 3 - 0.2586, abs=1e-4),
        pytest.approx(-0.2 / 3 + 0.2586, abs=1e-4),
    )
    assert gap["detail"] == "p_sim^ann's the weaker proxy on 2 of 3 seeds; Student t over seeds"
    greedy = pooled["reward model on greedy labels: held-out agreement with gold, over 3 seeds"]
    assert (
        greedy["value"] == pytest.approx(0.7333, abs=1e-4) and greedy["detail"] == "over 3 seeds; Student t over seeds"
    )
    # an agreement's interval stays within [0, 1]: over two seeds, 0.6 and 0.95, t(1)·sd/√2 = 12.706·0.2475/1.414
    # = 2.22 around 0.775 would reach from −1.45 to 3.0
    two = over_seeds([proxy_findings({"greedy": 0.6}), proxy_findings({"greedy": 0.95})])
    assert (two[0]["low"], two[0]["high"]) == (0.0, 1.0) and two[0]["value"] == pytest.approx(0.775)


def test_agreement_among_the_proxys_top_candidates_counts_the_pairs_it_orders_as_gold_does():
    # one prompt, four candidates by proxy 4 > 3 > 2 > 1 with gold 0, 1, 1, 0.5
    proxy, gold = np.array([[4.0, 3.0, 2.0, 1.0]]), np.array([[0.0, 1.0, 1.0, 0.5]])
    # top 2: the pair (4, 3) is ordered against gold (0 < 1)
    assert top_agreement(proxy, gold, 2) == (0.0, 1)
    # all four: (4,3), (4,2), (4,1) wrong; (3,2) a gold tie, left out; (3,1), (2,1) right → 2 of 5
    assert top_agreement(proxy, gold, 4) == (pytest.approx(0.4), 5)
    # the top is the proxy's, wherever the candidates sit; a proxy tie is left out, as a gold tie is
    shuffled = np.array([[1.0, 3.0, 4.0, 3.0]]), np.array([[0.5, 1.0, 0.0, 0.2]])
    assert top_agreement(*shuffled, 3) == (0.0, 2)  # (4, 3) and (4, 3'): gold 0 < 1 and 0 < 0.2; (3, 3') tied
    # prompts pool their pairs; nothing to count is NaN
    two = np.vstack([proxy, proxy]), np.vstack([gold, 1.0 - gold])
    assert top_agreement(*two, 4) == (pytest.approx(5 / 10), 10)
    agreement, pairs = top_agreement(np.ones((1, 4)), gold, 4)
    assert math.isnan(agreement) and pairs == 0
    agreement, pairs = top_agreement(np.ones((3, 1)), np.ones((3, 1)), 2)  # one candidate a prompt: no pairs
    assert math.isnan(agreement) and pairs == 0
    assert [top_candidates(n) for n in (2, 8, 16, 64, 256)] == [2, 2, 2, 8, 32]


def test_the_proxys_agreement_among_its_top_candidates_sits_beside_the_held_out_one():
    rows = proxy_findings({"p_sim^ann": 0.75, "greedy": 0.79}, {"p_sim^ann": 0.33, "greedy": 0.45}, "top 8 of 64")
    found = {f["quantity"]: f for f in rows}
    tail = "reward model on p_sim^ann labels: agreement with gold on its top 8 of 64 best-of-n candidates"
    assert found[tail]["value"] == 0.33
    assert found[tail]["detail"].startswith("the curves' proxy, on pairs of an eval prompt's top 8 of 64 candidates")
    gap = found["reward model agreement with gold on its top candidates: p_sim^ann's minus greedy's"]
    assert gap["value"] == pytest.approx(-0.12) and gap["detail"] == "p_sim^ann's reward model the weaker proxy"
    assert len(rows) == 6 and rows[:3] == proxy_findings({"p_sim^ann": 0.75, "greedy": 0.79})
    # pooled over seeds like the held-out gap: tail gaps −0.12 and +0.02
    second = proxy_findings({"p_sim^ann": 0.70, "greedy": 0.72}, {"p_sim^ann": 0.50, "greedy": 0.48}, "top 8 of 64")
    pooled = {f["quantity"]: f for f in over_seeds([rows, second])}
    gap = pooled["reward model agreement with gold on its top candidates: p_sim^ann's minus greedy's, over 2 seeds"]
    assert gap["value"] == pytest.approx(-0.05)
    assert gap["detail"] == "p_sim^ann's the weaker proxy on 1 of 2 seeds; Student t over seeds"
    assert pooled[f"{tail}, over 2 seeds"]["value"] == pytest.approx(0.415)


def test_over_seeds_the_curves_falls_are_ranked_against_each_measure_of_their_proxys_quality():
    def seed(held: dict, tail: dict, falls: dict) -> list[dict]:
        oos = "out-of-sample over-optimization: best_of_n, reward model on {} labels, judged by gold"
        return proxy_findings(held, tail, "top 8 of 64") + [
            {"quantity": oos.format(lab), "value": fall} for lab, fall in falls.items()
        ]

    # four curves: falls 12, 2 | 8, 1; top-candidate agreement 0.3, 0.5 | 0.4, 0.6 orders them exactly backwards;
    # held-out 0.7, 0.6 | 0.8, 0.75: rank differences −2, −1, 1, 2 → 1 − 6·10/(4·15) = 0
    seeds = [
        seed({"p_sim^ann": 0.7, "greedy": 0.6}, {"p_sim^ann": 0.3, "greedy": 0.5}, {"p_sim^ann": 12.0, "greedy": 2.0}),
        seed({"p_sim^ann": 0.8, "greedy": 0.75}, {"p_sim^ann": 0.4, "greedy": 0.6}, {"p_sim^ann": 8.0, "greedy": 1.0}),
    ]
    found = {f["quantity"]: f for f in proxy_fall_correlations(seeds, n_boot=500)}
    tail = found[
        "Spearman (reward model's top-candidate agreement with gold, its best-of-n curve's out-of-sample fall in gold)"
    ]
    # every resample of a monotone set is monotone too (or constant, and left out): the interval is the point
    assert (tail["value"], tail["low"], tail["high"]) == (-1.0, -1.0, -1.0)
    assert tail["detail"].startswith("4 curves over 2 seeds; bootstrap over the curves")
    held = found[
        "Spearman (reward model's held-out agreement with gold, its best-of-n curve's out-of-sample fall in gold)"
    ]
    assert held["value"] == pytest.approx(0.0, abs=1e-12) and held["low"] < 0 < held["high"]
    assert proxy_fall_correlations(seeds[:1]) == []  # two curves are too few
    # a measure every curve shares ranks nothing: NaN, not an error
    flat = [
        seed({"p_sim^ann": 0.7, "greedy": 0.6}, {"p_sim^ann": 0.5, "greedy": 0.5}, {"p_sim^ann": f, "greedy": 1.0})
        for f in (12.0, 8.0)
    ]
    flat_tail = proxy_fall_correlations(flat)[1]
    assert flat_tail["quantity"].startswith("Spearman (reward model's top-candidate")
    assert all(math.isnan(flat_tail[k]) for k in ("value", "low", "high"))


def _curve(points: dict[tuple[str, float], tuple[float, float]], judges=("p_sim^ann", "greedy")) -> list[dict]:
    """One seed's best-of-n curve rows: (labeller, n) → (win rate under every judge but greedy's +10, mean gold)."""
    return [
        {"labeller": lab, "family": "best_of_n", "pressure": n, "annotator": judge, "mean_gold": gold}
        | {"win_rate": win + (10.0 if judge == "greedy" else 0.0)}
        for (lab, n), (win, gold) in points.items()
        for judge in judges
    ]


def test_curves_pooled_over_seeds_take_each_points_mean_with_a_t_interval():
    seeds = [
        _curve({("p_sim^ann", 1): (50.0, 0.60), ("p_sim^ann", 2): (56.0, 0.64), ("greedy", 1): (52.0, 0.61)}),
        _curve({("p_sim^ann", 1): (54.0, 0.62), ("p_sim^ann", 2): (56.0, 0.66), ("greedy", 1): (48.0, 0.59)}),
        _curve({("p_sim^ann", 1): (58.0, 0.70)}),  # a seed that drew one point only
    ]
    rows = curves_over_seeds(seeds)
    at = {(r["labeller"], r["judge"], r["pressure"]): r for r in rows}
    # n = 1 on p_sim^ann's reward model: 50, 54, 58 → mean 54, sd 4, half-width t(2)·4/√3 = 4.303 · 2.309 = 9.937
    one = at["p_sim^ann", "p_sim^ann", 1.0]
    assert (one["seeds"], one["mean"]) == (3, pytest.approx(54.0))
    assert (one["low"], one["high"]) == (pytest.approx(54 - 9.937, abs=1e-3), pytest.approx(54 + 9.937, abs=1e-3))
    # its gold ×100: 60, 62, 70 → mean 64, sd √28, half-width 4.303 · √28/√3 = 13.146
    gold = at["p_sim^ann", "gold", 1.0]
    assert gold["mean"] == pytest.approx(64.0)
    assert gold["high"] - gold["mean"] == pytest.approx(13.146, abs=1e-3)
    # n = 2 on two seeds: win rates 56 and 56 (no spread), gold 64 and 66 → 65 ± t(1)·√2/√2 = 12.706
    assert (at["p_sim^ann", "greedy", 2.0]["mean"], at["p_sim^ann", "greedy", 2.0]["low"]) == (66.0, 66.0)
    assert at["p_sim^ann", "gold", 2.0]["low"] == pytest.approx(65.0 - 12.706, abs=1e-3)
    assert at["greedy", "p_sim^ann", 1.0]["mean"] == pytest.approx(50.0) and at["greedy", "gold", 1.0]["seeds"] == 2
    # ordered by labeller, judge with gold first, pressure; the gold reward pooled once per point, not per judge
    assert [(r["labeller"], r["judge"], r["pressure"]) for r in rows] == [
        ("p_sim^ann", "gold", 1.0),
        ("p_sim^ann", "gold", 2.0),
        ("p_sim^ann", "p_sim^ann", 1.0),
        ("p_sim^ann", "p_sim^ann", 2.0),
        ("p_sim^ann", "greedy", 1.0),
        ("p_sim^ann", "greedy", 2.0),
        ("greedy", "gold", 1.0),
        ("greedy", "p_sim^ann", 1.0),
        ("greedy", "greedy", 1.0),
    ]
    # p_sim^ann's reward model first whatever order the curve's rows come in (the paper's order, and the plot's colours)
    assert [r["labeller"] for r in curves_over_seeds([seeds[0][::-1]])][:3] == ["p_sim^ann"] * 3
    # one seed: the mean without an interval; no gold reward (the real farm): no gold rows
    single = curves_over_seeds([_curve({("greedy", 4): (40.0, math.nan)})])
    assert [(r["judge"], r["mean"], math.isnan(r["low"])) for r in single] == [
        ("p_sim^ann", 40.0, True),
        ("greedy", 50.0, True),
    ]
    table = curves_markdown(rows)
    assert "| reward model on | judged by | n = 1 | n = 2 |" in table
    assert "| p_sim^ann | gold | 64.0 [50.9, 77.1] | 65.0 [52.3, 77.7] |" in table
    assert "| greedy | greedy | 60.0 [34.6, 85.4] | — |" in table


def test_the_curves_over_seeds_plot_has_a_panel_per_judge(tmp_path):
    from farmflow.evaluation.study_plots import plot_curves_over_seeds

    rows = curves_over_seeds(
        [
            _curve({("p_sim^ann", n): (50.0 + n + s, 0.6) for n in (1, 2, 4)} | {("greedy", 1): (50.0, 0.6)})
            for s in range(3)
        ]
    )
    plot_curves_over_seeds(rows, str(tmp_path / "seeds.png"))
    from PIL import Image

    width, height = Image.open(tmp_path / "seeds.png").size
    assert width > 2 * height  # three panels (gold, p_sim^ann, greedy) side by side in one row


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_study_flow_on_micro_writes_its_table_plots_and_artifacts_then_is_cached(micro_config):
    from prefect.client.orchestration import get_client

    from farmflow.flows.study import study_flow
    from farmflow.storage.schemas import SCHEMAS

    tasks.EXECUTED.clear()
    summary = study_flow(advanced=micro_config, methods=["best_of_n", "ppo"], replicates=1, ns=[1, 2], ppo_every=2)
    # the compared PPO is also the PPO curve on p_sim^ann's reward model (snapshot_every is not in its key): it commits
    # the curve's snapshots the first time, so PPO trains once per reward model, p_sim^ann's and greedy's
    assert tasks.EXECUTED["ppo"] == 2
    # the shortened SFT baselines are snapshots of the one SFT run (sft.snapshot_epochs), not runs of their own
    assert tasks.EXECUTED["sft"] == 1
    folder = summary["artifacts"]["study"]
    table = pq.read_table(f"{folder}/data.parquet")
    assert table.schema.names == SCHEMAS["validation_study"].names
    assert micro_config.data.reference_error_rate == 0.35
    assert sorted(table.column("method").to_pylist()) == [
        "best_of_4",
        "ppo",
        "sft",
        "sft (0.25 epochs)",
        "sft (0.5 epochs)",
        "untrained",
        "writer: demonstrator (error 0.2)",
        "writer: reference (error 0)",
        "writer: reference (error 0.35)",
    ]
    findings = {f["quantity"]: f for f in summary["findings"]}
    assert findings["Spearman (sim, human-like)"]["detail"].startswith("3 methods;")
    assert findings["Spearman (sim, gold), pipeline systems"]["detail"].startswith(
        "6 systems: the methods and untrained, sft (0.25 epochs), sft (0.5 epochs);"
    )
    assert findings["Spearman (sim, human-like), all systems"]["detail"].startswith(
        "9 systems: the methods and untrained, sft (0.25 epochs), sft (0.5 epochs), writer: reference (error 0.35), "
        "writer: demonstrator (error 0.2), writer: reference (error 0);"
    )
    rows = {r["method"]: r for r in table.to_pylist()}
    assert rows["writer: reference (error 0)"]["mean_gold"] == 1.0  # the flawless writer
    # the human-like arm's expectation scores every system; the flawless writer's answers beat every reference
    # output that is wrong, so its expectation lies above 50%
    assert all(0.0 <= r["expected_win_rate"] <= 100.0 for r in rows.values())
    assert rows["writer: reference (error 0)"]["expected_win_rate"] > 50.0
    assert findings["Spearman (sim, human-like expected), all systems"]["detail"].startswith("9 systems:")
    board = pq.read_table(f"{summary['artifacts']['leaderboard']}/data.parquet").column("method").to_pylist()
    assert sorted(board) == ["best_of_4", "ppo", "sft", "untrained"]  # the shortened SFTs and writers are the study's
    assert findings["human-like agreement (a judgement vs the mode of three others)"]["value"] == pytest.approx(
        0.657, abs=0.01
    )
    assert 0.5 <= findings["p_sim^eval agreement with the human-like mode"]["value"] <= 1.0
    for arm in ("p_sim^eval", "human-like"):
        assert 0.0 <= findings[f"longer output preferred by {arm}"]["value"] <= 1.0
    for name in (
        "Spearman (sim, human-like)",
        "Spearman (human-like, gold)",
        "prompts to resolve 2 points",
        "prompts to resolve 2 points, human-like",
    ):
        assert name in findings, name
    curves = [f for q, f in findings.items() if q.startswith("over-optimization:")]
    assert len(curves) == 2 * 2 * 4  # best-of-n and PPO × two labellers' reward models × p_sim^ann, greedy, human, gold
    contrasts = [f for q, f in findings.items() if q.startswith("over-optimization contrast:")]
    assert len(contrasts) == 2 * 5  # per family: one per judge and one with each curve judged by its labeller
    assert all(f["detail"].split()[0] in ("present", "absent") for f in curves)
    # beside the curves, the two reward models they optimized, as good a proxy as their held-out gold agreement says
    # (p_sim^ann's trains first, for the methods; greedy's for its curve)
    from farmflow.storage import open_store

    store = open_store(micro_config.store.location)
    trained = list(dict.fromkeys(s["key"] for s in summary["stages"] if s["stage"] == "train_reward"))
    gold = [store.get("train_reward", k).metrics["heldout_gold_accuracy"] for k in trained]
    assert len(gold) == 2
    for labeller, value in zip(("p_sim^ann", "greedy"), gold):
        assert findings[f"reward model on {labeller} labels: held-out agreement with gold"]["value"] == value
    gap = findings["reward model agreement with gold: p_sim^ann's minus greedy's"]["value"]
    assert gap == pytest.approx(gold[0] - gold[1])
    # and among each one's top best-of-n candidates: the curve's largest best-of-n (n = 2) scored by that reward model
    from farmflow.data import gold_reward

    key_of = {s["stage"]: s["key"] for s in summary["stages"]}  # stage labels → keys
    largest = {
        "p_sim^ann": store.get("best_of_n", key_of["best_of_2 [p_sim^ann]"]),
        "greedy": store.get("best_of_n_rescore", key_of["best_of_2 [greedy] (rescored)"]),
    }
    for (labeller, best), reward in zip(largest.items(), trained):
        assert store.record(best)["inputs"]["reward"] == reward
        rows = {r["id"]: r for r in store.read_table(best).to_pylist()}
        every = store.read_table(best, "candidates.parquet", "candidates").to_pylist()
        proxy = np.array([c["reward"] for c in every]).reshape(-1, 2)
        gold_of = np.array([gold_reward(rows[c["id"]]["task"], c["output"]) for c in every]).reshape(-1, 2)
        expected, _ = top_agreement(proxy, gold_of, 2)
        found = findings[
            f"reward model on {labeller} labels: agreement with gold on its top 2 of 2 best-of-n candidates"
        ]
        assert found["value"] == pytest.approx(expected, nan_ok=True)
    for png in ("rankings.png", "overoptimization.png"):
        assert open(f"{folder}/{png}", "rb").read(4) == b"\x89PNG"
    assert "| finding | value [95% CI] | detail |" in open(f"{folder}/study.md").read()
    with get_client(sync_client=True) as client:
        keys = {a.key for a in all_artifacts(client)}
    assert {"validation-study", "validation-study-findings", "leaderboard"} <= keys

    tasks.EXECUTED.clear()
    again = study_flow(advanced=micro_config, methods=["best_of_n", "ppo"], replicates=1, ns=[1, 2], ppo_every=2)
    assert tasks.EXECUTED == {} and again["artifacts"]["study"] == folder


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_curves_under_more_seeds_reuse_the_first_and_pool_each_finding(micro_config):
    from farmflow.flows.study import study_flow

    study = dict(advanced=micro_config, methods=["best_of_n"], replicates=1, ns=[1, 2], writers=False, sft_epochs=[])
    one = study_flow(**study)
    tasks.EXECUTED.clear()
    two = study_flow(**study, curve_replicates=2)
    # only replicate 1's curves are new: its SFT, its pairs labelled by each labeller and their two reward models
    assert (tasks.EXECUTED["sft"], tasks.EXECUTED["annotate"], tasks.EXECUTED["train_reward"]) == (1, 2, 2)
    assert two["artifacts"]["overoptimization"] == one["artifacts"]["overoptimization"]
    assert two["artifacts"]["overoptimization@1"] != one["artifacts"]["overoptimization"]
    labels = {s["stage"] for s in two["stages"]}  # a replicate's curve stages say whose they are in the logs
    assert {
        "proxy_reward best_of_2 [greedy] [replicate 1]",
        "evaluate best_of_1 [p_sim^ann] [replicate 1] (greedy)",
    } <= labels
    first = {f["quantity"]: f for f in one["findings"] if f["quantity"].startswith("over-optimization")}
    found = {f["quantity"]: f for f in two["findings"]}
    assert all(found[q] == f for q, f in first.items())  # replicate 0's findings, as a study of one seed has them
    for q, f in first.items():
        seeds = [f["value"], found[f"{q} [replicate 1]"]["value"]]
        assert found[f"{q}, over 2 seeds"]["value"] == pytest.approx(sum(seeds) / 2), q
    q = "reward model on greedy labels: held-out agreement with gold"
    seeds = [found[q]["value"], found[f"{q} [replicate 1]"]["value"]]
    assert found[f"{q}, over 2 seeds"]["value"] == pytest.approx(sum(seeds) / 2)
    # the four curves' falls ranked against their reward models' held-out agreement with gold
    fall = "out-of-sample over-optimization: best_of_n, reward model on {} labels, judged by gold{}"
    held = "reward model on {} labels: held-out agreement with gold{}"
    points = [
        (found[held.format(lab, r)]["value"], found[fall.format(lab, r)]["value"])
        for lab in ("p_sim^ann", "greedy")
        for r in ("", " [replicate 1]")
    ]
    rho = found[
        "Spearman (reward model's held-out agreement with gold, its best-of-n curve's out-of-sample fall in gold)"
    ]
    assert rho["value"] == pytest.approx(float(spearman(*np.array(points).T)), nan_ok=True)
    assert rho["detail"].startswith("4 curves over 2 seeds")
    # the curves pooled point by point: each point's gold the mean of the two seeds' (a table, a figure, study.md)
    assert not (Path(one["artifacts"]["study"]) / "study_curves.parquet").exists()
    folder = Path(two["artifacts"]["study"])
    pooled = pq.read_table(folder / "study_curves.parquet").to_pylist()
    assert two["curves"] == pooled and one["curves"] == []
    seeds = [
        pq.read_table(f"{two['artifacts'][k]}/data.parquet").to_pylist()
        for k in ("overoptimization", "overoptimization@1")
    ]
    for lab, n in [("p_sim^ann", 1.0), ("greedy", 2.0)]:
        golds = [
            100 * next(r["mean_gold"] for r in rows if (r["labeller"], r["pressure"]) == (lab, n)) for rows in seeds
        ]
        point = next(r for r in pooled if (r["labeller"], r["judge"], r["pressure"]) == (lab, "gold", n))
        assert (point["seeds"], point["mean"]) == (2, pytest.approx(sum(golds) / 2))
    assert len(pooled) == 2 * 4 * 2  # two reward models × gold and three judges × n = 1, 2
    assert (folder / "overoptimization_seeds.png").read_bytes()[:4] == b"\x89PNG"
    # study.md: the pooled findings first, then the methods, the pooled curves, and each seed's findings last
    md = (folder / "study.md").read_text()
    q = "over-optimization: best_of_n, reward model on greedy labels, judged by gold"
    order = [
        f"| {q}, over 2 seeds |",
        "| method | simulated (p_sim^eval)",
        "best_of_n over 2 seeds: mean over the seeds",
        "#### Each seed's over-optimization findings",
        f"| {q} |",
        f"| {q} [replicate 1] |",
    ]
    assert all(part in md for part in order), [part for part in order if part not in md]
    assert [md.index(part) for part in order] == sorted(md.index(part) for part in order)
    assert md.count(f"| {q} |") == 1
    tasks.EXECUTED.clear()
    study_flow(**study, curve_replicates=2)
    assert tasks.EXECUTED == {}
    # the study of one seed under replicate 1's seeds (`study validate --seed 1000`) draws that replicate's curves
    # from the cache: a seed studied alone pools with the others later, and the other way round
    from farmflow.flows.form import with_seed
    from farmflow.flows.replicates import SEED_STEP

    alone = study_flow(**(study | {"advanced": with_seed(micro_config, SEED_STEP)}))
    assert alone["artifacts"]["overoptimization"] == two["artifacts"]["overoptimization@1"]
    assert not {"sft", "annotate", "train_reward"} & set(tasks.EXECUTED)


@pytest.mark.usefixtures("prefect_harness")
@pytest.mark.slow
def test_each_curve_replicates_ppo_commits_its_snapshots_so_ppo_trains_once_per_reward_model(micro_config):
    from farmflow.flows.study import study_flow

    tasks.EXECUTED.clear()
    study_flow(
        advanced=micro_config,
        methods=["ppo"],
        replicates=2,
        ns=[1],
        ppo_every=2,
        curve_replicates=2,
        writers=False,
        sft_epochs=[],
    )
    # per seed: the compared PPO is the p_sim^ann curve's (snapshots committed the first time), plus greedy's curve
    assert tasks.EXECUTED["ppo"] == 2 * 2
    assert tasks.EXECUTED["sft"] == 2


def test_shortened_sft_baselines_must_be_shorter_than_sft(micro_config):
    from farmflow.flows.study import run_study

    with pytest.raises(ValueError, match="sft_epochs must lie between 0 and the preset's 1 epochs"):
        run_study(micro_config, [], 1, sft_epochs=(1.0,))


def test_a_ppo_curve_needs_a_positive_snapshot_interval_before_anything_trains(micro_config, tmp_path):
    from typer.testing import CliRunner

    from farmflow.cli import app
    from farmflow.flows.study import run_study

    tasks.EXECUTED.clear()
    with pytest.raises(ValueError, match="ppo_every must be a positive number of PPO steps, got -2"):
        run_study(micro_config, ["ppo"], 1, ppo_every=-2)
    assert tasks.EXECUTED == {}
    result = CliRunner().invoke(app, ["study", "validate", "--ppo-every", "0", "--store", str(tmp_path)])
    assert result.exit_code == 2 and "--ppo-every" in result.output


def test_curves_need_at_least_one_replicate_before_anything_trains(micro_config):
    from farmflow.flows.study import run_study

    tasks.EXECUTED.clear()
    with pytest.raises(ValueError, match="curve_replicates must be at least 1, got 0"):
        run_study(micro_config, ["best_of_n"], 1, curve_replicates=0)
    assert tasks.EXECUTED == {}


def test_the_study_cli_refuses_a_farm_without_gold(tmp_path):
    from typer.testing import CliRunner

    from farmflow.cli import app

    result = CliRunner().invoke(app, ["study", "validate", "--preset", "smol-micro", "--store", str(tmp_path)])
    assert result.exit_code == 2 and "gold reward" in result.output
