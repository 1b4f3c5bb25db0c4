"""Bootstrap intervals, ranking correlations and the replicated leaderboard rows, on hand-computable cases."""

from __future__ import annotations

import math

import numpy as np
import pytest

from farmflow.evaluation.bootstrap import (
    bootstrap_mean,
    eval_size_for,
    paired_bootstrap,
    pearson,
    rankdata,
    ranking_agreement,
    resolvable_difference,
    spearman,
    t975,
)
from farmflow.evaluation.replicates import interval_markdown, interval_rows, rank_ranges, replicate_interval


def test_identical_arms_differ_by_exactly_zero_with_a_zero_width_interval():
    rng = np.random.default_rng(1)
    a = rng.choice([0.0, 0.5, 1.0], size=(3, 50))
    d = paired_bootstrap(a, a.copy())
    assert d["estimate"] == 0.0 and d["low"] == 0.0 and d["high"] == 0.0 and d["se"] == 0.0
    assert d["excludes_zero"] == 0.0


def test_a_constant_shift_is_recovered_exactly():
    rng = np.random.default_rng(2)
    b = rng.choice([0.0, 0.5], size=(2, 40))
    d = paired_bootstrap(b + 0.25, b)  # every prompt of every replicate 0.25 higher (exact in binary)
    assert (d["estimate"], d["low"], d["high"]) == (0.25, 0.25, 0.25)
    assert d["excludes_zero"] == 1.0
    worse = paired_bootstrap(b, b + 0.25)
    assert (worse["estimate"], worse["low"], worse["high"]) == (-0.25, -0.25, -0.25)


def test_the_mean_of_a_hand_made_case_and_its_interval():
    # 4 wins and 4 losses: mean 0.5; every bootstrap mean is a multiple of 1/8 between 0 and 1
    m = bootstrap_mean([1, 1, 1, 1, 0, 0, 0, 0], n_boot=4000)
    assert m["estimate"] == 0.5
    assert m["low"] < 0.5 < m["high"] and m["low"] >= 0.125 and m["high"] <= 0.875
    # the bootstrap SE is close to the plug-in SE sqrt(p(1-p)/n) = sqrt(0.25/8) = 0.177
    assert m["se"] == pytest.approx(math.sqrt(0.25 / 8), rel=0.08)


def test_coverage_of_the_paired_interval_on_a_seeded_synthetic_case():
    """95% intervals of a true difference of 0.1 cover it in about 95% of 200 simulated experiments."""
    rng = np.random.default_rng(7)
    covered = 0
    for trial in range(200):
        ease = rng.normal(0, 1, 150)  # prompts differ in difficulty, shared by both arms (pairing)
        a = ease + 0.1 + rng.normal(0, 0.5, 150)
        b = ease + rng.normal(0, 0.5, 150)
        d = paired_bootstrap(a, b, n_boot=500, seed=trial)
        covered += d["low"] <= 0.1 <= d["high"]
    assert 0.89 <= covered / 200 <= 0.99
    # pairing matters: the paired interval is far narrower than the shared prompt difficulty would allow unpaired
    assert d["high"] - d["low"] < 0.5


def test_replicates_widen_the_interval_when_seeds_disagree():
    base = np.tile(np.array([0.0, 1.0] * 20), (3, 1))
    same = paired_bootstrap(base + 0.25, base)
    seeds = paired_bootstrap(base + np.array([[0.0], [0.25], [0.5]]), base)  # replicate effects 0, .25, .5
    assert same["high"] - same["low"] == 0.0
    assert seeds["estimate"] == 0.25 and seeds["low"] < 0.25 < seeds["high"]
    assert seeds["low"] >= 0.0 and seeds["high"] <= 0.5


def test_ranks_and_correlations():
    assert rankdata(np.array([10.0, 30.0, 20.0, 20.0])).tolist() == [1.0, 4.0, 2.5, 2.5]
    # along the last axis, row by row: all tied, none tied, two tied at the bottom
    rows = np.array([[1.0, 1.0, 1.0], [3.0, 1.0, 2.0], [2.0, 2.0, 1.0], [5.0, 4.0, 4.0]])
    assert rankdata(rows).tolist() == [[2.0, 2.0, 2.0], [3.0, 1.0, 2.0], [2.5, 2.5, 1.0], [3.0, 1.5, 1.5]]
    assert spearman(np.array([1.0, 2.0, 3.0]), np.array([10.0, 20.0, 90.0])) == pytest.approx(1.0)
    assert pearson(np.array([1.0, 2.0, 3.0]), np.array([3.0, 2.0, 1.0])) == pytest.approx(-1.0)
    # one swap among 4: d² = 2, Spearman = 1 − 6·2 / (4·15) = 0.8
    assert spearman(np.array([1.0, 2.0, 3.0, 4.0]), np.array([1.0, 3.0, 2.0, 4.0])) == pytest.approx(0.8)


