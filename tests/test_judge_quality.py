"""How good is the judge: the metrics by hand, and `farmflow eval annotators --judge` on the real GPT-4 annotations
with a tiny hf judge built here and api judges on the loopback judge server."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from test_hf_judge import save_tiny_judge
from typer.testing import CliRunner

from farmflow.annotators.server import JudgeConfig, JudgeServer
from farmflow.cli import app
from farmflow.config import OracleAnnotatorConfig
from farmflow.evaluation.judge_quality import (
    Pair,
    agreement,
    choice,
    coin_choices,
    length_bias,
    longer_choices,
    parse_judge,
    position_bias,
    read_pairs,
    summary,
    wilson,
)

DATA = Path(__file__).resolve().parents[1] / "../shared/data/alpaca_eval_example"
GPT4 = DATA / "alpaca-7b_alpaca_eval_gpt4_annotations.json"
WEIGHTED = DATA / "alpaca-7b_weighted_alpaca_eval_gpt4_turbo_annotations.json"
KEY = "sk-judge-quality-test"


def pair(o1: str, o2: str, ref: float = 1.0, ins: str = "q") -> Pair:
    return Pair(ins, "", o1, o2, ref)


# ----------------------------------------------------------------------------- metrics by hand
def test_wilson_interval_hand_computed():
    # 8 of 10, z = 1.959964: centre = (.8 + z²/20) / (1 + z²/10) = .992073 / 1.384146 = .716740,
    # half = z·sqrt(.8·.2/10 + z²/400) / 1.384146 = 1.959964 · .160011 / 1.384146 = .226575
    assert wilson(8, 10) == pytest.approx((0.716740 - 0.226575, 0.716740 + 0.226575), abs=1e-5)
    # 0 of 10: centre = half = (z²/20) / (1 + z²/10) = .192073 / 1.384146 = .138766; the lower bound is 0
    assert wilson(0, 10) == pytest.approx((0.0, 0.277532), abs=1e-5)
    lo, hi = wilson(7.5, 10)  # a half point (an undecided pair) lies between 7 and 8
    assert wilson(7, 10)[0] < lo < wilson(8, 10)[0] and wilson(7, 10)[1] < hi < wilson(8, 10)[1]
    assert all(math.isnan(x) for x in wilson(0, 0))


def test_choice_and_agreement_hand_computed():
    assert choice((0.9, 0.8)) == 1.0 and choice((0.2, 0.4)) == 2.0
    assert choice((0.9, 0.1)) == 1.5  # the orders disagree exactly: undecided
    assert choice((None, 0.3)) == 2.0 and choice((None, None)) == 1.5  # only the answered order counts
    # right, wrong, undecided (half), right: (1 + 0 + .5 + 1) / 4
    a = agreement([1.0, 2.0, 1.5, 2.0], [1.0, 1.0, 2.0, 2.0])
    assert a["agreement"] == pytest.approx(0.625) and a["n"] == 4 and a["undecided"] == 1
    assert (a["ci_low"], a["ci_high"]) == pytest.approx(wilson(2.5, 4))


def test_position_bias_hand_computed():
    verdicts = [
        (0.9, 0.1),  # output_1 as (a) wins; output_1 as (b) loses, i.e. (a) wins again: slot (a) both times
        (0.2, 0.8),  # (b) wins, then output_1 as (b) wins: slot (b) both times
        (0.9, 0.7),  # output_1 both times: the content decides
        (0.3, 0.2),  # output_2 both times
        (None, 0.3),  # one order unanswered: left out
    ]
    assert position_bias(verdicts) == pytest.approx(
        {"position_bias": 2 / 4, "first_slot": 1 / 4, "second_slot": 1 / 4, "position_pairs": 4}
    )
    assert math.isnan(position_bias([(None, 0.5)])["position_bias"])


def test_length_bias_and_the_baselines_hand_computed():
    pairs = [
        pair("aaaa", "bb", 1.0, "q0"),
        pair("a", "bbb", 1.0, "q1"),
        pair("aa", "bb", 2.0, "q2"),
        pair("aaa", "b", 2.0, "q3"),
    ]
    longer = longer_choices(pairs)
    assert longer == [1.0, 2.0, 1.5, 1.0]
    # pairs of different length: 0 (longer = output_1), 1 (output_2), 3 (output_1)
    assert length_bias([1.0, 1.0, 2.0, 1.5], pairs) == {"prefers_longer": 0.5, "length_pairs": 2}  # pair 3 undecided
    assert length_bias(longer, pairs)["prefers_longer"] == 1.0
    row = summary("longer", "baseline", longer, pairs)
    # right, wrong, undecided, wrong: 1.5 of 4
    assert row["agreement"] == pytest.approx(1.5 / 4) and row["undecided"] == 1 and row["position_bias"] is None
    coin = coin_choices(pairs, seed=3)
    assert coin == coin_choices(pairs, seed=3) and set(coin) <= {1.0, 2.0}
    many = [pair(f"x{i}", f"y{i}", 1.0, f"q{i}") for i in range(400)]
    shares = [sum(c == 1.0 for c in coin_choices(many, s)) / 400 for s in (0, 1)]
    assert all(0.42 < s < 0.58 for s in shares) and coin_choices(many, 0) != coin_choices(many, 1)


def test_read_pairs_skips_ties_and_unreadable_preferences(tmp_path):
    rows = [
        {"instruction": f"q{i}", "output_1": "a", "output_2": "bb", "preference": p, "annotator": "gpt4"}
        for i, p in enumerate([1, 0, "1.7", "n/a", 1.5, 2, None, 1.2, 2])
    ]
    path = tmp_path / "ann.json"
    path.write_text(json.dumps(rows))
    pairs, info = read_pairs(path, limit=3)
    # decisive: row 0 (1), row 2 ("1.7" -> output_2), row 5 (2); ties: rows 1 (0) and 4 (1.5); unreadable: row 3
    assert [(p.instruction, p.reference) for p in pairs] == [("q0", 1.0), ("q2", 2.0), ("q5", 2.0)]
    assert info == {"rows_read": 6, "skipped_ties": 2, "skipped_invalid": 1, "reference": "gpt4"}
    assert len(read_pairs(path)[0]) == 5 and read_pairs(path)[1]["skipped_invalid"] == 2
    path.write_text(json.dumps([{"instruction": "q", "output_1": "a", "preference": 1}]))
    with pytest.raises(ValueError, match="row 0 has no string field 'output_2'"):
        read_pairs(path)
    path.write_text(json.dumps([{"instruction": "q", "output_1": "a", "output_2": "b", "preference": 0}]))
    with pytest.raises(ValueError, match="no row with a decisive reference preference \\(1 ties"):
        read_pairs(path)


def test_the_weighted_judges_fractional_preferences_read_by_their_side_of_one_and_a_half():
    rows = json.loads(WEIGHTED.read_text())
    pairs, info = read_pairs(WEIGHTED, limit=50)
    expected = [1.0 if float(r["preference"]) < 1.5 else 2.0 for r in rows if float(r["preference"]) != 1.5][:50]
    assert [p.reference for p in pairs] == expected and info["reference"] == "weighted_alpaca_eval_gpt4_turbo"


def test_judge_specs():
    hf = parse_judge("hf:smollm2-135m-instruct?batch_size=4")
    assert (hf.kind, hf.model, hf.hf_config().batch_size) == ("hf", "smollm2-135m-instruct", 4)
    api = parse_judge("api:http://127.0.0.1:8000/v1@org/model-1?temperature=0.7")
    a = api.api_annotator()
    assert (api.base_url, a.model, a.temperature, a.prompt_format) == (
        "http://127.0.0.1:8000/v1",
        "org/model-1",
        0.7,
        "choice",
    )
    assert parse_judge("api:http://h/v1@m").api_annotator().temperature == 0.0
    assert parse_judge("api:http://h/v1@m?format=logprobs").api_annotator().prompt_format == "logprobs"
    assert parse_judge("longer") is None and parse_judge("coin") is None
    for bad, message in [
        ("gpt-4", "expected hf:MODEL"),
        ("api:http://h/v1", "api:BASE_URL@MODEL"),
        ("hf:m?bogus=1", "unknown option"),
        ("api:http://h/v1@m?temperature=9", "temperature"),
        ("hf:m?batch_size=x", "batch_size"),
        ("api:http://user:s3cr3t@h/v1@m", "credentials"),
        ("api:http://h/v1@m?api_key=s3cr3t", "unknown option"),
    ]:
        with pytest.raises(ValueError, match=message) as err:
            parse_judge(bad)
        assert "s3cr3t" not in str(err.value)  # an api judge's URL and options are never repeated


# ----------------------------------------------------------------------------- the CLI end to end
def run_cli(*args: str) -> dict:
    result = CliRunner().invoke(app, ["eval", "annotators", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def check_row(row: dict, n: int) -> None:
    assert row["n"] == n and 0 <= row["ci_low"] <= row["agreement"] <= row["ci_high"] <= 1
    assert 0 <= row["prefers_longer"] <= 1


def test_cli_hf_judge_on_the_real_gpt4_annotations(tmp_path):
    model = save_tiny_judge(tmp_path / "tiny-judge")
    store = str(tmp_path / "store")
    args = [str(GPT4), "--judge", f"hf:{model}", "--limit", "8", "--seed", "1", "--store", store]
    report = run_cli(*args)
    assert {
        "file",
        "reference",
        "pairs",
        "skipped_ties",
        "skipped_invalid",
        "interval",
        "judges",
        "baselines",
        "paper",
        "reference_prefers_longer",
    } <= set(report)
    assert report["pairs"] == 8 and report["reference"] == "alpaca_eval_gpt4" and "Wilson" in report["interval"]
    (judge,) = report["judges"]
    check_row(judge, 8)
    assert judge["judge"] == f"hf:{model}" and judge["kind"] == "hf" and judge["parse_failures"] == 0
    assert judge["judged"] == 8 and judge["cached"] == 0 and judge["seconds_per_pair"] > 0
    assert judge["position_pairs"] == 8 and 0 <= judge["position_bias"] <= 1
    assert judge["position_bias"] == pytest.approx(judge["first_slot"] + judge["second_slot"])

    # the baselines by hand from the file: the first 8 rows are all decisive (GPT-4 prefers output_1 in each)
    rows = json.loads(GPT4.read_text())[:8]
    assert all(r["preference"] in (1, 2) for r in rows)
    by_hand = sum((len(r["output_2"]) > len(r["output_1"])) == (r["preference"] == 2) for r in rows) / 8
    assert by_hand == 7 / 8  # only row 7 has a longer output_2
    longer, coin = report["baselines"]
    assert longer["judge"] == "longer" and longer["agreement"] == pytest.approx(by_hand)
    assert longer["prefers_longer"] == 1
    assert coin["judge"] == "coin" and coin["expected_agreement"] == 0.5
    pairs = read_pairs(GPT4, 8)[0]
    assert coin["agreement"] == pytest.approx(sum(c == p.reference for c, p in zip(coin_choices(pairs, 1), pairs)) / 8)
    for row in (longer, coin):
        check_row(row, 8)
    assert {p["agreement"] for p in report["paper"]} == {0.65, 0.66, 0.622}

    again = run_cli(*args)  # every pair from the row cache: free, and the same numbers
    assert again["judges"][0]["judged"] == 0 and again["judges"][0]["cached"] == 8
    assert again["judges"][0]["seconds_per_pair"] is None
    for k in ("agreement", "position_bias", "prefers_longer"):
        assert again["judges"][0][k] == judge[k]


def judge_server(**bias) -> JudgeServer:
    """The loopback judge with one oracle; AlpacaEval's instructions are no synthetic tasks, so only `bias` decides."""
    return JudgeServer(JudgeConfig(api_key=KEY, pool=[OracleAnnotatorConfig(name="judge", **bias)]))


