"""The ridge LC estimator (`method="ridge"`): recovery of known coefficients, SE, the shared example, the CLI.

AlpacaEval 2's procedure (the default method) is tested in tests/test_glm_lc.py."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.evaluation.lc import (
    instruction_difficulty,
    lc_of_rows,
    length_controlled_winrate,
    length_feature,
    run_of_rows,
)

EXAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca_eval_example"


def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def synthetic_run(rng, gamma, theta, phi, psi, length_shift, soft=False):
    """One model judged on every instruction: preferences drawn from the LC model itself."""
    d = rng.normal(length_shift, 300.0, len(gamma))
    p = sigmoid(theta + phi * length_feature(d) + psi * gamma)
    y = p if soft else (rng.random(len(gamma)) < p).astype(float)
    return d, 1.0 + y, p


def test_fit_recovers_known_coefficients_and_counterfactual():
    rng = np.random.default_rng(0)
    n = 6000
    gamma = rng.normal(0, 1, n)
    gamma = (gamma - gamma.mean()) / gamma.std()
    keys = [f"x{i}" for i in range(n)]
    theta, phi, psi = -0.4, 1.5, -0.8
    d, prefs, _ = synthetic_run(rng, gamma, theta, phi, psi, length_shift=150.0)
    out = length_controlled_winrate(keys, prefs.tolist(), d.tolist(), dict(zip(keys, gamma)), method="ridge")
    assert out["lc_intercept"] == pytest.approx(theta, abs=0.12)
    assert out["lc_length_coef"] == pytest.approx(phi, abs=0.15)
    assert out["lc_difficulty_coef"] == pytest.approx(psi, abs=0.1)
    truth = 100 * sigmoid(theta + psi * gamma).mean()  # same instructions, length difference zero
    assert abs(out["lc_win_rate"] - truth) < 2.5 * out["lc_standard_error"]
    # the raw win rate is inflated by the length bias; the LC one is not
    assert 100 * (prefs - 1).mean() > truth + 5


def test_soft_labels_recover_coefficients_almost_exactly():
    # fractional preferences (AlpacaEval 2's weighted judge) equal to the model's own probabilities
    rng = np.random.default_rng(1)
    n = 3000
    gamma = rng.normal(0, 1, n)
    keys = [f"x{i}" for i in range(n)]
    d, prefs, _ = synthetic_run(rng, gamma, 0.3, -1.0, 0.7, length_shift=-100.0, soft=True)
    out = length_controlled_winrate(
        keys, prefs.astype(str).tolist(), d.tolist(), dict(zip(keys, gamma)), method="ridge"
    )
    # only the weak L2 penalty (0.2 on 3000 rows) separates the fit from the truth
    assert (out["lc_intercept"], out["lc_length_coef"], out["lc_difficulty_coef"]) == pytest.approx(
        (0.3, -1.0, 0.7), abs=0.01
    )


def test_instruction_difficulty_recovered_from_many_runs():
    rng = np.random.default_rng(2)
    n, models = 300, 30
    gamma = rng.normal(0, 1, n)
    keys = [f"x{i}" for i in range(n)]
    runs = []
    for m in range(models):
        d, prefs, _ = synthetic_run(rng, gamma, rng.normal(0, 1), rng.normal(1, 0.3), -1.0, rng.normal(0, 200))
        runs.append({"instructions": keys, "preferences": prefs.tolist(), "delta_len": d.tolist()})
    est = instruction_difficulty(runs, method="ridge")
    z = np.array([est[k] for k in keys])
    assert abs(z.mean()) < 1e-9 and z.std() == pytest.approx(1.0)
    # harder instruction = lower chance to win: the estimate follows -ψ·γ = γ
    assert np.corrcoef(z, gamma)[0, 1] > 0.85


def test_delta_method_standard_error_matches_the_bootstrap():
    rng = np.random.default_rng(3)
    n = 800
    gamma = rng.normal(0, 1, n)
    keys = [f"x{i}" for i in range(n)]
    difficulty = dict(zip(keys, gamma))
    d, prefs, _ = synthetic_run(rng, gamma, -0.2, 1.2, -0.6, length_shift=120.0)
    se = length_controlled_winrate(keys, prefs.tolist(), d.tolist(), difficulty, method="ridge")["lc_standard_error"]
    boots = []
    for _ in range(150):
        i = rng.integers(0, n, n)
        boots.append(
            length_controlled_winrate(
                [keys[j] for j in i], prefs[i].tolist(), d[i].tolist(), difficulty, method="ridge"
            )["lc_win_rate"]
        )
    assert se == pytest.approx(np.std(boots, ddof=1), rel=0.25)


def test_degenerate_runs():
    # all ties / all wins: nothing to adjust; one row: no standard error
    ties = length_controlled_winrate(["a", "b", "c"], [1.5, 1.5, 0], [10, -5, 3], method="ridge")
    assert ties["lc_win_rate"] == 50.0 and ties["lc_standard_error"] == 0.0
    wins = length_controlled_winrate(["a", "b"], ["2", 2.0], [10, 20], method="ridge")
    assert wins["lc_win_rate"] == 100.0
    one = length_controlled_winrate(["a"], [2], [0], method="ridge")
    assert one["lc_win_rate"] == 100.0 and math.isnan(one["lc_standard_error"])
    # NaN and garbage are left out, strings parsed; equal lengths make the length term vanish
    mixed = length_controlled_winrate(
        ["a", "b", "c", "d", "e"], ["2", 1, float("nan"), "oops", 2], [0, 0, 0, 0, 0], method="ridge"
    )
    assert mixed["lc_length_coef"] == pytest.approx(0.0, abs=1e-9)
    assert 50 < mixed["lc_win_rate"] < 70  # 2 wins, 1 loss, shrunk slightly by the prior
    with pytest.raises(ValueError, match="no valid preferences"):
        length_controlled_winrate(["a"], [None], [0], method="ridge")


@pytest.mark.parametrize(
    "annotations, row, ours, se",
    [
        ("alpaca-7b_alpaca_eval_gpt4_annotations.json", "alpaca-7b_alpaca_eval_gpt4_leaderboard_row.csv", 25.73, 1.66),
        (
            "alpaca-7b_weighted_alpaca_eval_gpt4_turbo_annotations.json",
            "alpaca-7b_weighted_alpaca_eval_gpt4_turbo_leaderboard_row.csv",
            18.24,
            3.80,
        ),
    ],
)
def test_shared_example_lc_without_a_difficulty_table(annotations, row, ours, se):
    """One run and no other: the length term alone (docs/evaluation.md). AlpacaEval 1 lands within 1.5 points of
    the published LC; AlpacaEval 2 (a baseline 4x longer on 97% of instructions) does not without its table."""
    if not EXAMPLE.is_dir():
        pytest.skip(f"shared data not found at {EXAMPLE}")
    rows = json.loads((EXAMPLE / annotations).read_text())
    published = float(next(csv.DictReader((EXAMPLE / row).open()))["length_controlled_winrate"])
    out = lc_of_rows(rows, method="ridge")
    assert (out["lc_win_rate"], out["lc_standard_error"]) == pytest.approx((ours, se), abs=0.01)
    assert (
        out["lc_difficulty_runs"] == 0 and lc_of_rows(rows, [run_of_rows(rows)], method="ridge") == out
    )  # its own labels never count
    if "gpt4_turbo" not in annotations:
        assert abs(out["lc_win_rate"] - published) < 1.5, (out["lc_win_rate"], published)


def test_a_run_alone_is_length_controlled_not_handed_back_its_own_outcomes():
    """A run's own labels never enter its difficulty table, so the LC estimate is unbiased: with them, psi * gamma would
    hand each instruction's outcome back and undo the length control (simulated: true LC 41, raw 56.5, estimate 55)."""
    rng = np.random.default_rng(0)
    n = 805
    errors = []
    for _ in range(6):
        d, prefs, _ = synthetic_run(rng, np.zeros(n), -0.35, 1.5, 0.0, 150.0)  # longer outputs, no difficulty effect
        true_lc = 100 * sigmoid(-0.35)
        out = length_controlled_winrate([f"x{i}" for i in range(n)], prefs, d, method="ridge")
        errors.append((out["lc_win_rate"] - true_lc) / out["lc_standard_error"])
        assert 100 * np.mean(prefs - 1) > true_lc + 8  # the raw win rate is well above the truth
    assert abs(np.mean(errors)) < 1.5 and max(map(abs, errors)) < 3.5