def test_ranking_agreement_of_the_same_arm_is_one_with_a_point_interval():
    rng = np.random.default_rng(3)
    levels = np.array([0.2, 0.4, 0.6, 0.8])[:, None, None]
    arm = (rng.random((4, 2, 300)) < levels).astype(float)  # 4 methods far apart, 2 replicates, 300 prompts
    c = ranking_agreement(arm, arm.copy(), n_boot=300)
    assert (c["spearman"], c["spearman_low"], c["spearman_high"]) == (1.0, 1.0, 1.0)
    flipped = ranking_agreement(arm, arm[::-1].copy(), n_boot=300)
    assert flipped["spearman"] == pytest.approx(-1.0) and flipped["spearman_high"] == pytest.approx(-1.0)


def test_sizes_and_resolution():
    assert t975(1) == 12.706 and t975(4) == 2.776 and abs(t975(30) - 2.042) < 0.03
    assert resolvable_difference(1.0) == pytest.approx(1.96, abs=1e-3)
    assert eval_size_for(2.0, 400, 4.0) == 1600  # half the half-width: four times the prompts
    assert eval_size_for(2.0, 400, 1.0) == 100
    sd, lo, hi = replicate_interval([50.0, 52.0, 54.0])  # mean 52, sd 2, t(2) = 4.303
    assert (
        sd == 2.0
        and lo == pytest.approx(52 - 4.303 * 2 / math.sqrt(3))
        and hi == pytest.approx(52 + 4.303 * 2 / 3**0.5)
    )
    assert math.isnan(replicate_interval([50.0])[0])


def test_rank_ranges_only_split_methods_whose_intervals_do_not_overlap():
    # A [60, 70] beats everyone; B [45, 55] and C [48, 58] overlap; D [10, 20] loses to all
    assert rank_ranges([60, 45, 48, 10], [70, 55, 58, 20]) == [(1, 1), (2, 3), (2, 3), (4, 4)]


def _eval_rows(prefs, golds):
    return [{"id": f"p{i}", "preference": p, "gold_2": g} for i, (p, g) in enumerate(zip(prefs, golds))]


def test_interval_rows_mark_resolved_and_tied_methods():
    n = 60
    sft = [1.0, 2.0] * (n // 2)
    better = [2.0] * n  # wins every prompt: 50 points above SFT, which wins every other one
    same = list(sft)
    evaluations = {
        "sft": [_eval_rows(sft, [0.5] * n)] * 2,
        "dpo": [_eval_rows(better, [0.7] * n)] * 2,
        "feedme": [_eval_rows(same, [0.5] * n)] * 2,
    }
    board = [
        {
            "method": m,
            "family": "x",
            "win_rate": 0.0,
            "standard_error": 0.0,
            "avg_length": 10,
            "n": n,
            "annotator": "a",
            "reference": "r",
            "evaluation_key": f"k{m}",
            "lc_win_rate": 1.0,
        }
        for m in evaluations
    ]
    rows = {r["method"]: r for r in interval_rows([board, board], evaluations, n_boot=500)}
    assert rows["dpo"]["win_rate"] == 100.0 and rows["sft"]["win_rate"] == 50.0
    assert rows["dpo"]["resolved"] == "better" and rows["dpo"]["diff_to_sft"] == 50.0
    assert rows["feedme"]["resolved"] == "tied" and rows["feedme"]["diff_to_sft"] == 0.0
    assert rows["feedme"]["diff_low"] == 0.0 == rows["feedme"]["diff_high"]
    assert rows["sft"]["resolved"] == "" and math.isnan(rows["sft"]["diff_to_sft"])
    assert rows["dpo"]["gold_diff_to_sft"] == pytest.approx(0.2) and rows["dpo"]["mean_gold"] == pytest.approx(0.7)
    assert (rows["dpo"]["rank_best"], rows["dpo"]["rank_worst"]) == (1, 1)
    assert (rows["sft"]["rank_best"], rows["sft"]["rank_worst"]) == (2, 3)  # SFT and FeedME tie
    assert rows["dpo"]["replicates"] == 2 and rows["dpo"]["replicate_sd"] == 0.0
    md = interval_markdown(list(rows.values()), "T")
    dpo = next(line for line in md.splitlines() if "| dpo |" in line)
    assert dpo.startswith("| 1 | dpo | 100.0 [100.0, 100.0] | +50.0 [+") and "| ▲ |" in dpo
    assert "| 2–3 | feedme |" in md and "2 replicate(s) × 60 evaluation prompts" in md


def test_a_single_run_leaderboard_states_what_it_resolves():
    from farmflow.evaluation.leaderboard import leaderboard_markdown, resolution_note

    rows = [
        {"method": m, "win_rate": 50.0, "standard_error": se, "avg_length": 9, "n": 400}
        for m, se in (("a", 2.4), ("b", 2.5), ("c", 2.6))
    ]
    # median SE 2.5; 1.96 · √2 · 2.5 = 6.93
    assert resolution_note(rows) == (
        "With 400 evaluation prompts a win rate's SE is about 2.5 points: two methods must differ by more than "
        "6.9 points to be told apart (95%; paired intervals: --replicates)."
    )
    assert resolution_note(rows) in leaderboard_markdown(rows)
    assert resolution_note([{"method": "a", "win_rate": 1.0, "standard_error": float("nan"), "n": 3}]) is None
