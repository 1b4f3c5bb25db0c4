"""`--json` output is strict JSON: NaN (mean gold on real data) and infinities become null."""

import json
import math

from farmflow.cli import print_json


def test_print_json_turns_nan_and_infinity_into_null(capsys):
    print_json(
        {
            "leaderboard": [{"method": "sft", "mean_gold": math.nan, "win_rate": 51.5}],
            "reward": {"heldout_gold_accuracy": float("inf")},
            "n": (1, -math.inf),
        }
    )
    out = capsys.readouterr().out
    assert "NaN" not in out and "Infinity" not in out
    assert json.loads(out) == {
        "leaderboard": [{"method": "sft", "mean_gold": None, "win_rate": 51.5}],
        "reward": {"heldout_gold_accuracy": None},
        "n": [1, None],
    }
