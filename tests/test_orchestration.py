"""Operations: where stages run, retries on network stages, resuming after a failed stage, run names, stage logs,
the leaderboard history, and the GPU stage flow (its key must match the calling flow's).

The distributed mode end to end (server, two pools, two workers) is in test_orchestration_distributed.py.
"""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pytest
from prefect_server import all_artifacts
from pydantic_core import to_jsonable_python
from typer.testing import CliRunner

from farmflow import tasks
from farmflow.annotators import AnnotationIncomplete
from farmflow.annotators.api import AnnotationError
from farmflow.config import (
    AnnotatorConfig,
    ApiAnnotatorConfig,
    CheckpointConfig,
    ExecutionConfig,
    SFTConfig,
    load_config,
)
from farmflow.flows import StageRunner, compare_flow, retry_options, transient
from farmflow.flows.distributed import stage_flow, stage_key_of, stage_tasks
from farmflow.storage import ArtifactRef, LocalStore, StoreError
from farmflow.storage.schemas import SCHEMAS
from farmflow.storage.sql import connect
from farmflow.tasks import annotate_task


# ------------------------------------------------------------------------ routing
def test_distributed_sends_model_stages_to_the_gpu_pool_and_keeps_the_rest(tmp_path):
    local = StageRunner(str(tmp_path), ExecutionConfig())
    assert not any(local.remote(s) for s in ("sft", "generate", "dpo", "annotate", "evaluate"))
    dist = StageRunner(str(tmp_path), ExecutionConfig(mode="distributed"))
    for stage in (
        "sft",
        "sample_pairs",
        "train_reward",
        "generate",
        "best_of_n",
        "reference_logps",
        "proxy_reward",
        "feedme",
        "reward_conditioning",
        "dpo",
        "expert_iteration",
        "ppo",
        "quark",
    ):
        assert dist.remote(stage), stage
    for stage in ("data", "base_model", "annotate", "evaluate", "overoptimization"):
        assert not dist.remote(stage), stage
    # every GPU stage is a stage the stage flow knows
    assert set(ExecutionConfig().gpu_stages) <= set(stage_tasks())
    assert not StageRunner(str(tmp_path), ExecutionConfig(mode="distributed", gpu_stages=["sft"])).remote("generate")


def test_retries_with_backoff_only_where_the_network_is():
    ex = ExecutionConfig(retries=3, retry_delay_s=2.0)
    api = AnnotatorConfig(preset="p_sim_gpt4")
    assert retry_options("annotate", AnnotatorConfig(), "/data/store", ex) == {}  # the offline oracle
    for stage in ("annotate", "evaluate"):
        opts = retry_options(stage, api, "/data/store", ex)
        assert opts["retries"] == 3 and opts["retry_delay_seconds"] == [2.0, 4.0, 8.0]
    assert retry_options("sft", SFTConfig(), "s3://farm/runs?endpoint_url=http://127.0.0.1:9000", ex)["retries"] == 3
    assert retry_options("sft", SFTConfig(), "/data/store", ex) == {}
    assert retry_options("annotate", api, "/data/store", ExecutionConfig(retries=0)) == {}
    # what is worth a retry
    assert transient(
        AnnotationIncomplete(
            "annotation incomplete: 3 of 10 pairs failed (http_500: 3). Everything judged is in the row cache"
        )
    )
    assert not transient(
        AnnotationIncomplete("annotation incomplete: max_cost_usd=$1 reached after $1.01: 4 pairs not sent")
    )
    assert (
        transient(StoreError("s3://farm: endpoint unreachable"))
        and transient(ConnectionResetError())
        and transient(TimeoutError())
    )
    assert (
        not transient(AnnotationError("HTTP 401")) and not transient(ValueError("bad config")) and not transient(None)
    )


