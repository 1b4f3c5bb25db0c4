"""The stage registry: every stage declared once (`farmflow.tasks.registry.STAGES`), and `stage_task` doing the key,
cache hit, commit and log around a stage function that only does its work."""

from __future__ import annotations

import inspect
import logging

import pyarrow as pa
import pytest

from farmflow.config import GPU_STAGES, DataConfig
from farmflow.storage import ArtifactRef, open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks import EXECUTED, STAGES, TASKS, Stage, stage_task
from farmflow.tasks.launch import MULTI_PROCESS_STAGES
from farmflow.tasks.stage import StageRun, Table


def test_every_stage_has_one_task_whose_inputs_are_the_declared_ones():
    assert set(TASKS) == set(STAGES)
    for name, task in TASKS.items():
        params = inspect.signature(task.fn).parameters
        assert list(params)[:2] == ["store_uri", "config"], name
        refs = tuple(p for p, v in params.items() if v.annotation in ("ArtifactRef", ArtifactRef))
        assert refs == STAGES[name].inputs, name
        assert task.name == name


def test_gpu_and_launcher_facts_come_from_the_registry():
    # config.GPU_STAGES (the default execution.gpu_stages) lives in the torch-free config package: it must agree
    assert {n for n, s in STAGES.items() if s.gpu} == set(GPU_STAGES)
    assert set(MULTI_PROCESS_STAGES) == {
        "sft",
        "train_reward",
        "feedme",
        "reward_conditioning",
        "dpo",
        "expert_iteration",
        "ppo",
        "quark",
    }
    assert all(STAGES[n].gpu for n in MULTI_PROCESS_STAGES)


# A stage as a newcomer would add one: a registry entry and a function that only does its work.
SHOUT = Stage("shout", "1", ("data",), reads=lambda c: {"data": ("eval",)}, summary="{rows_shouted:.0f} rows shouted")


@stage_task(SHOUT)
def shout_task(run: StageRun, config: dict, data: ArtifactRef) -> Table:
    rows = [r for r in run.store.read_table(data).to_pylist() if r["split"] == "eval"][: config["n"]]
    table = pa.Table.from_pylist(
        [
            {
                "id": r["id"],
                "instruction": r["instruction"],
                "input": r["input"],
                "task": r["task"],
                "output": r["instruction"].upper() + config["mark"],
                "generator": "shout",
                "score": None,
            }
            for r in rows
        ],
        schema=SCHEMAS["outputs"],
    )
    return Table(table, "outputs", {"rows_shouted": float(len(rows))})


def test_stage_task_does_the_key_the_hit_the_commit_and_the_log(tmp_path, caplog):
    uri = str(tmp_path / "store")
    data = TASKS["data"].fn(uri, DataConfig(sft_size=8, pref_size=8, unlabeled_size=4, val_size=2, eval_size=3))
    EXECUTED.clear()
    with caplog.at_level(logging.INFO, logger="farmflow"):
        ref = shout_task.fn(uri, {"n": 2, "mark": "!"}, data=data)
    assert EXECUTED["shout"] == 1 and ref.rows == 2 and ref.key == SHOUT.key({"n": 2, "mark": "!"}, {"data": data})
    assert ref.metrics["rows_shouted"] == 2.0 and ref.metrics["seconds"] >= 0  # the function's metrics + the run's time
    record = open_store(uri).record(ref)
    assert record["config"] == {"n": 2, "mark": "!"} and record["inputs"] == {"data": data.key}
    assert all(
        o.endswith("!") and o[:-1].isupper() for o in open_store(uri).read_table(ref).column("output").to_pylist()
    )
    assert "shout: 2 rows shouted" in caplog.text
    # the same config again: the committed artifact, the function does not run
    assert shout_task.fn(uri, {"n": 2, "mark": "!"}, data=data).key == ref.key and EXECUTED["shout"] == 1
    assert shout_task.fn(uri, {"n": 3, "mark": "!"}, data=data).rows == 3 and EXECUTED["shout"] == 2


def test_a_stage_function_that_fails_commits_nothing(tmp_path):
    uri = str(tmp_path / "store")
    data = TASKS["data"].fn(uri, DataConfig(sft_size=8, pref_size=8, unlabeled_size=4, val_size=2, eval_size=3))
    with pytest.raises(KeyError, match="mark"):
        shout_task.fn(uri, {"n": 1}, data=data)
    assert open_store(uri).get("shout", SHOUT.key({"n": 1}, {"data": data})) is None


def test_versions_read_from_the_source_are_the_modules_own():
    """The registry reads each method module's VERSION from its source (importing it would import torch): the
    stage versions are exactly what importing the modules gives."""
    import importlib

    from farmflow.config import METHODS
    from farmflow.models.sampling import SAMPLER_VERSION
    from farmflow.tasks.registry import SAMPLED, declared_version, method_version

    assert SAMPLED == f"+sampler{SAMPLER_VERSION}"
    for name in ("sft", "reward", "best_of_n", "dpo", "expert_iteration", "ppo", "quark", *METHODS):
        module = importlib.import_module(f"farmflow.methods.{name}")
        assert method_version(name) == module.VERSION, name
        if name in STAGES and name != "reward":
            assert STAGES[name].version in (module.VERSION, module.VERSION + SAMPLED), name
    assert STAGES["train_reward"].version == importlib.import_module("farmflow.methods.reward").VERSION
    with pytest.raises(LookupError, match=r"methods/rl\.py assigns no VERSION"):
        declared_version("farmflow.methods.rl")


def test_importing_the_flows_and_tasks_loads_no_model_code():
    """torch and transformers are imported by the stages that load a model, when they run (a cached run needs
    neither; tests/test_cli_output.py runs one)."""
    import subprocess
    import sys

    code = (
        "import sys, farmflow.flows, farmflow.tasks, farmflow.deployments; "
        "print(sorted(m for m in ('torch', 'transformers', 'accelerate') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
