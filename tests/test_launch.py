"""execution.launcher: GPU stages in a child process (python or accelerate launch), committed by the parent."""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import yaml
from rl_helpers import ddp_config

from farmflow import tasks
from farmflow.config import ExecutionConfig, load_config
from farmflow.models import load_policy
from farmflow.storage import open_store
from farmflow.tasks.core import EXECUTED, launching
from farmflow.tasks.launch import MULTI_PROCESS_STAGES, StageLaunchError, command, find_config

CONFIGS = Path(__file__).resolve().parents[1] / "src" / "farmflow" / "configs" / "accelerate"


@pytest.fixture
def cfg():
    return load_config("synthetic-micro")


def _upstream(uri: str, cfg):
    data = tasks.data_task.fn(uri, cfg.data)
    return data, tasks.base_model_task.fn(uri, cfg.model, data=data)


def _weights(uri: str, ref) -> dict[str, torch.Tensor]:
    return dict(load_policy(open_store(uri).model_dir(ref))[0].named_parameters())


@pytest.mark.slow  # two child processes that import torch, transformers and prefect (~30 s)
def test_process_launcher_commits_the_inline_artifact(tmp_path, cfg, caplog, monkeypatch):
    inline_uri, child_uri = str(tmp_path / "inline"), str(tmp_path / "child")
    data_a, base_a = _upstream(inline_uri, cfg)
    data_b, base_b = _upstream(child_uri, cfg)
    sft = cfg.sft.model_validate(cfg.sft.model_dump() | {"snapshot_epochs": (0.5,)})  # a snapshot after step 4 of 8
    inline = tasks.sft_task.fn(inline_uri, sft, data=data_a, base=base_a)
    runs = EXECUTED["sft"]
    caplog.set_level(logging.INFO, logger="farmflow")
    caplog.clear()  # the inline run's lines, when an earlier test (the CLI) left the farmflow logger at INFO
    monkeypatch.setenv("FARMFLOW_PROGRESS_EVERY_S", "0.000001")  # the child logs a progress line at every step
    with launching(ExecutionConfig(launcher="process")):
        child = tasks.sft_task.fn(child_uri, sft, data=data_b, base=base_b)
    # the child's progress and summary lines are repeated in the parent's log (in a flow: the run's Prefect logs)
    said = [r.getMessage() for r in caplog.records if r.name == "farmflow"]
    assert said[0] == "sft: running in a child process" and said[-1].startswith("sft: child finished in")
    assert any(m.startswith("sft: 4/8 steps (50%)") for m in said) and any(
        m.startswith("sft: 8 steps in") for m in said
    )
    assert any(m.startswith("sft: 8 steps, loss") for m in said)
    with launching(ExecutionConfig(launcher="process")):
        again = tasks.sft_task.fn(child_uri, sft, data=data_b, base=base_b)  # a cache hit starts no child
        pairs_child = tasks.sample_pairs_task.fn(child_uri, cfg.pairs, data=data_b, policy=child)
    assert EXECUTED["sft"] == runs + 1
    assert child.key == inline.key == again.key and child.kind == "model"
    a, b = _weights(inline_uri, inline), _weights(child_uri, child)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the snapshot too: written in the child, committed by the parent
    a, b = (_weights(uri, tasks.sft_snapshot(uri, ref, 0.5)) for uri, ref in ((inline_uri, inline), (child_uri, child)))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    rec_a, rec_b = open_store(inline_uri).record(inline), open_store(child_uri).record(child)
    assert rec_a["config"] == rec_b["config"] and rec_a["inputs"] == rec_b["inputs"]
    assert (
        child.metrics["steps"] == inline.metrics["steps"] == 8
        and child.metrics["train_loss_last"] == inline.metrics["train_loss_last"]
    )
    # a table stage: same rows as inline
    pairs_inline = tasks.sample_pairs_task.fn(inline_uri, cfg.pairs, data=data_a, policy=inline)
    assert pairs_child.key == pairs_inline.key and pairs_child.rows == pairs_inline.rows == 144
    assert open_store(child_uri).read_table(pairs_child).equals(open_store(inline_uri).read_table(pairs_inline))
    assert not list((Path(child_uri) / ".staging").iterdir())  # the child's scratch folder is gone