def test_cli_winrate_reports_lc_and_uses_extra_files_for_difficulty(tmp_path):
    rng = np.random.default_rng(4)
    n = 200
    gamma = rng.normal(0, 1, n)
    files = []
    for m, (theta, shift) in enumerate([(0.5, 200.0), (-0.5, -200.0), (0.0, 0.0)]):
        d, prefs, _ = synthetic_run(rng, gamma, theta, 1.0, -1.0, shift)
        rows = [
            {
                "instruction": f"task {i}",
                "output_1": "r" * 500,
                "output_2": "o" * max(0, int(500 + d[i])),
                "preference": float(prefs[i]),
            }
            for i in range(n)
        ]
        files.append(tmp_path / f"m{m}.json")
        files[-1].write_text(json.dumps(rows))
    runner = CliRunner()
    alone = runner.invoke(app, ["eval", "winrate", str(files[0]), "--lc-method", "ridge"])
    assert alone.exit_code == 0, alone.output
    out = json.loads(alone.stdout[alone.stdout.index("{") :])
    assert {"win_rate", "lc_win_rate", "lc_standard_error"} <= set(out) and out["lc_difficulty_runs"] == 0
    pooled = runner.invoke(
        app,
        ["eval", "winrate", str(files[0]), "--difficulty", str(files[1]), "--difficulty", str(files[2]), "--lc-method"]
        + ["ridge"],
    )
    assert pooled.exit_code == 0, pooled.output
    out2 = json.loads(pooled.stdout[pooled.stdout.index("{") :])
    assert out2["lc_difficulty_runs"] == 2 and out2["win_rate"] == out["win_rate"]
    assert out2["lc_win_rate"] != out["lc_win_rate"]
    # a --difficulty file without references is refused: its length differences would be whole outputs
    bare = tmp_path / "bare.json"
    bare.write_text(
        json.dumps([{k: v for k, v in r.items() if k != "output_1"} for r in json.loads(files[1].read_text())])
    )
    refused = runner.invoke(app, ["eval", "winrate", str(files[0]), "--difficulty", str(bare)])
    assert refused.exit_code == 2 and "--difficulty files need 'output_1'" in " ".join(refused.output.split())