# ------------------------------------------------------------- the GPU stage flow
@pytest.mark.usefixtures("prefect_harness")
def test_stage_flow_rebuilds_typed_configs_from_json_under_the_callers_key(micro_config):
    """What a GPU worker gets is JSON; the artifact it commits must have the key the calling flow computed."""
    store = micro_config.store.location
    data = stage_flow(stage="data", store_uri=store, config=to_jsonable_python(micro_config.data))
    assert data["key"] == stage_key_of("data", micro_config.data, {})
    data_ref = ArtifactRef.model_validate(data)
    base = ArtifactRef.model_validate(
        stage_flow(
            stage="base_model", store_uri=store, config=to_jsonable_python(micro_config.model), inputs={"data": data}
        )
    )
    assert base.key == stage_key_of("base_model", micro_config.model, {"data": data_ref})
    # a dict config holding a pydantic section, and an option that is not part of the key
    config = {"sample": micro_config.generation, "generator": "untrained", "control": ""}
    out = stage_flow(
        stage="generate",
        store_uri=store,
        config=to_jsonable_python(config),
        inputs={"data": data, "policy": base},
        label="generate untrained",
    )
    assert (
        out["key"] == stage_key_of("generate", config, {"data": data_ref, "policy": base})
        and out["rows"] == micro_config.data.eval_size
    )
    # an option that is not part of the key, typed again (CheckpointConfig)
    checkpoints = CheckpointConfig(every_steps=2, every_seconds=0)
    sft = stage_flow(
        stage="sft",
        store_uri=store,
        config=to_jsonable_python(micro_config.sft),
        inputs={"data": data, "base": base},
        options={"checkpoints": to_jsonable_python(checkpoints)},
    )
    assert sft["key"] == stage_key_of(
        "sft", micro_config.sft, {"data": data_ref, "base": base, "checkpoints": checkpoints}
    )
    assert sft["kind"] == "model" and LocalStore(store).get("sft", sft["key"]) is not None
    with pytest.raises(ValueError, match="unknown stage 'nope'"):
        stage_flow.fn(stage="nope", store_uri=store)
    with pytest.raises(ValueError, match=r"stage 'generate' takes no option\(s\) \['checkpoints'\]"):
        stage_flow.fn(
            stage="generate", store_uri=store, config=to_jsonable_python(config), options={"checkpoints": None}
        )


@pytest.mark.usefixtures("prefect_harness")
def test_distributed_without_the_stage_deployment_is_a_clear_error(tmp_path):
    from farmflow.flows.distributed import StageRunError
    from farmflow.tasks import sft_task

    fake = ArtifactRef(
        uri="",
        stage="data",
        key="k" * 32,
        kind="table",
        format="instructions",
        rows=1,
        created="2026-01-01T00:00:00+00:00",
    )
    runner = StageRunner(
        str(tmp_path), ExecutionConfig(mode="distributed", stage_deployment="stage/not-deployed"), "synthetic-micro"
    )
    with pytest.raises(
        StageRunError, match=r"stage sft: deployment 'stage/not-deployed' is not registered.*farmflow deploy"
    ):
        runner(sft_task, SFTConfig(), data=fake, base=fake)


# ------------------------------------------------------------------ retries, resume
def _pairs(store: LocalStore, n: int) -> ArtifactRef:
    rows = [
        {
            "id": f"p{i}",
            "split": "pref",
            "instruction": f"Name a color, question {i}.",
            "input": "",
            "output_1": "Blue.",
            "output_2": "Red, a warm color.",
            "task": None,
        }
        for i in range(n)
    ]
    return store.put_table("sample_pairs", "hand-made", pa.Table.from_pylist(rows, schema=SCHEMAS["pairs"]), "pairs")