def test_a_crashing_child_is_one_clear_error(tmp_path, cfg):
    uri = str(tmp_path / "store")
    data, base = _upstream(uri, cfg)
    config = open_store(uri).model_dir(base) / "config.json"
    config.write_bytes(b"x" * len(config.read_bytes()))  # same size, not JSON: the child cannot load the base model
    with launching(ExecutionConfig(launcher="process")), pytest.raises(StageLaunchError) as err:
        tasks.sft_task.fn(uri, cfg.sft, data=data, base=base)
    message = str(err.value)
    assert message.startswith("stage sft: a child process exited with code 1; the last lines of its log:")
    assert "Traceback" in message and "Error" in message.splitlines()[-1]
    assert err.value.__cause__ is None and err.value.__context__ is None
    assert [r.stage for r in open_store(uri).list()] == ["data", "base_model"]  # nothing committed
    assert not list((Path(uri) / ".staging").iterdir())


def test_a_child_whose_interpreter_aborts_at_exit_still_reports_the_stages_own_code(tmp_path, cfg, monkeypatch):
    """A native library's teardown can abort the child (SIGABRT) after the stage ended; the child leaves before it."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import atexit, os\natexit.register(os.abort)\n")
    monkeypatch.setenv("PYTHONPATH", f"{site}:{os.environ.get('PYTHONPATH', '')}")
    uri = str(tmp_path / "store")
    data, base = _upstream(uri, cfg)
    config = open_store(uri).model_dir(base) / "config.json"
    config.write_bytes(b"x" * len(config.read_bytes()))
    with launching(ExecutionConfig(launcher="process")), pytest.raises(StageLaunchError) as err:
        tasks.sft_task.fn(uri, cfg.sft, data=data, base=base)
    assert str(err.value).startswith("stage sft: a child process exited with code 1;")  # not -6


@pytest.mark.slow  # a child process that imports torch, transformers and prefect (~15 s)
def test_a_stop_reaches_the_training_child_and_what_it_saved_is_noted_while_the_deadline_waits(
    tmp_path, cfg, monkeypatch
):
    """A stop while a launched child trains: the child checkpoints and stops, and the parent notes what it saved before
    it lets its stop deadline pass (`shutdown.saving`); a deadline passing in between would exit the process with a
    message that does not say what was saved."""
    import re
    import signal

    from farmflow import shutdown
    from farmflow.tasks import launch

    uri = str(tmp_path / "store")
    data, base = _upstream(uri, cfg)
    relayed, held, note = launch.log, [], shutdown.note

    def relay_then_stop(fmt, *args):  # the child's first progress line: it is training; stop as SIGTERM does
        relayed(fmt, *args)
        if re.match(r"sft: \d+/\d+ steps", fmt % args):
            shutdown.request(signal.SIGTERM)

    monkeypatch.setattr(launch, "log", relay_then_stop)
    monkeypatch.setattr(shutdown, "note", lambda line: (held.append(shutdown._State.saving), note(line)))
    monkeypatch.setenv("FARMFLOW_PROGRESS_EVERY_S", "0.000001")  # a progress line at every step
    shutdown.reset()
    try:
        with launching(ExecutionConfig(launcher="process")), pytest.raises(shutdown.Stopped) as stopped:
            sft = cfg.sft.model_copy(update={"epochs": 400})  # 3200 steps: the stop comes long before the end
            tasks.sft_task.fn(uri, sft, data=data, base=base, checkpoints=cfg.checkpoints)
        notes = shutdown.notes()
    finally:
        shutdown.reset()
    said = re.fullmatch(
        r"sft: stopped after step (\d+) \(checkpoint at step \1, a rerun resumes there\)", str(stopped.value)
    )
    assert said and notes == [str(stopped.value)] and held == [1], (str(stopped.value), held)
    (key,) = [p.name for p in (Path(uri) / "_checkpoints" / "sft").iterdir()]
    assert open_store(uri).latest_checkpoint("sft", key)[0] == int(said[1]) < 3200
    assert [r.stage for r in open_store(uri).list()] == ["data", "base_model"]  # the stopped stage committed nothing


def test_inline_and_non_gpu_stages_never_start_a_child(tmp_path, cfg):
    uri = str(tmp_path / "store")
    with launching(ExecutionConfig(launcher="process", accelerate_config="/nonexistent.yaml")):
        data = tasks.data_task.fn(uri, cfg.data)  # not a GPU stage: runs here
    with launching(ExecutionConfig(launcher="inline")):
        base = tasks.base_model_task.fn(uri, cfg.model, data=data)
    assert base.kind == "model"


def test_command_lines(tmp_path):
    spec = tmp_path / "spec.json"
    child = ["-m", "farmflow.tasks.child", str(spec)]
    assert command("sft", spec, ExecutionConfig(launcher="process")) == [sys.executable, *child]
    ex = ExecutionConfig(launcher="accelerate", accelerate_config="configs/accelerate/fsdp.yaml", num_processes=4)
    argv = command("sft", spec, ex)
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"] and argv[-3:] == child
    assert (
        argv[argv.index("--config_file") + 1] == str(CONFIGS / "fsdp.yaml")
        and argv[argv.index("--num_processes") + 1] == "4"
    )
    assert int(argv[argv.index("--main_process_port") + 1]) > 0
    assert command("sample_pairs", spec, ex) == [sys.executable, *child]  # sampling, scoring: one process
    for rl_stage in ("ppo", "quark"):  # PPO and Quark split each rollout between the processes
        assert rl_stage in MULTI_PROCESS_STAGES and command(rl_stage, spec, ex)[:3] == argv[:3]
    with pytest.raises(
        StageLaunchError,
        match="execution.accelerate_config: no file 'missing.yaml'.*deepspeed_zero3, fsdp, multi_gpu, single_gpu",
    ):
        command("dpo", spec, ExecutionConfig(launcher="accelerate", accelerate_config="missing.yaml"))


def test_accelerate_config_by_path_or_shipped_name(tmp_path, monkeypatch):
    """Shipped configs are package data, so an installed farmflow (no checkout, e.g. the Docker images) finds them by
    name."""
    for name in ("fsdp", "fsdp.yaml", "configs/accelerate/fsdp.yaml"):
        assert find_config(name) == CONFIGS / "fsdp.yaml"
    own = tmp_path / "fsdp.yaml"
    own.write_text("distributed_type: FSDP\n")
    monkeypatch.chdir(tmp_path)
    assert find_config("fsdp.yaml") == own  # a file in the working directory wins over the shipped one
    assert find_config(str(own)) == own
    with pytest.raises(StageLaunchError, match="no file 'sub/fsdp.yaml'"):
        find_config("sub/fsdp.yaml")  # only bare names fall back to the shipped configs


def test_launcher_settings_are_not_part_of_stage_keys():
    from farmflow.flows import config_key
    from farmflow.flows.distributed import stage_key_of

    plain = load_config("synthetic-micro")
    launched = load_config("synthetic-micro", ["execution.launcher=accelerate", "execution.num_processes=2"])
    assert config_key(plain) == config_key(launched)
    assert stage_key_of("sft", plain.sft, {}) == stage_key_of("sft", launched.sft, {})
    seven = load_config("alpacafarm-7b")
    assert (
        seven.execution.launcher == "accelerate"
        and find_config(seven.execution.accelerate_config) == CONFIGS / "fsdp.yaml"
    )
    assert load_config("synthetic-tiny").execution.launcher == "inline"


# ----------------------------------------------------------------------------- accelerate configs
def _launch_options() -> set[str]:
    from accelerate.commands.launch import launch_command_parser

    return {a.dest for a in launch_command_parser()._actions}


@pytest.mark.parametrize("name", ["single_gpu.yaml", "multi_gpu.yaml", "fsdp.yaml", "deepspeed_zero3.yaml"])
def test_accelerate_configs_parse_and_name_existing_options(name):
    from accelerate.commands.config.config_args import ClusterConfig

    path = CONFIGS / name
    raw = yaml.safe_load(path.read_text())
    parsed = ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader: unknown top-level keys are an error
    assert parsed.distributed_type.value == raw["distributed_type"] and parsed.mixed_precision == "bf16"
    options = _launch_options()
    for section in ("fsdp_config", "deepspeed_config"):
        unknown = sorted(set(raw.get(section) or {}) - options)
        assert not unknown, f"{name}: {section} names no accelerate launch option {unknown}"


def test_fsdp_config_is_the_7b_recipe():
    from transformers.models.llama import modeling_llama

    fsdp = yaml.safe_load((CONFIGS / "fsdp.yaml").read_text())
    c = fsdp["fsdp_config"]
    assert fsdp["distributed_type"] == "FSDP" and fsdp["mixed_precision"] == "bf16"
    assert c["fsdp_reshard_after_forward"] is True  # FULL_SHARD under FSDP2
    assert c["fsdp_auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP" and hasattr(
        modeling_llama, c["fsdp_transformer_layer_cls_to_wrap"]
    )
    assert c["fsdp_state_dict_type"] == "FULL_STATE_DICT"
    ds = yaml.safe_load((CONFIGS / "deepspeed_zero3.yaml").read_text())["deepspeed_config"]
    assert ds["zero_stage"] == 3 and ds["zero3_save_16bit_model"] is True


# ----------------------------------------------------------------------------- several processes
@pytest.mark.slow
def test_two_process_ddp_on_cpu_matches_one_process(tmp_path, cfg):
    """accelerate launch, 2 CPU processes (gloo): each takes half of every batch; the result is the one-process
    run's."""
    ddp = ddp_config(tmp_path)
    inline_uri, ddp_uri = str(tmp_path / "inline"), str(tmp_path / "ddp")
    data_a, base_a = _upstream(inline_uri, cfg)
    data_b, base_b = _upstream(ddp_uri, cfg)
    inline = tasks.sft_task.fn(inline_uri, cfg.sft, data=data_a, base=base_a)
    with launching(ExecutionConfig(launcher="accelerate", accelerate_config=str(ddp))):
        two = tasks.sft_task.fn(ddp_uri, cfg.sft, data=data_b, base=base_b)
    assert two.key == inline.key and two.metrics["processes"] == 2 and inline.metrics["processes"] == 1
    a, b = _weights(inline_uri, inline), _weights(ddp_uri, two)
    start = dict(load_policy(open_store(inline_uri).model_dir(base_a))[0].named_parameters())
    for k in a:
        assert not torch.equal(a[k], start[k]) or "norm" in k  # trained
        assert torch.allclose(a[k], b[k], atol=1e-4, rtol=1e-3), f"{k}: max diff {(a[k] - b[k]).abs().max():.2e}"
    assert two.metrics["train_loss_first"] == pytest.approx(inline.metrics["train_loss_first"], rel=1e-4)
    assert two.metrics["train_tokens"] == inline.metrics["train_tokens"]


