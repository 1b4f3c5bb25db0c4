"""Per-step training metrics: the recorder's numbers, the store's table and view, resumes, curves, Prefect artifacts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from rl_helpers import micro_artifacts
from typer.testing import CliRunner

from farmflow import curves, training_metrics
from farmflow.config import load_config
from farmflow.models.checkpoint import Checkpointer
from farmflow.storage import open_store
from farmflow.storage.sql import connect
from farmflow.training_metrics import Pairs, Recorder, recording, reward_quantiles


# ------------------------------------------------------------------ the recorder's numbers
def test_recorder_rows_count_tokens_and_take_method_figures():
    rec = Recorder("sft")
    rec.log(1, epoch=0.5, loss=torch.tensor(2.0), lr=1e-3, grad_norm=torch.tensor(3.0), tokens=100, margin=0.25)
    rec.log(2, epoch=1.0, loss=1.5, tokens=50, margin=float("nan"))
    rec.log(2, split="val", accuracy=0.75)
    t = rec.table()
    assert t.column_names[:9] == [n for n, _ in training_metrics.FIXED]
    assert t.column_names[9:] == ["accuracy", "margin"]  # the method's figures, by name
    rows = t.to_pylist()
    assert [r["tokens"] for r in rows] == [100, 150, None]  # tokens seen so far (train rows)
    assert rows[0]["loss"] == 2.0 and rows[0]["grad_norm"] == 3.0 and rows[0]["lr"] == 1e-3
    assert rows[1]["margin"] is None  # not a number: no value
    assert rows[2]["split"] == "val" and rows[2]["accuracy"] == 0.75 and rows[2]["loss"] is None
    assert rows[0]["wall_s"] <= rows[1]["wall_s"]
    assert rows[1]["tokens_per_s"] > 0


def test_a_measurement_between_steps_is_left_out_of_the_next_steps_rate(monkeypatch):
    clock = iter([0.0, 1.0, 5.0, 6.0])  # start, step 1 after 1 s, a val row after a 4 s measurement, step 2 1 s later
    monkeypatch.setattr(training_metrics.time, "perf_counter", lambda: next(clock))
    rec = Recorder("reward")
    rec.log(1, tokens=100)
    rec.log(1, split="val", heldout_accuracy=0.5)
    rec.log(2, tokens=100)
    rows = rec.table().to_pylist()
    assert [r["tokens_per_s"] for r in rows] == [100.0, None, 100.0]
    assert [r["wall_s"] for r in rows] == [1.0, 5.0, 6.0]  # the measurement's time is in the wall time


def test_pair_figures_are_accuracy_margin_and_means():
    pairs = Pairs()
    # preference 2: output_2 chosen; 1: output_1 chosen; 1.5: a tie, left out
    pairs.add_preferred(torch.tensor([1.0, 0.0, 5.0]), torch.tensor([3.0, 1.0, 0.0]), torch.tensor([2.0, 1.0, 1.5]))
    figs = pairs.figures()
    # chosen: 3 (pair 1), 0 (pair 2); rejected: 1, 1 → accuracy 1/2, margin (2 - 1) / 2
    assert figs == {"accuracy": 0.5, "margin": 0.5, "chosen_reward": 1.5, "rejected_reward": 1.0}
    assert pairs.figures() == {}  # the next step starts empty


def test_reward_quantiles_are_bin_means():
    assert reward_quantiles([8, 1, 2, 7, 3, 6, 4, 5], 4) == {
        "reward_q1": 1.5,
        "reward_q2": 3.5,
        "reward_q3": 5.5,
        "reward_q4": 7.5,
    }


def test_resume_keeps_the_rows_up_to_the_checkpoint_and_the_wall_time():
    rec = Recorder("dpo")
    for step in (1, 2, 3):
        rec.log(step, loss=float(step), tokens=10)
    state = rec.state()
    later = Recorder("dpo")
    later.resume(2, state)  # the checkpoint was at step 2; row 3 was logged after it
    later.log(3, loss=30.0, tokens=10)
    rows = later.table().to_pylist()
    assert [(r["step"], r["loss"], r["tokens"]) for r in rows] == [(1, 1.0, 10), (2, 2.0, 20), (3, 30.0, 40)]
    assert rows[2]["wall_s"] >= rows[1]["wall_s"]


def test_dpo_counts_the_tokens_its_forwards_read():
    """A step reads <s> prompt chosen </s> and <s> prompt rejected </s> of its pairs: with one batch of all pairs,
    each step counts those 2 × 8 sequences' tokens, here counted from the tokenizer alone."""
    from test_models import CFG, PROMPTS, RESPONSES

    from farmflow.config import DPOConfig
    from farmflow.methods import dpo
    from farmflow.models import build_policy, train_tokenizer

    tok = train_tokenizer(PROMPTS + RESPONSES, vocab_size=384)
    torch.manual_seed(0)
    model, ref = build_policy(CFG, tok), build_policy(CFG, tok)
    prompts, out_1, out_2 = PROMPTS[:8], RESPONSES[:8], RESPONSES[8:16]
    ref_1, ref_2 = dpo.reference_logps(ref, tok, prompts, out_1, out_2, 128)
    cfg = DPOConfig(epochs=2, batch_size=8)
    with recording("dpo", "k" * 16) as rec:
        dpo.train_dpo(model, tok, prompts, out_1, out_2, [1.0, 2.0] * 4, ref_1, ref_2, cfg, 128)
    lengths = [
        2 + len(tok(p, add_special_tokens=False)["input_ids"]) + len(tok(o, add_special_tokens=False)["input_ids"])
        for p, o in zip(prompts * 2, out_1 + out_2, strict=True)
    ]
    assert max(lengths) < 128  # nothing cut
    rows = rec.table().to_pylist()
    assert [r["tokens"] for r in rows] == [sum(lengths), 2 * sum(lengths)]


