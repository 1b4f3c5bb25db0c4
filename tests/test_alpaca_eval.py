"""AlpacaEval-exact statistics: the published leaderboard rows in ../shared are reproduced to 1e-6."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.evaluation import alpaca_eval_winrate, parse_preference, win_rate_stats

EXAMPLE = Path(__file__).resolve().parents[2] / "shared" / "data" / "alpaca_eval_example"
FIELDS = (
    "win_rate",
    "standard_error",
    "n_wins",
    "n_wins_base",
    "n_draws",
    "n_total",
    "discrete_win_rate",
    "avg_length",
)
CASES = [
    (
        "alpaca-7b_alpaca_eval_gpt4_annotations.json",
        "alpaca-7b_alpaca_eval_gpt4_leaderboard_row.csv",
    ),  # ints, legacy 0 ties
    (
        "alpaca-7b_weighted_alpaca_eval_gpt4_turbo_annotations.json",
        "alpaca-7b_weighted_alpaca_eval_gpt4_turbo_leaderboard_row.csv",
    ),
]


@pytest.mark.parametrize("annotations, row", CASES)
def test_reproduces_published_leaderboard_rows(annotations, row):
    if not EXAMPLE.is_dir():
        pytest.skip(f"shared data not found at {EXAMPLE}")
    stats = alpaca_eval_winrate(json.loads((EXAMPLE / annotations).read_text()))
    published = next(csv.DictReader((EXAMPLE / row).open()))
    for field in FIELDS:
        assert stats[field] == pytest.approx(float(published[field]), abs=1e-6), field
    assert stats["n_invalid"] == 0


@pytest.mark.parametrize(
    "value, expected",
    [
        (1, 1.0),
        (2, 2.0),
        ("2", 2.0),
        (" 1.25 ", 1.25),
        (1.0000001827, 1.0000001827),
        (0, 1.5),
        ("0", 1.5),
        (None, None),
        (float("nan"), None),
        ("nan", None),
        ("abc", None),
        ("", None),
        (3, None),
        (0.5, None),
        (True, None),
    ],
)
def test_parse_preference(value, expected):
    assert parse_preference(value) == expected


def test_edge_cases_of_the_statistics():
    # strings, a legacy 0 (tie), NaN and garbage: the last two counted, not silently lost
    stats = win_rate_stats(["2", 1, 0, float("nan"), "oops"], ["aa", "bbbb", "c", "d", "eeeee"])
    assert stats["n_total"] == 3 and stats["n_invalid"] == 2
    assert stats["win_rate"] == pytest.approx(100 * (1 + 0 + 0.5) / 3)
    assert (stats["n_wins"], stats["n_wins_base"], stats["n_draws"]) == (1, 1, 1)
    assert stats["discrete_win_rate"] == pytest.approx(50.0)
    assert stats["avg_length"] == 2  # (2+4+1+1+5)/5 = 2.6, truncated
    ties = win_rate_stats([1.5] * 4, ["x"] * 4)
    assert ties["win_rate"] == 50 and ties["standard_error"] == 0 and ties["discrete_win_rate"] == 50
    one = win_rate_stats([2], ["x"])
    assert one["win_rate"] == 100 and math.isnan(one["standard_error"])
    # the discrete win rate rounds fractional preferences to win / tie / loss
    frac = win_rate_stats([1.9, 1.6, 1.2], ["x"] * 3)
    assert frac["win_rate"] == pytest.approx(100 * (0.9 + 0.6 + 0.2) / 3)
    assert frac["discrete_win_rate"] == pytest.approx(100 * 2 / 3)


def test_cli_winrate(tmp_path):
    runner = CliRunner()
    rows = [{"preference": p, "output_2": o} for p, o in [(2, "abc"), (1, "a"), ("0", "ab"), ("bad", "abcd")]]
    path = tmp_path / "ann.json"
    path.write_text(json.dumps(rows))
    result = runner.invoke(app, ["eval", "winrate", str(path)])
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout[result.stdout.index("{") :])
    assert out["n_total"] == 3 and out["n_invalid"] == 1 and out["win_rate"] == pytest.approx(50.0)

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    result = runner.invoke(app, ["eval", "winrate", str(bad)])
    assert result.exit_code == 2 and "cannot read" in result.output
    nofield = tmp_path / "nofield.json"
    nofield.write_text(json.dumps([{"output_2": "x"}]))
    result = runner.invoke(app, ["eval", "winrate", str(nofield)])
    assert result.exit_code == 2 and "row 0" in result.output