@pytest.mark.slow  # the synthetic-micro stages up to the pairs, then two child processes (~60 s)
@pytest.mark.parametrize("select", ["last", "best_val"])
def test_two_process_reward_model_logs_the_global_batchs_figures(tmp_path, cfg, select):
    """The training_metrics rows of a reward model trained on 2 processes are the one-process run's: accuracy, margin
    and mean rewards are summed over both halves of every batch (Runtime.sum), tokens count the whole batch. Selected
    on val, each process measures its replica of the same weights, so both keep the same step."""
    from farmflow.training_metrics import read

    if select == "best_val":
        cfg.reward = cfg.reward.model_copy(update={"epochs": 2.0, "eval_every": 2, "select": "best_val"})

    inline_uri, ddp_uri = str(tmp_path / "inline"), str(tmp_path / "ddp")
    data, base = _upstream(inline_uri, cfg)
    sft = tasks.sft_task.fn(inline_uri, cfg.sft, data=data, base=base)
    prefs = tasks.annotate_task.fn(
        inline_uri, cfg.annotation, tasks.sample_pairs_task.fn(inline_uri, cfg.pairs, data, sft)
    )
    shutil.copytree(inline_uri, ddp_uri)  # the same upstream artifacts
    inline = tasks.train_reward_task.fn(inline_uri, cfg.reward, prefs, sft)
    with launching(ExecutionConfig(launcher="accelerate", accelerate_config=str(ddp_config(tmp_path)))):
        two = tasks.train_reward_task.fn(ddp_uri, cfg.reward, prefs, sft)
    assert two.key == inline.key and two.metrics["processes"] == 2 and inline.metrics["processes"] == 1
    one_rows, two_rows = read(open_store(inline_uri), inline).to_pylist(), read(open_store(ddp_uri), two).to_pylist()
    assert [r["step"] for r in two_rows] == [r["step"] for r in one_rows] and len(one_rows) > 2
    for a, b in zip(one_rows, two_rows):
        assert a["split"] == b["split"] and a["tokens"] == b["tokens"]
        for name in ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward"):
            if a.get(name) is None:
                continue
            assert b[name] == pytest.approx(a[name], rel=1e-3, abs=1e-4), (name, a["step"], a[name], b[name])
        assert b.get("heldout_accuracy") == a.get("heldout_accuracy")
    assert {r["split"] for r in one_rows} == {"train", "val"}
    assert sum(r["split"] == "val" for r in one_rows) == (8 if select == "best_val" else 1)
    assert two.metrics.get("selected_step") == inline.metrics.get("selected_step")
    assert (inline.metrics.get("selected_step") is None) is (select == "last")


