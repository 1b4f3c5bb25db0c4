"""Win-rate statistics and evaluation against reference outputs."""

import math
import random

import pytest

from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.data.synthetic import correct_output, sample_task, task_to_json
from farmflow.evaluation import evaluate_outputs, win_rate_stats
from farmflow.storage.schemas import SCHEMAS

# ----------------------------------------------------------------------------- win_rate_stats


def test_win_rate_hand_computed():
    stats = win_rate_stats([2, 1, 1.5, 2], ["ab", "abc", "abcd", "abcdefg"], [0.5, 1.0, None, 0.0])
    # wins p - 1 = [1, 0, 0.5, 1]: mean 0.625
    # deviations [0.375, -0.625, -0.125, 0.375]: squares sum 0.6875, ddof=1 variance 0.6875 / 3
    sd = math.sqrt(0.6875 / 3)
    assert stats["win_rate"] == pytest.approx(62.5)
    assert stats["standard_error"] == pytest.approx(100 * sd / 2)
    assert stats["standard_error"] == pytest.approx(23.935678, abs=1e-5)
    assert stats["n_wins"] == 2.0
    assert stats["n_wins_base"] == 1.0
    assert stats["n_draws"] == 1.0
    assert stats["n_total"] == 4.0
    assert stats["avg_length"] == 4.0  # (2 + 3 + 4 + 7) / 4 = 4.0
    assert stats["mean_gold"] == pytest.approx(0.5)  # None gold ignored: (0.5 + 1 + 0) / 3
    # gold deviations [0, 0.5, -0.5]: squares sum 0.5, ddof=1 variance 0.25, sd 0.5, over sqrt(3) outputs
    assert stats["gold_standard_error"] == pytest.approx(0.5 / math.sqrt(3))


def test_all_ties():
    stats = win_rate_stats([1.5] * 5, ["x"] * 5)
    assert stats["win_rate"] == 50.0
    assert stats["standard_error"] == 0.0
    assert stats["n_draws"] == 5.0 and stats["n_wins"] == 0.0 and stats["n_wins_base"] == 0.0
    assert math.isnan(stats["mean_gold"]) and math.isnan(stats["gold_standard_error"])  # no golds given


def test_all_wins_and_all_losses():
    assert win_rate_stats([2.0, 2.0, 2.0], ["a"] * 3)["win_rate"] == 100.0
    assert win_rate_stats([1.0, 1.0, 1.0], ["a"] * 3)["win_rate"] == 0.0


def test_avg_length_is_truncated_to_int():
    # (1 + 2 + 2) / 3 = 1.67 -> 1 (truncation, not rounding)
    stats = win_rate_stats([2, 1, 2], ["a", "bb", "cc"])
    assert stats["avg_length"] == 1.0
    # (3 + 4) / 2 = 3.5 -> 3
    assert win_rate_stats([2, 1], ["abc", "abcd"])["avg_length"] == 3.0


def test_nan_and_none_preferences_are_ignored():
    stats = win_rate_stats([2.0, float("nan"), None, 1.0], ["a", "b", "c", "d"])
    assert stats["n_total"] == 2.0
    assert stats["win_rate"] == 50.0
    # wins [1, 0]: sd = sqrt(0.5), se = 100 * sqrt(0.5) / sqrt(2) = 50
    assert stats["standard_error"] == pytest.approx(50.0)


def test_fractional_preferences():
    stats = win_rate_stats([1.25, 1.75], ["a", "b"])
    assert stats["win_rate"] == pytest.approx(50.0)
    # wins [0.25, 0.75]: sd = sqrt(0.125), se = 100 * sqrt(0.125) / sqrt(2) = 25
    assert stats["standard_error"] == pytest.approx(25.0)
    assert stats["n_wins"] == 1.0 and stats["n_wins_base"] == 1.0 and stats["n_draws"] == 0.0


def test_single_preference_has_nan_standard_error():
    stats = win_rate_stats([2.0], ["a"])
    assert stats["win_rate"] == 100.0
    assert math.isnan(stats["standard_error"])


@pytest.mark.parametrize("prefs", [[], [None], [float("nan"), None]])
def test_no_valid_preferences_raises(prefs):
    with pytest.raises(ValueError, match="no valid preferences"):
        win_rate_stats(prefs, ["a"] * len(prefs))


