"""Annotator analysis: agreement, bias, variance, preference rates, prices; ranking correlation; the CLI."""

from __future__ import annotations

import json
import math

import matplotlib.image as mpimg
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.evaluation.analysis import annotator_table, mode, oracle_labels, ranking_correlation, synthetic_pairs


def label(pair: int, annotator: str, pref, out1="short", out2="much longer", **extra):
    return {
        "instruction": f"q{pair}",
        "input": "",
        "output_1": out1,
        "output_2": out2,
        "annotator": annotator,
        "preference": pref,
        **extra,
    }


def test_mode_and_ties():
    assert mode([1, 1, 2]) == 1.0 and mode([2, 2, 1.5]) == 2.0 and mode([1, 2]) == 1.5 and mode([1.2, 1.9, 1.8]) == 2.0


def test_agreement_bias_variance_against_gold_hand_computed():
    gold = {"gold_1": 0.0, "gold_2": 1.0}  # output_2 is better on every pair
    rows = [
        # annotator A: pair 0 draws 2,2,1 (mode 2); pair 1 draws 2,2,2
        label(0, "A", 2, **gold),
        label(0, "A", 2, **gold),
        label(0, "A", 1, **gold),
        label(1, "A", 2, **gold),
        label(1, "A", 2, **gold),
        label(1, "A", 2, **gold),
        # annotator B: always 1 (wrong), pair 1 shown in the other order (so "2" there means output_1 = the short one)
        label(0, "B", 1, **gold),
        label(0, "B", 1, **gold),
        label(1, "B", 2, out1="much longer", out2="short", gold_1=1.0, gold_2=0.0),
        label(1, "B", "2", out1="much longer", out2="short", gold_1=1.0, gold_2=0.0),
    ]
    table = {r["annotator"]: r for r in annotator_table(rows)}
    a, b = table["A"], table["B"]
    assert a["labels"] == 6 and a["pairs"] == 2
    assert a["agreement"] == pytest.approx(5 / 6)
    assert a["bias"] == 0.0  # both modes match gold
    # held-out draws on pair 0: 2 vs mode(2,1)=1.5 -> .5, 2 vs .5, 1 vs mode(2,2)=2 -> 1; pair 1: 0,0,0
    assert a["variance"] == pytest.approx((0.5 + 0.5 + 1) / 6)
    assert b["agreement"] == 0.0 and b["bias"] == 1.0 and b["variance"] == 0.0
    # A chose the longer output 5 of 6 times; B never
    assert a["length_pref"] == pytest.approx(5 / 6) and b["length_pref"] == 0.0
    assert math.isnan(a["list_pref"])  # no pair with exactly one list
    assert math.isnan(a["price_per_1000"])
    assert table["gold"]["length_pref"] == 1.0


def test_reference_majority_of_others_and_prices():
    rows = []
    for pair in range(4):
        rows += [
            label(pair, "x", 2, price_usd=0.002, latency_s=0.5),
            label(pair, "y", 2, price_usd=0.004, latency_s=1.5),
            label(pair, "z", 1 if pair < 3 else 2),
        ]
    rows.append(label(9, "x", "garbage"))  # unusable: dropped
    table = {r["annotator"]: r for r in annotator_table(rows, "others")}
    assert "gold" not in table
    # x vs majority(y, z): pairs 0-2 split votes (left out), pair 3 agrees -> 1.0; same for y
    assert table["x"]["agreement"] == 1.0 and table["y"]["agreement"] == 1.0
    assert table["z"]["agreement"] == pytest.approx(1 / 4) and table["z"]["bias"] == pytest.approx(3 / 4)
    assert table["x"]["price_per_1000"] == pytest.approx(2.0) and table["y"]["seconds_per_1000"] == pytest.approx(
        1500.0
    )
    assert math.isnan(table["x"]["variance"])  # one draw per pair
    with pytest.raises(ValueError, match="gold"):
        annotator_table(rows, "gold")


def test_list_preference():
    lst = "1. a\n2. b"
    rows = [
        label(0, "L", 2, out1="a, b", out2=lst),
        label(1, "L", 1, out1=lst, out2="a b"),
        label(2, "L", 1, out1="a, b", out2=lst),
    ]
    assert annotator_table(rows, "others")[0]["list_pref"] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "a, b, spearman, pearson",
    [
        ({"m1": 1, "m2": 2, "m3": 3}, {"m1": 10, "m2": 20, "m3": 30}, 1.0, 1.0),
        ({"m1": 1, "m2": 2, "m3": 3}, {"m1": 3, "m2": 2, "m3": 1}, -1.0, -1.0),
        # monotone but not linear: Spearman 1; Pearson = 149 / sqrt(5 · 7205) (deviation products and squares by hand)
        ({"a": 1, "b": 2, "c": 3, "d": 4}, {"a": 1, "b": 2, "c": 3, "d": 100}, 1.0, 0.785026),
        # ranks (1,2,3,4) vs (2,1,4,3): d² sum 4 -> 1 - 6·4/(4·15) = 0.6
        ({"a": 1, "b": 2, "c": 3, "d": 4}, {"a": 2, "b": 1, "c": 4, "d": 3, "extra": 9}, 0.6, 0.6),
    ],
)
def test_ranking_correlation_known_rankings(a, b, spearman, pearson):
    c = ranking_correlation(a, b)
    assert c["n"] == len(set(a) & set(b))
    assert c["spearman"] == pytest.approx(spearman, abs=1e-4) and c["pearson"] == pytest.approx(pearson, abs=1e-4)