@pytest.mark.slow
def test_the_flows_stage_runner_applies_the_launcher(tmp_path, cfg, prefect_harness, monkeypatch):
    """StageRunner (what every flow uses) runs a GPU stage through the launcher inside a Prefect task run."""
    from farmflow.flows import StageRunner
    from farmflow.tasks import launch

    started = []
    real = launch.run_in_child
    monkeypatch.setattr(launch, "run_in_child", lambda stage, *a: started.append(stage) or real(stage, *a))
    uri = str(tmp_path / "store")
    run = StageRunner(uri, ExecutionConfig(launcher="process"))
    data = run(tasks.data_task, cfg.data)
    base = run(tasks.base_model_task, cfg.model, data=data)
    pairs = run(tasks.sample_pairs_task, cfg.pairs, data=data, policy=base)
    assert started == ["sample_pairs"] and pairs.rows == 144
    assert run(tasks.sample_pairs_task, cfg.pairs, data=data, policy=base).key == pairs.key and started == [
        "sample_pairs"
    ]


def test_distributed_stage_flow_applies_the_callers_launcher(tmp_path, cfg, prefect_harness, monkeypatch):
    """In distributed mode the GPU worker's stage flow runs the stage with the calling flow's launcher (it ran
    inline)."""
    from farmflow.flows.distributed import stage_flow
    from farmflow.tasks import launch

    started = []
    real = launch.run_in_child
    monkeypatch.setattr(launch, "run_in_child", lambda stage, *a: started.append(stage) or real(stage, *a))
    uri = str(tmp_path / "store")
    data = tasks.data_task.fn(uri, cfg.data)
    base = tasks.base_model_task.fn(uri, cfg.model, data)
    params = dict(
        stage="sample_pairs",
        store_uri=uri,
        config=cfg.pairs.model_dump(mode="json"),
        inputs={"data": data, "policy": base},
    )
    ref = stage_flow(**params, launcher={"launcher": "process", "accelerate_config": None, "num_processes": None})
    assert started == ["sample_pairs"] and ref["rows"] == 144
    assert stage_flow(**params)["key"] == ref["key"] and started == ["sample_pairs"]  # cached; no launcher = inline