# ----------------------------------------------------------------------------- evaluate_outputs

# sharpness 500: a gold difference of 1 gives p = sigmoid(±500), exactly 1.0 / ~1e-217 in float64.
# (Much larger sharpness overflows math.exp in OracleAnnotator.judge; see test_annotators.py.)
SHARP = AnnotatorConfig(pool=[OracleAnnotatorConfig(name="sharp", sharpness=500.0)], label_noise=0.0, seed=0)


def _eval_rows(n=3, seed=0):
    rng = random.Random(seed)
    tasks = [sample_task("sort", rng) for _ in range(n)]
    refs, base = [], []
    for i, t in enumerate(tasks):
        refs.append({"id": f"eval-{i:05d}", "output": correct_output(t)})
        base.append(
            {
                "id": f"eval-{i:05d}",
                "instruction": t.instruction,
                "input": t.input,
                "generator": "m",
                "task": task_to_json(t),
            }
        )
    return tasks, refs, base


def test_output_equal_to_reference_is_a_tie():
    tasks, refs, base = _eval_rows(2)
    outputs = [b | {"output": r["output"]} for b, r in zip(base, refs)]
    table, stats = evaluate_outputs(outputs, refs, AnnotatorConfig())  # default pool
    assert table.schema == SCHEMAS["evaluation"]
    assert table.column("preference").to_pylist() == [1.5, 1.5]
    assert stats["win_rate"] == 50.0 and stats["standard_error"] == 0.0 and stats["n_draws"] == 2.0
    assert stats["mean_gold"] == 1.0 and stats["reference_mean_gold"] == 1.0


def test_evaluate_outputs_judges_against_the_reference():
    tasks, refs, base = _eval_rows(3)
    # row 0: equal to the reference (tie); row 1: the reference is wrong and the output right (win);
    # row 2: the output is garbage (loss)
    refs[1]["output"] = "1, 2"  # numbers not in the input: gold 0
    outputs = [
        base[0] | {"output": refs[0]["output"]},
        base[1] | {"output": correct_output(tasks[1]), "generator": "other"},
        base[2] | {"output": "no idea"},
    ]
    table, stats = evaluate_outputs(outputs, list(reversed(refs)), SHARP)  # reference order does not matter
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == ["eval-00000", "eval-00001", "eval-00002"]
    assert [r["preference"] for r in rows] == [1.5, 2.0, 1.0]
    assert [r["output_1"] for r in rows] == [refs[0]["output"], "1, 2", refs[2]["output"]]
    assert [r["output_2"] for r in rows] == [o["output"] for o in outputs]
    assert [r["generator"] for r in rows] == ["m", "other", "m"]
    assert [r["annotator"] for r in rows] == ["sharp"] * 3
    assert [r["gold_1"] for r in rows] == [1.0, 0.0, 1.0]
    assert [r["gold_2"] for r in rows] == [1.0, 1.0, 0.0]
    assert stats["win_rate"] == 50.0
    assert (stats["n_wins"], stats["n_wins_base"], stats["n_draws"]) == (1.0, 1.0, 1.0)
    assert stats["mean_gold"] == pytest.approx(2 / 3)
    assert stats["reference_mean_gold"] == pytest.approx(2 / 3)
    assert stats["avg_length"] == float(int(sum(len(o["output"]) for o in outputs) / 3))


def test_missing_reference_raises():
    tasks, refs, base = _eval_rows(3)
    outputs = [b | {"output": "x"} for b in base]
    with pytest.raises(ValueError, match="eval-00001"):
        evaluate_outputs(outputs, [refs[0], refs[2]], SHARP)


# ----------------------------------------------------------------------------- leaderboards
BOARD = [
    {
        "method": "best_of_4",
        "win_rate": 57.2,
        "standard_error": 2.5,
        "discrete_win_rate": 57.0,
        "lc_win_rate": 55.1,
        "lc_standard_error": 2.4,
        "mean_gold": 0.6,
        "gold_standard_error": 0.021,
        "avg_length": 26,
        "n": 400,
        "annotator": "oracle pool (5)",
        "reference": "refs",
    },
    {
        "method": "sft",
        "win_rate": 54.2,
        "standard_error": 2.5,
        "discrete_win_rate": 54.0,
        "lc_win_rate": float("nan"),
        "lc_standard_error": float("nan"),
        "mean_gold": None,
        "avg_length": 25,
        "n": 400,
        "annotator": "oracle pool (5)",
        "reference": "refs",
    },
    {
        "method": "untrained",
        "win_rate": 11.8,
        "standard_error": float("nan"),
        "discrete_win_rate": 11.8,
        "lc_win_rate": 20.0,
        "lc_standard_error": 3.0,
        "mean_gold": 0.004,
        "gold_standard_error": float("nan"),
        "avg_length": 144,
        "n": 400,
        "annotator": "oracle pool (5)",
        "reference": "refs",
    },
]