def test_ranking_correlation_ties_use_average_ranks():
    # x ranks (1.5, 1.5, 3), y ranks (1, 2, 3): Pearson of those
    c = ranking_correlation({"a": 1, "b": 1, "c": 5}, {"a": 1, "b": 2, "c": 3})
    assert c["spearman"] == pytest.approx(0.8660254, abs=1e-6)
    assert math.isnan(ranking_correlation({"a": 1}, {"a": 2})["spearman"])


def _instructions(n=60):
    from farmflow.config import DataConfig
    from farmflow.data import build_synthetic_farm, split_rows

    return split_rows(
        build_synthetic_farm(DataConfig(sft_size=1, pref_size=1, unlabeled_size=0, val_size=n, eval_size=2)), "val"
    )


def test_oracle_pool_on_shared_pairs_orders_annotators_by_care():
    pairs = synthetic_pairs(_instructions(120))
    assert len(pairs) == 120 and sum(p["output_1"] != p["output_2"] for p in pairs) > 100
    pool = AnnotatorConfig(
        pool=[
            OracleAnnotatorConfig(name="sharp", sharpness=60.0),
            OracleAnnotatorConfig(name="sloppy", sharpness=2.0),
            OracleAnnotatorConfig(name="long", sharpness=2.0, length_bias=4.0),
        ]
    )
    labels = oracle_labels(pairs, pool, draws=3)
    assert len(labels) == 3 * 3 * 120
    table = {r["annotator"]: r for r in annotator_table(labels)}
    assert table["sharp"]["agreement"] > table["sloppy"]["agreement"] + 0.1
    assert table["sharp"]["variance"] < table["sloppy"]["variance"]
    assert table["long"]["length_pref"] > table["sloppy"]["length_pref"] + 0.15
    assert table["sharp"]["price_per_1000"] == 0.0 and table["sharp"]["seconds_per_1000"] > 0


def _png_ok(path):
    assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.shape[0] > 100 and img.shape[1] > 200 and img[..., :3].std() > 0.05


def test_cli_oracle_mode_prints_table_and_writes_plot(tmp_path):
    runner = CliRunner()
    plot = tmp_path / "agree.png"
    result = runner.invoke(
        app,
        [
            "eval",
            "annotators",
            "--oracle",
            "--preset",
            "synthetic-micro",
            "--pairs",
            "40",
            "--draws",
            "2",
            "--plot",
            str(plot),
            "--json",
        ],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout[result.stdout.index("{") :])
    assert out["reference"] == "gold"
    names = [r["annotator"] for r in out["annotators"]]
    assert names[-1] == "gold" and len(names) == 6  # the default pool of five, plus gold
    assert all(r["labels"] == 80 for r in out["annotators"][:-1])
    _png_ok(plot)


def test_cli_files(tmp_path):
    rows = [
        label(p, a, pref, price_per_example=0.01, time_per_example=2.0)
        for p in range(5)
        for a, pref in (("x", 2), ("y", 2), ("z", 1))
    ]
    (tmp_path / "ann.json").write_text(json.dumps(rows[:10]))
    pq.write_table(
        pa.Table.from_pylist([r | {"price_usd": 0.01, "latency_s": 2.0} for r in rows[10:]]), tmp_path / "more.parquet"
    )
    runner = CliRunner()
    result = runner.invoke(
        app, ["eval", "annotators", str(tmp_path / "ann.json"), str(tmp_path / "more.parquet"), "--json"]
    )
    assert result.exit_code == 0, result.output
    out = {r["annotator"]: r for r in json.loads(result.stdout[result.stdout.index("{") :])["annotators"]}
    assert out["z"]["agreement"] == 0.0 and out["x"]["price_per_1000"] == pytest.approx(10.0)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "q"}]))
    result = runner.invoke(app, ["eval", "annotators", str(bad)])
    assert result.exit_code == 2 and "row 0" in result.output
    result = runner.invoke(app, ["eval", "annotators"])
    assert result.exit_code == 2


def test_cli_rankings(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"m1": 1, "m2": 2, "m3": 3}))
    (tmp_path / "b.json").write_text(json.dumps({"m1": 3, "m2": 2, "m3": 1}))
    result = CliRunner().invoke(app, ["eval", "rankings", str(tmp_path / "a.json"), str(tmp_path / "b.json")])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["spearman"] == pytest.approx(-1.0)


def test_ranking_correlation_leaves_out_methods_without_a_finite_score():
    """A method whose score is NaN gets no rank (it is left out, n = 3): ranked, a NaN would take the top rank
    (Spearman 0.8 here) and turn Pearson into NaN."""
    c = ranking_correlation({"a": 1, "b": 2, "c": math.nan, "d": 3}, {"a": 1, "b": 2, "c": 5, "d": 3})
    assert c["n"] == 3 and c["spearman"] == pytest.approx(1.0) and c["pearson"] == pytest.approx(1.0)