def test_a_child_stage_commits_its_extra_tables_and_files(tmp_path):
    """A child's store takes extra tables and files, as the real one does: best_of_n keeps its candidates as an extra
    table, and under launcher process/accelerate it commits through the child's store."""
    import pyarrow as pa

    from farmflow.storage.schemas import SCHEMAS
    from farmflow.tasks.outbox import OutboxStore, commit_outbox

    real, out = open_store(str(tmp_path / "store")), tmp_path / "out"
    outputs = pa.Table.from_pylist(
        [{"id": "a", "instruction": "i", "input": "", "output": "o", "generator": "g", "task": "", "score": 0.5}],
        schema=SCHEMAS["outputs"],
    )
    candidates = pa.Table.from_pylist(
        [{"id": "a", "sample": s, "output": f"o{s}", "reward": float(s)} for s in range(3)],
        schema=SCHEMAS["candidates"],
    )
    child = OutboxStore(real, out, writer=True)
    made = child.put_table(
        "best_of_n",
        "k1",
        outputs,
        "outputs",
        config={"n": 3},
        extra_files={"notes.md": b"# hi"},
        extra_tables={"candidates.parquet": (candidates, "candidates")},
    )
    assert made.rows == 1 and real.get("best_of_n", "k1") is None  # the child commits nothing itself
    (ref,) = commit_outbox(real, out)
    assert real.read_table(ref).equals(outputs)
    assert real.read_table(ref, "candidates.parquet", "candidates").equals(candidates)
    assert (Path(ref.uri) / "notes.md").read_bytes() == b"# hi"
    with pytest.raises(ValueError, match="candidates"):  # extra tables are validated in the child too
        child.put_table(
            "best_of_n", "k2", outputs, "outputs", extra_tables={"candidates.parquet": (outputs, "candidates")}
        )