@pytest.mark.usefixtures("prefect_harness")
def test_api_annotation_is_retried_with_backoff_and_resumes_from_the_row_cache(tmp_path, monkeypatch):
    """The judge answers HTTP 500 to everything at first (no SDK retries), then recovers: Prefect retries the stage."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId, TaskRunFilterName

    from farmflow.annotators.server import JudgeConfig, JudgeServer

    monkeypatch.setenv("OPENAI_API_KEY", "test-key")
    store = LocalStore(tmp_path / "store")
    pairs = _pairs(store, 12)
    server = JudgeServer(JudgeConfig(fault_rate=1.0, faults=["500"]))
    with server as url:

        def recover() -> (
            None
        ):  # once the first attempt's 3 requests (12 pairs, 4 per request) failed, the endpoint heals
            deadline = time.monotonic() + 60
            while server.state.stats["status_500"] < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            server.state.config.fault_rate = 0.0

        watcher = threading.Thread(target=recover, daemon=True)
        watcher.start()
        cfg = AnnotatorConfig(
            kind="api",
            api_pool=[ApiAnnotatorConfig(name="judge", model="m", batch_size=4)],
            base_url=url,
            max_retries=0,
        )

        @flow(name="annotate-with-retries")
        def annotate_flow() -> ArtifactRef:
            return StageRunner(str(store.root), ExecutionConfig(retries=2, retry_delay_s=1.0))(
                annotate_task, cfg, pairs=pairs
            )

        tasks.EXECUTED.clear()
        started = time.perf_counter()
        state = annotate_flow(return_state=True)
        ref = state.result()
        seconds = time.perf_counter() - started
        watcher.join(timeout=5)
        stats = dict(server.state.stats)
    assert ref.rows == 12 and all(p in (1.0, 2.0) for p in store.read_table(ref).column("preference").to_pylist())
    assert stats["status_500"] == 3 and stats["status_200"] == 3  # the retry asked only what had failed
    assert tasks.EXECUTED["annotate"] == 2 and seconds >= 1.0  # two attempts, the backoff delay in between
    with get_client(sync_client=True) as client:
        (run,) = client.read_task_runs(
            task_run_filter=TaskRunFilter(
                name=TaskRunFilterName(any_=["annotate"]),
                flow_run_id=TaskRunFilterFlowRunId(any_=[state.state_details.flow_run_id]),
            )
        )
    assert run.run_count == 2 and run.state.is_completed()


@pytest.mark.slow
@pytest.mark.usefixtures("prefect_harness")
def test_failed_stage_resumes_from_cached_inputs_then_history_accumulates(micro_config):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from farmflow.cli import app

    root = Path(micro_config.store.uri)
    root.mkdir(parents=True, exist_ok=True)
    blocker = root / "train_reward"
    blocker.write_text("a file where the reward model's folder belongs: the stage fails")
    tasks.EXECUTED.clear()
    with pytest.raises(OSError):
        compare_flow(advanced=micro_config, methods=["best_of_n"], history=True)
    assert dict(tasks.EXECUTED) == {"data": 1, "base_model": 1, "sft": 1, "sample_pairs": 1, "annotate": 1}

    blocker.unlink()  # the fault is gone: the rerun starts at the reward model
    tasks.EXECUTED.clear()
    first = compare_flow(advanced=micro_config, methods=["best_of_n"], history=True)
    assert dict(tasks.EXECUTED) == {
        "train_reward": 1,
        "generate": 2,
        "best_of_n": 1,
        "evaluate": 3,
        "proxy_reward": 2,
        "overoptimization": 1,
    }
    stages = {s["stage"]: s for s in first["stages"]}
    assert all(stages[s]["cached"] for s in ("data", "base_model", "sft", "sample_pairs", "annotate"))
    assert stages["evaluate best_of_4"]["rows"] == micro_config.data.eval_size and stages["sft"]["rows"] is None
    assert sorted(r["label"] for r in first["overoptimization"]["rows"]) == ["best_of_4", "sft"]
    assert open(f"{first['artifacts']['overoptimization']}/curve.png", "rb").read(4) == b"\x89PNG"

    tasks.EXECUTED.clear()
    with run_log() as logs:
        again = compare_flow(advanced=micro_config, methods=["best_of_n"], history=True)
    assert dict(tasks.EXECUTED) == {} and again["leaderboard"] == first["leaderboard"]
    assert again["run"]["rows"] == 3

    # the history: two recorded runs (the failed one recorded nothing), queryable with DuckDB
    con = connect(LocalStore(root))
    runs = con.sql(
        "SELECT flow_run_id, count(*), any_value(preset) FROM leaderboard_history GROUP BY flow_run_id"
    ).fetchall()
    assert len(runs) == 2 and all(n == 3 and preset == "synthetic-micro" for _, n, preset in runs)
    trend = con.sql(
        "SELECT method, count(*), min(win_rate) = max(win_rate) FROM leaderboard_history "
        "GROUP BY method ORDER BY method"
    ).fetchall()
    assert trend == [("best_of_4", 2, True), ("sft", 2, True), ("untrained", 2, True)]
    out = CliRunner().invoke(
        app, ["sql", "SELECT count(*) AS n FROM leaderboard_history", "--store", str(root), "--format", "json"]
    )
    assert out.exit_code == 0 and '"n": 6' in out.output

    # clear run names, Prefect artifacts, one log line per stage (rows, seconds, cache hit) without per-row spam
    flow_run_ids = {r for r, _, _ in runs}
    with get_client(sync_client=True) as client:
        flow_runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=list(flow_run_ids))))
        keys = {a.key for a in all_artifacts(client) if str(a.flow_run_id) in flow_run_ids}
    assert {r.name for r in flow_runs} == {f"compare:best_of_n/synthetic-micro/{first['config_key']}"}
    assert {"leaderboard", "leaderboard-table", "overoptimization", "overoptimization-table"} <= keys
    hits = [m for m in logs if ": cache hit, " in m]
    assert len(hits) == len(again["stages"])
    assert any(m.startswith("evaluate best_of_4: cache hit, 16 rows, ") and m.endswith("(local)") for m in hits)
    assert any(m.startswith("sft: cache hit, policy model, ") for m in hits)
    assert len(logs) < 3 * len(again["stages"]), logs


@contextmanager
def run_log():
    """INFO messages of Prefect's flow- and task-run loggers during the block (the suite runs them at WARNING)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    loggers = [logging.getLogger(n) for n in ("prefect.flow_runs", "prefect.task_runs")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        lg.setLevel(logging.INFO)
    try:
        yield messages
    finally:
        for lg, level in zip(loggers, levels):
            lg.removeHandler(handler)
            lg.setLevel(level)