def test_leaderboard_markdown_has_every_row():
    from farmflow.evaluation import leaderboard_markdown

    md = leaderboard_markdown(BOARD, "Demo")
    assert md.startswith("### Demo")
    assert "| best_of_4 | 57.2 | 2.5 | 57.0 | 55.1 | 2.4 | 0.600 | 0.021 | 26 | 400 |" in md
    assert "| sft | 54.2 | 2.5 | 54.0 | — | — | — | — | 25 | 400 |" in md  # no gold in the real farm: dashes
    assert "| untrained | 11.8 | — | 11.8 | 20.0 | 3.0 | 0.004 | — | 144 | 400 |" in md
    assert "Annotator: oracle pool (5); reference: refs." in md


def _png_ok(path, min_w=300):
    import matplotlib.image as mpimg

    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.shape[0] > 100 and img.shape[1] > min_w
    assert img[..., :3].std() > 0.05  # bars, text and axes, not a blank canvas
    return img


def test_leaderboard_plot_is_a_real_png(tmp_path):
    from farmflow.evaluation import method_family, plot_leaderboard

    path = tmp_path / "board.png"
    plot_leaderboard(BOARD, str(path))
    _png_ok(path)
    assert [method_family(m) for m in ("untrained", "sft", "best_of_16", "dpo")] == [
        "baseline",
        "sft",
        "reward model",
        "preferences",
    ]


def test_annotator_label():
    from farmflow.evaluation import annotator_label

    assert annotator_label(AnnotatorConfig().model_dump()) == "oracle pool (5)"
    assert annotator_label(AnnotatorConfig(label_noise=0.5).model_dump()) == "oracle pool (5), noise 0.5"
    assert annotator_label(SHARP.model_dump()) == "oracle sharp"
    assert annotator_label(None) == "unknown"


def test_leaderboard_rows_pool_difficulty_and_sort():
    from farmflow.evaluation import leaderboard_rows

    tasks, refs, base = _eval_rows(8)
    good = [b | {"output": r["output"]} for b, r in zip(base, refs)]  # equal to the reference: all ties
    bad = [b | {"output": "no idea"} for b in base]
    entries = []
    for method, outs in (("sft", good), ("untrained", bad)):
        table, stats = evaluate_outputs(outs, refs, SHARP)
        entries.append(
            {
                "method": method,
                "metrics": stats,
                "rows": table.to_pylist(),
                "group": "g",
                "annotator": "oracle sharp",
                "reference": "refs",
                "evaluation_key": method,
            }
        )
    rows = leaderboard_rows(entries)
    assert [r["method"] for r in rows] == ["sft", "untrained"]
    assert rows[0]["win_rate"] == 50.0 and rows[1]["win_rate"] == 0.0
    assert (
        rows[0]["lc_win_rate"] == 50.0 and rows[1]["lc_win_rate"] == 0.0
    )  # nothing to adjust when every label is the same
    assert rows[0]["family"] == "sft" and rows[1]["family"] == "baseline" and rows[0]["n"] == 8