# ------------------------------------------------------------------ stages
@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    """The micro farm's data, SFT and reward model, and PPO and DPO on them (real stage tasks)."""
    from farmflow import tasks
    from farmflow.tasks import rl

    art = micro_artifacts(tmp_path_factory.mktemp("metrics") / "store")
    cfg, uri = art["cfg"], art["uri"]
    prefs = open_store(uri).get("annotate", open_store(uri).record(art["reward"])["inputs"]["preferences"])
    ref_logps = tasks.reference_logps_task.fn(uri, {}, prefs, art["sft"])
    art["dpo"] = tasks.dpo_task.fn(uri, cfg.dpo, prefs, art["sft"], ref_logps)
    art["ppo"] = rl.ppo_task.fn(uri, cfg.ppo, art["data"], art["sft"], art["reward"])
    return art


def test_every_trained_stage_writes_its_table_and_the_view_unites_them(farm):
    store = open_store(farm["uri"])
    con = connect(store)
    counts = dict(con.sql("select stage, count(*) from training_metrics where split = 'train' group by 1").fetchall())
    for stage in ("sft", "train_reward", "dpo", "ppo"):
        assert counts[stage] == farm[{"train_reward": "reward"}.get(stage, stage)].metrics["steps"]
        assert farm[{"train_reward": "reward"}.get(stage, stage)].metrics["logged_steps"] >= counts[stage]
    sft = con.sql("select step, loss, grad_norm, lr, tokens from training_metrics where stage='sft' order by step")
    rows = sft.fetchall()
    assert [r[0] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[0][1] == pytest.approx(farm["sft"].metrics["train_loss_first"])
    assert rows[-1][4] == farm["sft"].metrics["train_tokens"]
    assert all(r[2] > 0 and r[3] > 0 for r in rows)
    ppo = con.sql(
        "select reward, kl, policy_loss, value_loss, entropy, clipfrac, approx_kl, grad_norm, tokens_per_s "
        "from training_metrics where stage='ppo' order by step"
    ).fetchall()
    assert ppo[0][0] == pytest.approx(farm["ppo"].metrics["reward_first"])
    assert all(v is not None for r in ppo for v in r)
    dpo = con.sql("select accuracy, margin, chosen_reward - rejected_reward from training_metrics where stage='dpo'")
    for acc, margin, diff in dpo.fetchall():
        assert 0 <= acc <= 1 and margin == pytest.approx(diff, rel=1e-4)
    val = con.sql("select heldout_accuracy from training_metrics where stage='train_reward' and split='val'")
    assert val.fetchall() == [(farm["reward"].metrics["heldout_accuracy"],)]


def test_a_reward_model_selected_on_val_is_its_best_measurement(farm):
    """select='best_val': the stage measures every eval_every steps and after the last, logs each measurement, and
    its artifact's held-out accuracy is the best of them, from the first step that reached it; the committed weights,
    scored again, give that accuracy."""
    from farmflow import tasks
    from farmflow.tasks.keys import key_config

    store, cfg = open_store(farm["uri"]), farm["cfg"]
    prefs = store.record(farm["reward"])["inputs"]["preferences"]
    chosen = cfg.reward.model_copy(update={"epochs": 2.0, "lr": 1e-2, "eval_every": 2, "select": "best_val"})
    ref = tasks.train_reward_task.fn(farm["uri"], chosen, store.get("annotate", prefs), farm["sft"])
    assert ref.key != farm["reward"].key
    # at their defaults the two options stay out of the key (test_stage_keys pins the default keys)
    assert {"eval_every", "select"} & set(key_config(cfg.reward)) == set()
    assert key_config(chosen)["select"] == "best_val" and key_config(chosen)["eval_every"] == 2
    query = f"select step, heldout_accuracy from training_metrics where key = '{ref.key}' and split = 'val' order by 1"
    val = connect(store).sql(query).fetchall()
    steps = int(ref.metrics["steps"])
    assert steps == 16 and [s for s, _ in val] == list(range(2, 17, 2))
    best = max(a for _, a in val)
    assert val[-1][1] < best and sum(a == best for _, a in val) > 1  # neither the last nor the latest best is kept
    assert ref.metrics["heldout_accuracy"] == best
    from farmflow.data import prompts_of, split_rows
    from farmflow.models import load_reward, score

    held = split_rows(store.read_table(store.get("annotate", prefs)), "val")
    model, tok = load_reward(store.model_dir(ref))
    rescored = [score(model, tok, prompts_of(held), [r[k] for r in held]).tolist() for k in ("output_1", "output_2")]
    assert tasks.heldout_accuracies(held, *rescored)["heldout_accuracy"] == pytest.approx(best, abs=1e-9)
    assert ref.metrics["selected_step"] == next(s for s, a in val if a == best)
    summary = tasks.reward_model_summary(ref.metrics)  # what the flows' summaries show of it
    assert set(summary) == {"heldout_accuracy", "heldout_accuracy_unnoised", "heldout_gold_accuracy", "selected_step"}
    assert "selected_step" not in tasks.reward_model_summary(farm["reward"].metrics)


def test_plot_curves_writes_a_png_with_ppo_reward_and_kl(farm, tmp_path):
    from matplotlib.image import imread

    from farmflow.cli import app

    out = tmp_path / "ppo.png"
    res = CliRunner().invoke(
        app, ["plot", "curves", "ppo", farm["ppo"].key[:10], "-o", str(out), "--store", farm["uri"]]
    )
    assert res.exit_code == 0, res.output
    assert imread(out).shape[2] in (3, 4)
    table = training_metrics.read(open_store(farm["uri"]), farm["ppo"])
    assert curves.panels([("ppo", table)])[:3] == ["reward", "kl", "value_loss"]
    every = tmp_path / "all.png"
    res = CliRunner().invoke(app, ["plot", "curves", "-o", str(every), "-m", "loss", "--store", farm["uri"]])
    assert res.exit_code == 0 and "sft" in res.output and "dpo" in res.output, res.output
    res = CliRunner().invoke(app, ["plot", "curves", "quark", "--store", farm["uri"], "-o", str(every)])
    assert res.exit_code != 0 and "no quark artifact" in res.output


def test_plot_curves_of_a_run_draws_the_stages_upstream_of_its_evaluations(farm, tmp_path):
    """A run's training stages: the inputs of its evaluations, followed upstream (ppo ← sft, reward ← sft)."""
    from datetime import datetime, timezone

    import pyarrow as pa

    from farmflow.cli import app
    from farmflow.storage.schemas import SCHEMAS

    store = open_store(farm["uri"])
    row = {"id": "x", "instruction": "i", "input": "", "output_1": "a", "output_2": "b", "generator": "ppo"}
    table = pa.Table.from_pylist([row], schema=SCHEMAS["evaluation"])
    ev = store.put_table("evaluate", "e" * 32, table, "evaluation", inputs={"outputs": farm["ppo"]})
    run = {"run_id": "feedbeef", "flow_run_id": "f", "run_at": datetime.now(timezone.utc), "method": "ppo"}
    store.append_rows("runs", pa.Table.from_pylist([run | {"evaluation_key": ev.key}], schema=SCHEMAS["runs"]), "runs")
    out = tmp_path / "run.png"
    res = CliRunner().invoke(app, ["plot", "curves", "--run", "feed", "-o", str(out), "--store", farm["uri"]])
    assert res.exit_code == 0 and out.exists(), res.output
    assert res.output.strip().endswith("(sft, train_reward, ppo)")  # not dpo: no evaluation of this run needs it


def test_a_resumed_sft_has_every_step_once(tmp_path):
    """A run that resumes from the checkpoint before its last step ends with the uninterrupted run's rows."""
    from farmflow import tasks
    from farmflow.data import prompts_of
    from farmflow.methods import sft
    from farmflow.models import load_policy

    cfg = load_config("synthetic-micro", [f"store.uri={tmp_path / 'store'}"])
    uri = cfg.store.uri
    data = tasks.data_task.fn(uri, cfg.data)
    base = tasks.base_model_task.fn(uri, cfg.model, data)
    store = open_store(uri)
    rows = [r for r in store.read_table(data).to_pylist() if r["split"] == "sft"]
    args = (prompts_of(rows), [r["output"] for r in rows], cfg.sft, cfg.model.max_seq_len)

    def train() -> list[dict]:
        model, tok = load_policy(store.model_dir(base))
        with recording("sft", "k") as rec:
            sft.train_sft(model, tok, *args, Checkpointer(store, "sft", "k", every_steps=1))
        return rec.table().to_pylist()

    whole = train()
    folders = sorted((Path(store.root) / "_checkpoints" / "sft" / "k").glob("step-*"))
    shutil.rmtree(folders[-1])  # the last step's checkpoint is gone: the rerun resumes one step before the end
    resumed = train()
    assert [r["step"] for r in resumed] == [r["step"] for r in whole] == list(range(1, len(whole) + 1))
    assert [r["loss"] for r in resumed[:-1]] == [r["loss"] for r in whole[:-1]]  # kept from the checkpoint
    assert resumed[-1]["loss"] == pytest.approx(whole[-1]["loss"], rel=1e-5)
    assert resumed[-1]["tokens"] == whole[-1]["tokens"]


def test_a_stage_in_a_flow_publishes_its_curves_as_prefect_artifacts(farm, prefect_harness):
    """The markdown artifact embeds the PNG; the table artifact holds the summary."""
    import asyncio

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    @flow
    def publish_ppo():
        assert curves.publish(farm["uri"], farm["ppo"])
        assert not curves.publish(farm["uri"], farm["data"])  # a table stage has no curves

    publish_ppo()

    async def read():
        async with get_client() as client:
            return await client.read_artifacts(
                artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=["ppo-curves", "ppo-summary"]))
            )

    found = {a.key: a for a in asyncio.run(read())}
    assert "data:image/png;base64,iVBOR" in found["ppo-curves"].data  # a PNG's first bytes, base64
    assert "| reward |" in found["ppo-curves"].data
    summary = found["ppo-summary"].data
    assert {"reward", "kl"} <= {r["figure"] for r in (json.loads(summary) if isinstance(summary, str) else summary)}
    assert not curves.publish(farm["uri"], farm["ppo"])  # outside a flow run: nothing