def test_cli_api_judge_asks_both_orders_once(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    pairs = read_pairs(GPT4, 6)[0]
    store = str(tmp_path / "store")
    # an oracle that always takes the output shown first (temperature 0): every pair goes to slot (a) twice
    srv = judge_server(position_bias=3.0)
    with srv as url:
        report = run_cli(str(GPT4), "--judge", f"api:{url}@first-taker", "--limit", "6", "--store", store)
        (judge,) = report["judges"]
        assert judge["position_bias"] == 1.0 and judge["first_slot"] == 1.0 and judge["position_pairs"] == 6
        assert judge["agreement"] == 0.5 and judge["undecided"] == 6 and judge["parse_failures"] == 0
        assert judge["judged"] == 6 and judge["cached"] == 0
        shown = srv.state.pairs
        assert len(shown) == 12 and set(shown.values()) == {1}  # each pair once in each order, nothing twice
        for p in pairs:
            assert shown[(p.instruction, "", p.output_1, p.output_2)] == 1
            assert shown[(p.instruction, "", p.output_2, p.output_1)] == 1
        requests = srv.state.stats["requests"]
        again = run_cli(str(GPT4), "--judge", f"api:{url}@first-taker", "--limit", "6", "--store", store)
        assert srv.state.stats["requests"] == requests and again["judges"][0]["cached"] == 6  # rerun: free
        assert again["judges"][0]["position_bias"] == 1.0

    # an oracle that only likes length: content decides (no slot bias) and it agrees exactly as the longer baseline
    with judge_server(length_bias=5.0) as url:
        report = run_cli(str(GPT4), "--judge", f"api:{url}@length-lover", "--limit", "8", "--store", store)
    (judge,) = report["judges"]
    assert judge["position_bias"] == 0.0 and judge["prefers_longer"] == 1.0
    assert judge["agreement"] == report["baselines"][0]["agreement"] == 7 / 8  # it misses row 7, a longer output_2


def test_cli_api_judge_counts_answers_that_do_not_parse(tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    with JudgeServer(JudgeConfig(api_key=KEY, fault_rate=1.0, faults=["garbage"])) as url:
        report = run_cli(str(GPT4), "--judge", f"api:{url}@rambler", "--limit", "3", "--store", str(tmp_path))
    (judge,) = report["judges"]
    # both orders of all 3 pairs fail (asked again once each): every pair undecided, half a point each
    assert judge["parse_failures"] == 6 and judge["undecided"] == 3 and judge["agreement"] == 0.5
    assert judge["position_pairs"] == 0 and judge["position_bias"] is None  # NaN -> null in the JSON


def test_cli_refuses_bad_judge_arguments_in_one_line(tmp_path, monkeypatch):
    runner = CliRunner()
    for args, message in [
        ([str(GPT4), str(GPT4), "--judge", "coin"], "exactly one annotations FILE"),
        (["--oracle", "--judge", "coin"], "exactly one annotations FILE"),
        ([str(GPT4), "--judge", "gpt-4"], "expected hf:MODEL"),
        ([str(tmp_path / "missing.json"), "--judge", "coin"], "no such file"),
    ]:
        result = runner.invoke(app, ["eval", "annotators", *args])
        assert result.exit_code == 2 and message in result.output, result.output
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    result = runner.invoke(app, ["eval", "annotators", str(GPT4), "--judge", "api:http://127.0.0.1:9/v1@m"])
    assert result.exit_code == 2 and "set OPENAI_API_KEY" in result.output and "Traceback" not in result.output


def test_cli_baselines_alone(tmp_path):
    report = run_cli(str(GPT4), "--judge", "coin", "--limit", "40", "--store", str(tmp_path))
    assert report["judges"] == [] and [b["judge"] for b in report["baselines"]] == ["longer", "coin"]
    assert report["pairs"] == 40 and report["skipped_ties"] + report["skipped_invalid"] == report["rows_read"] - 40


def test_leaderboards_state_their_judges_measured_agreement():
    from farmflow.evaluation.leaderboard import judge_quality, leaderboard_markdown

    row = {
        "method": "sft",
        "win_rate": 49.3,
        "standard_error": 0.7,
        "avg_length": 99,
        "n": 8,
        "annotator": "hf judge smollm2-135m-instruct",
        "reference": "reference outputs of data 1234",
    }
    md = leaderboard_markdown([row])
    assert "Annotator: hf judge smollm2-135m-instruct; reference: reference outputs of data 1234." in md
    assert "The judge agrees with GPT-4 on 54.0% (95% CI 47.1-60.8) of 200 AlpacaEval pairs" in md and "plumbing" in md
    assert judge_quality("hf judge /models/my-judge, noise 0.5") == (
        "agreement with human or GPT-4 labels not measured: farmflow eval annotators --judge hf:/models/my-judge FILE"
    )
    assert judge_quality("p_sim_eval") is None and judge_quality("oracle pool (5)") is None
    assert "The judge" not in leaderboard_markdown([row | {"annotator": "p_sim_eval"}])


def test_an_api_judge_takes_request_limits_for_a_slow_server():
    from farmflow.evaluation.judge_quality import parse_judge

    spec = parse_judge("api:http://127.0.0.1:8000/v1@my-model?max_in_flight=2&timeout_s=300&temperature=0.7")
    assert spec.pool == {"max_in_flight": "2", "timeout_s": "300"} and spec.options == {"temperature": "0.7"}
    assert spec.api_annotator().temperature == 0.7
    with pytest.raises(ValueError, match="max_in_flight"):
        parse_judge("api:http://127.0.0.1:8000/v1@my-model?max_in_flight=0")