def test_leaderboard_task_writes_table_markdown_plot(tmp_path, monkeypatch):
    from farmflow.storage import open_store
    from farmflow.tasks import leaderboard_task

    store = open_store(str(tmp_path / "store"))
    tasks, refs, base = _eval_rows(12, seed=1)
    evaluations = {}
    for i, (method, outs) in enumerate(
        (
            ("sft", [b | {"output": r["output"] + " ok"} for b, r in zip(base, refs)]),
            (
                "best_of_4",
                [b | {"output": (r["output"] if j % 3 else "no")} for j, (b, r) in enumerate(zip(base, refs))],
            ),
            ("untrained", [b | {"output": "x" * (j + 1)} for j, b in enumerate(base)]),
        )
    ):
        table, stats = evaluate_outputs(outs, refs, AnnotatorConfig())
        evaluations[method] = store.put_table(
            "evaluate", f"k{i}", table, "evaluation", config=AnnotatorConfig(), inputs={"data": "d1"}, metrics=stats
        )
    # a peer evaluation with the same judge and references enters the difficulty (and the key)
    table, stats = evaluate_outputs([b | {"output": "zz"} for b in base], refs, AnnotatorConfig())
    store.put_table(
        "evaluate", "peer", table, "evaluation", config=AnnotatorConfig(), inputs={"data": "d1"}, metrics=stats
    )
    ref = leaderboard_task.fn(str(tmp_path / "store"), evaluations, "Test board")
    assert ref.metrics["difficulty_peer_runs"] == 1.0
    rows = store.read_table(ref).to_pylist()
    assert [r["method"] for r in rows] == sorted(evaluations, key=lambda m: -evaluations[m].metrics["win_rate"])
    assert set(rows[0]) == set(SCHEMAS["leaderboard"].names)
    for r in rows:
        m = evaluations[r["method"]].metrics
        assert r["win_rate"] == m["win_rate"] and r["discrete_win_rate"] == m["discrete_win_rate"] and r["n"] == 12
        assert 0 <= r["lc_win_rate"] <= 100 and r["annotator"] == "oracle pool (5)" and r["reference"].endswith("d1")
    assert "| sft |" in store.read_file(ref, "leaderboard.md").decode()
    (tmp_path / "board.png").write_bytes(store.read_file(ref, "leaderboard.png"))
    _png_ok(tmp_path / "board.png")

    # the same board again is read back, not fitted again; a new peer is a new key, computed
    from farmflow.evaluation import leaderboard_rows
    from farmflow.tasks import analysis

    fitted = []
    monkeypatch.setattr(analysis, "leaderboard_rows", lambda *a: fitted.append(a) or leaderboard_rows(*a))
    assert leaderboard_task.fn(str(tmp_path / "store"), evaluations, "Test board") == ref and fitted == []
    store.put_table(
        "evaluate", "peer-2", table, "evaluation", config=AnnotatorConfig(), inputs={"data": "d1"}, metrics=stats
    )
    again = leaderboard_task.fn(str(tmp_path / "store"), evaluations, "Test board")
    assert again.key != ref.key and again.metrics["difficulty_peer_runs"] == 2.0 and len(fitted) == 1

    # `farmflow leaderboard` prints it, with the rank correlation of win rate and gold
    from typer.testing import CliRunner

    from farmflow.cli import app

    result = CliRunner().invoke(app, ["leaderboard", "--store", str(tmp_path / "store")])
    assert result.exit_code == 0, result.output
    assert "Leaderboard (" in result.output and "annotator: oracle pool (5)" in result.output
    assert "win rate vs mean gold over 3 methods: Spearman" in result.output

    # peers are grouped by the evaluation split's content: another data artifact with the same eval split counts
    from farmflow.config import DataConfig
    from farmflow.tasks import data_task

    small = dict(pref_size=4, unlabeled_size=0, val_size=2, eval_size=2)
    d_a, d_b = (data_task.fn(str(tmp_path / "store"), DataConfig(sft_size=n, **small)) for n in (4, 6))
    d_c = data_task.fn(str(tmp_path / "store"), DataConfig(sft_size=4, **(small | {"eval_size": 3})))
    assert d_a.key != d_b.key and d_a.parts["eval"] == d_b.parts["eval"] != d_c.parts["eval"]
    for name, data in (("on-a", d_a), ("on-b", d_b), ("on-c", d_c)):
        store.put_table(
            "evaluate", name, table, "evaluation", config=AnnotatorConfig(), inputs={"data": data.key}, metrics=stats
        )
    on_a = {
        "sft": store.put_table(
            "evaluate",
            "board-a",
            table,
            "evaluation",
            config=AnnotatorConfig(),
            inputs={"data": d_a.key},
            metrics=stats,
        )
    }
    assert (
        leaderboard_task.fn(str(tmp_path / "store"), on_a, "Split board").metrics["difficulty_peer_runs"] == 2.0
    )  # on-a, on-b
