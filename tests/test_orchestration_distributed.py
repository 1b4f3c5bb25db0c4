"""Distributed mode for real, all on 127.0.0.1: a Prefect server on PostgreSQL, `farmflow deploy`, a CPU and a GPU
process worker, a triggered `compare` run of the micro preset with execution.mode=distributed, then a second trigger
with one changed method parameter. Every GPU stage must run as its own flow run on the GPU pool (a separate process:
nothing executes in this test process), and the second run must send only the changed method's stages there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prefect_server import all_artifacts
from typer.testing import CliRunner

from farmflow import tasks
from farmflow.storage import LocalStore

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("prefect_on_postgres")]

CPU, GPU = "it-cpu", "it-gpu"
FIRST = {
    "sft",
    "sample_pairs",
    "train_reward",
    "generate untrained",
    "generate sft",
    "best_of_n",
    "proxy_reward sft",
    "proxy_reward best_of_4",
}
SECOND = {"best_of_n", "proxy_reward best_of_3"}


@pytest.fixture(scope="module")
def prefect_on_postgres(postgres, tmp_path_factory):
    """A Prefect server on PostgreSQL, what a shared server runs on (docs/orchestration.md): two workers and their
    flow-run processes write to it at once, which a SQLite database answers with "database is locked"."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_server import prefect_server

    url = postgres.database("distributed")
    with prefect_server(tmp_path_factory.mktemp("prefect-postgres"), PREFECT_SERVER_DATABASE_CONNECTION_URL=url) as (
        api_url,
        _,
        _,
    ):
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            yield api_url


def _start_worker(pool: str, api_url: str, log: Path) -> subprocess.Popen:
    env = os.environ | {
        "PREFECT_API_URL": api_url,
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }
    prefect = str(Path(sys.executable).parent / "prefect")
    return subprocess.Popen(
        [prefect, "worker", "start", "--pool", pool, "--limit", "4"],
        env=env,
        cwd=log.parent,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)  # the worker and the flow-run processes it started
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def _wait(client, flow_run_id, logs: list[Path], deadline_s: float = 480):
    deadline = time.monotonic() + deadline_s
    while True:
        run = client.read_flow_run(flow_run_id)
        if run.state and run.state.is_final():
            return run
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {p.name}\n" + p.read_text()[-3000:] for p in logs)
            pytest.fail(
                f"flow run {run.name} still {run.state.name if run.state else '?'} after {deadline_s}s\n{tails}"
            )
        time.sleep(1)


def _stage_runs(client, stage_deployment_id, after) -> dict[str, object]:
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId, FlowRunFilterStartTime

    runs = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=[stage_deployment_id]),
            start_time=FlowRunFilterStartTime(after_=after),
        )
    )
    return {r.parameters["label"]: r for r in runs}


