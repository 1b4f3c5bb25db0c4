"""Over-optimization curves: plain functions, and the flow on synthetic-micro with a real Prefect API."""

from __future__ import annotations

import math

import matplotlib.image as mpimg
import numpy as np
import pyarrow.parquet as pq
import pytest

from farmflow.config import AnnotatorConfig
from farmflow.evaluation.overopt import GREEDY_ORACLE, curve_markdown, curve_rows, plot_curves
from farmflow.storage.schemas import SCHEMAS


def _metrics(wr, gold):
    return {
        "win_rate": wr,
        "standard_error": 2.0,
        "lc_win_rate": wr - 1,
        "mean_gold": gold,
        "avg_length": 30,
        "n_total": 100,
    }


POINTS = [
    {
        "label": f"best_of_{n}",
        "labeller": "p_sim^ann",
        "family": "best_of_n",
        "pressure": n,
        "outputs_key": f"o{n}",
        "proxy_reward": r,
        "evaluations": {
            "p_sim^ann": {"key": f"a{n}", "metrics": _metrics(wa, g)},
            "greedy": {"key": f"g{n}", "metrics": _metrics(wg, g)},
        },
    }
    for n, r, wa, wg, g in [(4, 0.9, 52.0, 60.0, 0.62), (1, 0.2, 50.0, 50.0, 0.55), (16, 1.6, 51.0, 55.0, 0.58)]
] + [
    {
        "label": "ppo step 100",
        "labeller": "p_sim^ann",
        "family": "ppo",
        "pressure": 100,
        "outputs_key": "p",
        "proxy_reward": 1.1,
        "evaluations": {"p_sim^ann": {"key": "pa", "metrics": _metrics(53.0, 0.6)}},
    },
    # a second curve: a reward model trained on the greedy annotator's labels, judged by it
    {
        "label": "best_of_2",
        "labeller": "greedy",
        "family": "best_of_n",
        "pressure": 2,
        "outputs_key": "q2",
        "proxy_reward": 0.4,
        "evaluations": {"greedy": {"key": "q2g", "metrics": _metrics(57.0, 0.61)}},
    },
]


def test_curve_rows_sorted_by_labeller_family_and_pressure():
    rows = curve_rows(POINTS)
    assert len(rows) == 8  # 3 best-of-n points × 2 annotators + 1 PPO point × 1, and the greedy labeller's point
    assert [(r["labeller"], r["label"], r["annotator"]) for r in rows[:3]] == [
        ("greedy", "best_of_2", "greedy"),
        ("p_sim^ann", "best_of_1", "greedy"),
        ("p_sim^ann", "best_of_1", "p_sim^ann"),
    ]
    assert [(r["family"], r["pressure"]) for r in rows[1::2][:3]] == [
        ("best_of_n", 1.0),
        ("best_of_n", 4.0),
        ("best_of_n", 16.0),
    ]
    assert rows[-1]["label"] == "ppo step 100"
    assert set(rows[0]) == set(SCHEMAS["overoptimization"].names)
    md = curve_markdown(rows, "T")
    assert (
        "| labeller | point | pressure | proxy reward | mean gold | avg length | win rate (greedy) "
        "| win rate (p_sim^ann) |" in md
    )
    assert "| greedy | best_of_2 | 2 | 0.400 | 0.610 | 30 | 57.0 ± 2.0 | — |" in md
    assert "| p_sim^ann | best_of_4 | 4 | 0.900 | 0.620 | 30 | 60.0 ± 2.0 | 52.0 ± 2.0 |" in md
    assert "| p_sim^ann | ppo step 100 | 100 | 1.100 | 0.600 | 30 | — | 53.0 ± 2.0 |" in md