@pytest.mark.usefixtures("prefect_harness")
def test_stage_timings_separate_waiting_for_another_model_stage(tmp_path):
    """Stages that load a model take turns (MODEL_LOCK); the time one spends queued is recorded
    apart from its run time, so the stage table does not pass queueing off as work."""
    from prefect import flow

    from farmflow.flows import MODEL_LOCK
    from farmflow.tasks import base_model_task, data_task

    cfg = load_config("synthetic-micro", [f"store.uri={tmp_path / 'store'}"])
    runner = StageRunner(
        cfg.store.uri, ExecutionConfig(gpu_stages=["base_model"])
    )  # a model stage that builds in a blink
    held = threading.Event()

    def other_model_stage() -> None:  # another method's model stage, busy for 1 s
        with MODEL_LOCK:
            held.set()
            time.sleep(1.0)

    @flow(name="queued-stages")
    def queued() -> None:
        data = runner(data_task, cfg.data)  # no model: never waits
        busy = threading.Thread(target=other_model_stage)
        busy.start()
        held.wait(5)
        runner(base_model_task, cfg.model, data=data)  # queued behind the busy stage
        busy.join()

    queued()
    timing = {t["stage"]: t for t in runner.timings}
    assert timing["data"]["waited_seconds"] == 0.0
    assert 0.8 <= timing["base_model"]["waited_seconds"] <= timing["base_model"]["seconds"]


def test_a_full_config_from_the_ui_still_gets_the_deployments_overrides_and_operational_settings_keep_the_config_key():
    """Orchestration review: a config filled in the UI of a deployment made with --set failed ('not both'), and the
    config key in run names and history changed with memory-only settings."""
    from farmflow.flows import config_key, run_config

    ui = load_config("synthetic-micro", ["best_of_n.n=3"])
    cfg = run_config("synthetic-micro", ui.model_dump(mode="json"), ["store.uri=/data/farm", "dpo.beta=0.2"])
    assert (cfg.name, cfg.best_of_n.n, cfg.dpo.beta, cfg.store.uri) == ("synthetic-micro", 3, 0.2, "/data/farm")
    assert run_config(None, ui) is ui
    base = load_config("synthetic-micro")
    for memory_only in (
        ["generation.batch_size=7"],
        ["sft.micro_batch_size=2"],
        ["annotation.max_in_flight=3"],
        ["pairs.backend=vllm"],
    ):
        assert config_key(load_config("synthetic-micro", memory_only)) == config_key(base), memory_only
    assert config_key(load_config("synthetic-micro", ["dpo.beta=0.2"])) != config_key(base)


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_failing_branch_does_not_skip_the_others(parallel, prefect_harness):
    """Orchestration review: with max_parallel_methods=1 the first failure skipped every later method."""
    from prefect import flow

    from farmflow.flows import fan_out

    ran = []

    def work(branch):
        ran.append(branch)
        if branch == "b":
            raise RuntimeError("b broke")
        return branch.upper()

    @flow
    def branches():
        return fan_out(["a", "b", "c"], work, ExecutionConfig(max_parallel_methods=parallel))

    with pytest.raises(RuntimeError, match="b broke"):
        branches()
    assert sorted(ran) == ["a", "b", "c"]


def test_a_gpu_worker_runs_its_stage_with_the_calling_flows_retries_and_launcher():
    """Orchestration review: the stage flow rebuilt ExecutionConfig from the launcher fields alone, so the caller's
    retries, retry delay and gpu_stages fell back to the defaults on the worker."""
    from farmflow.flows.distributed import worker_execution

    ex = ExecutionConfig(
        mode="distributed",
        launcher="accelerate",
        accelerate_config="fsdp",
        num_processes=4,
        retries=0,
        retry_delay_s=7.0,
        gpu_stages=["sft", "dpo"],
    )
    on_worker = ExecutionConfig.model_validate(worker_execution(ex))
    assert on_worker.mode == "local"  # the worker runs the stage itself
    for name in ("launcher", "accelerate_config", "num_processes", "retries", "retry_delay_s", "gpu_stages"):
        assert getattr(on_worker, name) == getattr(ex, name), name