def test_compare_runs_gpu_stages_on_the_gpu_pool_and_reruns_only_the_changed_method(tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import get_current_settings

    from farmflow.cli import app

    store = str(tmp_path / "store")
    api_url = get_current_settings().api.url
    deployed = CliRunner().invoke(
        app,
        [
            "deploy",
            "--preset",
            "synthetic-micro",
            "--store",
            store,
            "--gpu-slots",
            "4",
            "--set",
            "execution.mode=distributed",
            "--set",
            "execution.poll_seconds=1",
            "--set",
            "execution.max_parallel_methods=3",
            "--set",
            f"execution.cpu_pool={CPU}",
            "--set",
            f"execution.gpu_pool={GPU}",
        ],
    )
    assert deployed.exit_code == 0, deployed.output
    logs = [tmp_path / "cpu-worker.log", tmp_path / "gpu-worker.log"]
    workers = [_start_worker(CPU, api_url, logs[0]), _start_worker(GPU, api_url, logs[1])]
    tasks.EXECUTED.clear()
    try:
        with get_client(sync_client=True) as client:
            compare = client.read_deployment_by_name("compare/farmflow")
            stage = client.read_deployment_by_name("stage/gpu")
            assert compare.work_pool_name == CPU and stage.work_pool_name == GPU
            # what a user does in the UI: pick methods, keep the deployment's defaults
            triggered = run_deployment("compare/farmflow", parameters={"methods": ["best_of_n"]}, timeout=0)
            first = _wait(client, triggered.id, logs)
            assert first.state.is_completed(), (first.state.message, [p.read_text()[-3000:] for p in logs])
            assert first.name.startswith("compare:best_of_n/synthetic-micro/")
            runs = _stage_runs(client, stage.id, first.start_time)
            assert set(runs) == FIRST and all(r.state.is_completed() for r in runs.values())
            assert runs["generate sft"].name.startswith("generate:sft/synthetic-micro/")
            artifacts = {a.key for a in all_artifacts(client) if a.flow_run_id == first.id}
            assert {"leaderboard", "leaderboard-table", "overoptimization", "overoptimization-table"} <= artifacts

            # a changed method parameter, added to the deployment's overrides as in the UI form
            overrides = list(compare.parameters["overrides"]) + ["best_of_n.n=3"]
            triggered = run_deployment(
                "compare/farmflow", parameters={"methods": ["best_of_n"], "overrides": overrides}, timeout=0
            )
            second = _wait(client, triggered.id, logs)
            assert second.state.is_completed(), second.state.message
            assert set(_stage_runs(client, stage.id, second.start_time)) == SECOND
    finally:
        for w in workers:
            _stop(w)
    assert dict(tasks.EXECUTED) == {}  # every stage ran in the workers' processes, none in this one
    st = LocalStore(store)
    boards = [r for r in st.list() if r.stage == "leaderboard"]
    assert len(boards) == 2
    assert sorted(r["method"] for r in st.read_table(boards[-1]).to_pylist()) == ["best_of_3", "sft", "untrained"]
    evaluations = [r for r in st.list() if r.stage == "evaluate"]
    assert len(evaluations) == 4  # untrained, sft, best_of_4, then only best_of_3


def _heartbeat_seen(api_url: str, flow_run_id) -> bool:
    import httpx

    body = {
        "filter": {
            "event": {"name": ["prefect.flow-run.heartbeat"]},
            "resource": {"id": [f"prefect.flow-run.{flow_run_id}"]},
        },
        "limit": 1,
    }
    return bool(httpx.post(f"{api_url}/events/filter", json=body, timeout=10).json().get("events"))


def test_a_vanished_gpu_worker_is_marked_crashed_and_its_stage_retried(tmp_path):
    """A GPU machine that vanishes does not leave its flow run Running and the flow waiting forever.

    `farmflow deploy` registers Prefect's zombie-run automation (heartbeats, a proactive
    trigger): the GPU worker and its flow-run process are SIGKILLed mid-SFT, once it has sent a
    heartbeat and written a checkpoint to the store; the run is marked Crashed about
    `unresponsive_after_s` after its last heartbeat, and `run_remote` (the flow's side) retries the
    stage on a new worker, which resumes SFT from that checkpoint.
    """
    import contextvars
    import threading
    from types import SimpleNamespace

    import psutil  # accelerate's dependency
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.settings import get_current_settings

    from farmflow.cli import app
    from farmflow.config import load_config
    from farmflow.config.execution import CheckpointConfig
    from farmflow.deployments import UNRESPONSIVE, ensure_unresponsive_automation
    from farmflow.flows.distributed import run_remote
    from farmflow.flows.remote import stage_key_of

    store, pool = str(tmp_path / "store"), "it-gpu-vanish"
    overrides = [
        "execution.mode=distributed",
        "execution.poll_seconds=1",
        f"execution.gpu_pool={pool}",
        "execution.heartbeat_s=30",
        "execution.unresponsive_after_s=45",
        "execution.retries=1",
        "execution.retry_delay_s=1",
        "sft.epochs=75",  # 600 steps, a few seconds each way on a quiet machine
    ]
    api_url = get_current_settings().api.url
    deployed = CliRunner().invoke(
        app, ["deploy", "--preset", "synthetic-micro", "--store", store, *[a for o in overrides for a in ("--set", o)]]
    )
    assert deployed.exit_code == 0, deployed.output
    assert UNRESPONSIVE in deployed.output
    cfg = load_config("synthetic-micro", [*overrides, f"store.uri={store}"])
    data = tasks.data_task.fn(store, cfg.data)
    base = tasks.base_model_task.fn(store, cfg.model, data=data)
    runner = SimpleNamespace(
        execution=cfg.execution, store=LocalStore(store), store_uri=store, preset="synthetic-micro"
    )
    result: list = []

    checkpoints = CheckpointConfig(every_steps=25, every_seconds=0)
    key = stage_key_of("sft", cfg.sft, {"data": data, "base": base})

    def wait_for_sft():
        inputs = {"data": data, "base": base, "checkpoints": checkpoints}
        result.append(run_remote(runner, tasks.sft_task, cfg.sft, "sft", inputs))

    parent = threading.Thread(
        target=contextvars.copy_context().run, args=(wait_for_sft,), daemon=True
    )  # the module server's API settings
    logs = [tmp_path / "gpu-a.log", tmp_path / "gpu-b.log"]
    first_worker = _start_worker(pool, api_url, logs[0])
    second_worker = None
    try:
        with get_client(sync_client=True) as client:
            stage = client.read_deployment_by_name("stage/gpu")
            assert stage.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "30"

            def all_runs():
                return client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[stage.id]))
                )

            earlier = {r.id for r in all_runs()}  # the module's server keeps the other test's stage runs
            runs = lambda: [r for r in all_runs() if r.id not in earlier]  # noqa: E731
            parent.start()
            deadline = time.monotonic() + 180
            # kill once the server has the run's first heartbeat (events are persisted every few seconds) and SFT has
            # checkpointed 50 of its 600 steps
            checkpointed = lambda: LocalStore(store).latest_checkpoint("sft", key)  # noqa: E731
            while not (
                (ckpt := checkpointed()) is not None
                and ckpt[0] >= 50
                and any(r.state and r.state.is_running() and _heartbeat_seen(api_url, r.id) for r in runs())
            ):
                assert time.monotonic() < deadline and not any(r.state and r.state.is_final() for r in runs()), logs[
                    0
                ].read_text()[-3000:]
                time.sleep(0.2)
            gone = psutil.Process(
                first_worker.pid
            )  # the flow-run process has its own session: not in the worker's group
            for proc in [
                gone,
                *gone.children(recursive=True),
            ]:  # the machine vanishes: worker and flow-run process, no goodbye
                proc.kill()
            first_worker.wait(timeout=10)
            killed_at = time.monotonic()
            saved = checkpointed()[0]  # the newest checkpoint the vanished machine left
            (vanished,) = runs()
            while not (
                state := client.read_flow_run(vanished.id).state
            ).is_crashed():  # read once: it may turn Crashed between reads
                assert state.is_running()  # nothing else happens to it meanwhile
                assert time.monotonic() - killed_at < 150, "the unresponsive run was never marked crashed"
                time.sleep(1)
            assert "no heartbeat for 45 s" in client.read_flow_run(vanished.id).state.message
            second_worker = _start_worker(pool, api_url, logs[1])
            parent.join(timeout=600)  # ~30 s unloaded; a 2-core machine under heavy other load can need several minutes
            assert not parent.is_alive(), logs[1].read_text()[-3000:]
            states = sorted(r.state.name for r in runs())
        assert states == ["Completed", "Crashed"]
        ref, cached = result[0]
        assert not cached and ref.stage == "sft" and LocalStore(store).exists(ref) and ref.metrics["steps"] == 600
        assert ref.metrics["resumed_from_step"] == saved  # not from scratch: from the vanished machine's checkpoint
    finally:
        ensure_unresponsive_automation(None)  # the module's server is shared: no 45 s automation left for other tests
        for w in (first_worker, second_worker):
            if w is not None:
                _stop(w)