def test_curve_plot_is_a_real_png(tmp_path):
    path = tmp_path / "curve.png"
    plot_curves(curve_rows(POINTS), str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(str(path))
    assert img.shape[0] > 300 and img.shape[1] > 800 and img[..., :3].std() > 0.05
    # one colour per labeller: matplotlib's C0 (greedy, first in the sorted rows) and C1 (p_sim^ann) lines are both
    # drawn
    rgb = img[..., :3]
    for colour in ((0x1F, 0x77, 0xB4), (0xFF, 0x7F, 0x0E)):
        assert (abs(rgb - np.array(colour) / 255).max(axis=-1) < 0.02).sum() > 50
    with pytest.raises(ValueError):
        plot_curves([], str(path))


def test_greedy_oracle_decides_gold_deterministically_and_equal_gold_by_a_length_biased_coin():
    import math
    import random

    from farmflow.annotators import annotate_pairs
    from farmflow.data.synthetic import correct_output, sample_task, task_to_json

    assert (
        isinstance(GREEDY_ORACLE, AnnotatorConfig) and len(GREEDY_ORACLE.pool) == 1 and GREEDY_ORACLE.label_noise == 0
    )
    rng = random.Random(0)
    tasks = [sample_task("sort", rng) for _ in range(400)]

    def pairs(out_1, out_2):
        return [
            {"id": str(i), "instruction": t.instruction, "input": t.input, "task": task_to_json(t)}
            | {"output_1": out_1(t), "output_2": out_2(t)}
            for i, t in enumerate(tasks)
        ]

    def prefs(rows, seed):
        return annotate_pairs(rows, GREEDY_ORACLE.model_copy(update={"seed": seed})).column("preference").to_pylist()

    # the better output (gold 1 vs 0) always wins, whatever order it is shown in or seed is used
    better = pairs(lambda t: "no idea", correct_output)[:6]
    for seed in (0, 1, 2):
        assert prefs(better, seed) == [2.0] * 6
    # equal gold (both 0), 7 characters apart: the longer wins with p = sigmoid(10·tanh(7/40)) = 0.850, drawn per pair
    near = pairs(lambda t: "no idea", lambda t: "no idea at all")
    p_longer = 1 / (1 + math.exp(-10 * math.tanh(7 / 40)))
    rates = [prefs(near, seed).count(2.0) / len(near) for seed in (0, 1)]
    assert all(abs(rate - p_longer) < 0.06 for rate in rates), (rates, p_longer)
    assert prefs(near, 0) != prefs(near, 1)
    # 200 characters apart the coin is all but fixed: sigmoid(10·tanh(5)) = 0.99995
    far = pairs(lambda t: "no idea", lambda t: "no idea " + "x" * 200)
    assert prefs(far, 0) == [2.0] * len(far)


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_overoptimization_flow_micro(micro_config):
    """Both ways (paper Fig. 5): each labeller's preferences train its own reward model, its curve is judged by it."""
    from farmflow import tasks
    from farmflow.flows.overoptimization import overoptimization_flow
    from farmflow.storage import open_store

    tasks.EXECUTED.clear()
    summary = overoptimization_flow(advanced=micro_config, ns=[1, 2, 4])
    rows = summary["curve"]
    assert [(r["labeller"], r["label"], r["annotator"]) for r in rows] == [
        (lab, f"best_of_{n}", lab) for lab in ("greedy", "p_sim^ann") for n in (1, 2, 4)
    ]
    for r in rows:
        assert 0 <= r["win_rate"] <= 100 and 0 <= r["mean_gold"] <= 1 and r["n"] == micro_config.data.eval_size
        assert math.isfinite(r["proxy_reward"])
    # the proxy reward grows with n: best-of-n's candidates nest (best-of-2's are the first two of
    # best-of-4's, and the flow takes them from best-of-4's scored candidates), so each reward
    # model's favourite of more samples scores at least as high, exactly
    for lab in ("greedy", "p_sim^ann"):
        proxy = [r["proxy_reward"] for r in rows if r["labeller"] == lab]
        assert proxy[0] <= proxy[1] <= proxy[2] and proxy[0] < proxy[2], (lab, proxy)
    # best-of-1 is the same SFT sample whichever reward model ranks it: same gold, scored by two different models
    assert rows[0]["mean_gold"] == rows[3]["mean_gold"] and rows[0]["proxy_reward"] != rows[3]["proxy_reward"]

    # two reward models from the same pairs and SFT model, trained on different preference tables
    models = summary["reward_models"]
    assert set(models) == {"greedy", "p_sim^ann"}
    assert models["greedy"]["reward_model"] != models["p_sim^ann"]["reward_model"]
    assert models["greedy"]["preferences"] != models["p_sim^ann"]["preferences"]
    store = open_store(micro_config.store.location)
    prefs = {lab: store.read_table(store.get("annotate", m["preferences"])) for lab, m in models.items()}
    assert prefs["greedy"].column("id").to_pylist() == prefs["p_sim^ann"].column("id").to_pylist()  # the same pairs
    greedy, noisy = (prefs[lab].column("preference").to_pylist() for lab in ("greedy", "p_sim^ann"))
    assert greedy != noisy
    assert sum(prefs["greedy"].column("noised").to_pylist()) == 0 < sum(prefs["p_sim^ann"].column("noised").to_pylist())
    # the greedy labeller prefers the higher-gold output whenever gold differs by more than its length bias can outweigh
    clear = [r for r in prefs["greedy"].to_pylist() if abs(r["gold_2"] - r["gold_1"]) > 0.03]
    assert clear and all((r["preference"] > 1.5) == (r["gold_2"] > r["gold_1"]) for r in clear)

    assert tasks.EXECUTED["sft"] == 1 and tasks.EXECUTED["sample_pairs"] == 1
    assert tasks.EXECUTED["annotate"] == 2 and tasks.EXECUTED["train_reward"] == 2
    # best-of-4 sampled once (p_sim^ann's), rescored by greedy's reward model; best-of-1 and -2 are prefixes
    assert (
        tasks.EXECUTED["best_of_n"] == 1
        and tasks.EXECUTED["best_of_n_rescore"] == 1
        and tasks.EXECUTED["best_of_n_prefix"] == 4
    )
    assert tasks.EXECUTED["proxy_reward"] == 6 and tasks.EXECUTED["evaluate"] == 6
    folder = summary["artifact"]
    assert pq.read_table(f"{folder}/data.parquet").num_rows == 6
    md = open(f"{folder}/curve.md").read()
    assert "| greedy | best_of_4 |" in md and "| p_sim^ann | best_of_4 |" in md
    img = mpimg.imread(f"{folder}/curve.png")
    assert open(f"{folder}/curve.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n" and img[..., :3].std() > 0.05

    # a prefix is exactly what sampling best-of-2 directly gives (same outputs, same rewards)
    from farmflow.tasks import best_of_n_task

    reward_ann = store.get("train_reward", models["p_sim^ann"]["reward_model"])
    prefix = next(
        r
        for r in store.list()
        if r.stage == "best_of_n_prefix"
        and store.record(r)["config"] == {"n": 2}
        and store.record(r)["inputs"]["reward"] == reward_ann.key
    )
    bon4_rec = store.record(store.get("best_of_n", store.record(prefix)["inputs"]["best_of_n"]))
    direct_cfg = {**bon4_rec["config"], "best_of_n": {**bon4_rec["config"]["best_of_n"], "n": 2}}
    data_ref, sft_ref = store.get("data", bon4_rec["inputs"]["data"]), store.get("sft", bon4_rec["inputs"]["policy"])
    direct = best_of_n_task.fn(
        micro_config.store.location, direct_cfg, data=data_ref, policy=sft_ref, reward=reward_ann, batch_size=5
    )
    got, want = store.read_table(prefix).to_pylist(), store.read_table(direct).to_pylist()
    assert [r["output"] for r in got] == [r["output"] for r in want]
    assert [r["score"] for r in got] == pytest.approx([r["score"] for r in want], abs=1e-5)
    # greedy's rescored best-of-4 is what sampling best-of-4 directly with its reward model gives
    reward_greedy = store.get("train_reward", models["greedy"]["reward_model"])
    rescored = next(r for r in store.list() if r.stage == "best_of_n_rescore")
    assert store.record(rescored)["inputs"]["reward"] == reward_greedy.key
    direct4 = best_of_n_task.fn(
        micro_config.store.location,
        bon4_rec["config"],
        data=data_ref,
        policy=sft_ref,
        reward=reward_greedy,
        batch_size=7,
    )
    assert (
        store.read_table(rescored).column("output").to_pylist()
        == store.read_table(direct4).column("output").to_pylist()
    )
    assert store.read_table(rescored, "candidates.parquet", "candidates").column("reward").to_pylist() == pytest.approx(
        store.read_table(direct4, "candidates.parquet", "candidates").column("reward").to_pylist(), abs=1e-5
    )
    cands = store.read_table(direct, "candidates.parquet", "candidates")
    assert cands.num_rows == 2 * len(want) and cands.column("sample").to_pylist()[:4] == [0, 1, 0, 1]
    from farmflow.tasks import best_of_n_prefix_task

    with pytest.raises(ValueError, match="must be between 1 and the artifact's n=2"):
        best_of_n_prefix_task.fn(micro_config.store.location, {"n": 3}, best_of_n=direct, reward=reward_ann)
    with pytest.raises(ValueError, match="was scored by reward model"):
        best_of_n_prefix_task.fn(
            micro_config.store.location,
            {"n": 1},
            best_of_n=direct,
            reward=store.get("train_reward", models["greedy"]["reward_model"]),
        )

    # a rerun is fully cached
    tasks.EXECUTED.clear()
    again = overoptimization_flow(advanced=micro_config, ns=[1, 2, 4])
    assert dict(tasks.EXECUTED) == {} and again["curve"] == rows

    # an extra point (how more checkpoints come in): outputs without scores are scored by the
    # reward model, and the scores agree with the ones best-of-n computed for the same outputs
    from farmflow.evaluation.overopt import CurvePoint
    from farmflow.tasks.analysis import proxy_reward_task

    reward = store.get("train_reward", models["p_sim^ann"]["reward_model"])
    bon4 = next(
        r
        for r in store.list()
        if r.stage == "best_of_n"
        and store.record(r)["config"]["best_of_n"]["n"] == 4
        and store.record(r)["inputs"]["reward"] == reward.key
    )
    unscored = store.read_table(bon4).to_pylist()
    import pyarrow as pa

    ref = store.put_table(
        "generate",
        "unscored-bon4",
        pa.Table.from_pylist([r | {"score": None, "generator": "ppo"} for r in unscored], schema=SCHEMAS["outputs"]),
        "outputs",
    )
    scored = proxy_reward_task.fn(micro_config.store.location, {}, outputs=ref, reward=reward, batch_size=8)
    again_scores = store.read_table(scored).column("score").to_pylist()
    assert again_scores == pytest.approx([r["score"] for r in unscored], abs=1e-4)

    # the single-reward-model curve judged by two annotators: p_sim^ann's best-of-n points are cached,
    # only their greedy evaluations and the extra point's are new. The extra point's proxy reward is
    # the one scored above: batch size is not part of its key, so the flow reuses it.
    tasks.EXECUTED.clear()
    extra = overoptimization_flow(
        advanced=micro_config,
        ns=[1, 2, 4],
        labellers=["p_sim^ann"],
        annotators=["p_sim^ann", "greedy"],
        extra_points=[CurvePoint(label="ppo step 0", family="ppo", pressure=0, outputs=ref)],
    )
    assert {r["labeller"] for r in extra["curve"]} == {"p_sim^ann"} and len(extra["curve"]) == 8
    assert [r["label"] for r in extra["curve"]][-2:] == ["ppo step 0", "ppo step 0"]
    bon4_row = next(r for r in rows if r["labeller"] == "p_sim^ann" and r["label"] == "best_of_4")
    assert extra["curve"][-1]["proxy_reward"] == pytest.approx(bon4_row["proxy_reward"], abs=1e-4)
    assert dict(tasks.EXECUTED) == {"evaluate": 5, "overoptimization": 1}

    with pytest.raises(ValueError, match="unknown annotator"):
        overoptimization_flow(advanced=micro_config, ns=[1], labellers=["gpt5"])


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_overoptimization_flow_with_ppo_snapshots(micro_config):
    """PPO's curve against the greedy labeller's reward model: one point per committed snapshot (every 2 steps) plus
    step 0 = SFT."""
    from farmflow.flows.overoptimization import overoptimization_flow

    summary = overoptimization_flow(advanced=micro_config, ns=[1], labellers=["greedy"], ppo_every=2)
    ppo = [r for r in summary["curve"] if r["family"] == "ppo"]
    assert {(r["labeller"], r["annotator"]) for r in summary["curve"]} == {("greedy", "greedy")}
    steps = [r["pressure"] for r in ppo]
    cfg = micro_config.ppo
    total = math.floor(cfg.epochs * micro_config.data.unlabeled_size / cfg.rollout_batch_size)  # 240 / 48 = 5 steps
    assert steps == [0] + list(range(2, total + 1, 2))
    assert all(math.isfinite(r["proxy_reward"]) and 0 <= r["mean_gold"] <= 1 for r in ppo)
    assert "| greedy | ppo_step_2 |" in summary["markdown"]


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_ppo_curve_reuses_the_comparisons_ppo_run(micro_config):
    """The ppo flow's run has no snapshots; the curve's PPO (same reward model) is the same artifact, trained again once
    for its snapshots (Prefect's cached result is refreshed), then a hit."""
    from farmflow import tasks
    from farmflow.flows import FLOWS
    from farmflow.flows.overoptimization import overoptimization_flow

    tasks.EXECUTED.clear()
    compared = FLOWS["ppo"](advanced=micro_config)
    ppo_key = next(s["key"] for s in compared["stages"] if s["stage"] == "ppo")
    assert tasks.EXECUTED["ppo"] == 1
    summary = overoptimization_flow(advanced=micro_config, ns=[1], labellers=["p_sim^ann"], ppo_every=2)
    assert tasks.EXECUTED["ppo"] == 2 and [s["key"] for s in summary["stages"] if s["stage"].startswith("ppo")] == [
        ppo_key
    ]
    assert [r["pressure"] for r in summary["curve"] if r["family"] == "ppo"] == [0, 2, 4]
    overoptimization_flow(advanced=micro_config, ns=[1], labellers=["p_sim^ann"], ppo_every=2)
    assert tasks.EXECUTED["ppo"] == 2


def test_annotator_labels_accept_the_preset_spelling(micro_config):
    from farmflow.flows.overoptimization import evaluating_annotators

    chosen = evaluating_annotators(micro_config, ["p_sim_ann", "greedy", "p_sim_eval"])
    assert list(chosen) == ["p_sim^ann", "greedy", "p_sim^eval"]
    assert chosen["p_sim^ann"] == micro_config.annotation and chosen["p_sim^eval"] == micro_config.evaluation.annotator
    with pytest.raises(ValueError, match=r"unknown annotator\(s\) \['p_sim_gpt4'\]"):
        evaluating_annotators(micro_config, ["p_sim_gpt4"])


def test_a_ppo_curve_needs_a_positive_snapshot_interval_before_anything_trains(micro_config, tmp_path):
    from typer.testing import CliRunner

    from farmflow import tasks
    from farmflow.cli import app
    from farmflow.flows.overoptimization import overoptimization_flow

    tasks.EXECUTED.clear()
    with pytest.raises(ValueError, match="ppo_every must be a positive number of PPO steps, got 0"):
        overoptimization_flow.fn(advanced=micro_config, ns=[1], ppo_every=0)
    assert tasks.EXECUTED == {}
    result = CliRunner().invoke(app, ["overopt", "--ppo-every", "0", "--store", str(tmp_path)])
    assert result.exit_code == 2 and "--ppo-every" in result.output