WATCHED_CHILD = """
import os, time
from farmflow.tasks.launch import exit_with_parent
exit_with_parent(int(os.environ["FARMFLOW_PARENT_PID"]), every_s=0.2)
print("watching", flush=True)
time.sleep(120)
"""
PARENT = """
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]],
                         env=os.environ | {"FARMFLOW_PARENT_PID": str(os.getpid())},
                         stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(120)
"""


def test_a_launched_child_exits_when_its_flow_process_is_killed_and_its_folder_is_swept(tmp_path):
    """Orchestration review: a cancelled flow run (SIGKILL to its process) left the stage's child, and every
    accelerate worker, running on the GPU, and its launch folder behind."""
    import os
    import signal
    import subprocess
    import time

    from procs import python_env

    from farmflow.tasks.launch import PARENT_FILE, alive, sweep_orphans

    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, WATCHED_CHILD], stdout=subprocess.PIPE, text=True, env=python_env()
    )
    try:
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(child)
    finally:
        parent.kill()
    dead, live = tmp_path / "launch-sft-dead", tmp_path / "launch-sft-live"
    for folder, pid in ((dead, parent.pid), (live, os.getpid())):
        (folder / "out").mkdir(parents=True)
        (folder / PARENT_FILE).write_text(str(pid))
    sweep_orphans(tmp_path)
    assert not dead.exists() and live.exists()


@pytest.mark.parametrize(("code", "want"), [(None, 0), (0, 0), (3, 3), ("no spec", 1)])
def test_a_child_that_exits_reports_the_code_the_interpreter_would(code, want, monkeypatch, capsys):
    from farmflow.tasks import child

    def exits(_spec):
        raise SystemExit(code)

    monkeypatch.setattr(child, "child_main", exits)
    assert child.exit_code("spec.json") == want
    assert ("no spec" in capsys.readouterr().err) is (code == "no spec")
