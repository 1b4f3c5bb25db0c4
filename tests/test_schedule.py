"""Schedules fire: a real `prefect server start` (its own PREFECT_HOME and SQLite database, loopback, the scheduler loop
shortened), the nightly comparison deployed with a schedule whose first night is 90 s away (micro preset), and a
process worker. The scheduler service itself must create the run, the run must complete with its leaderboard
artifact, and the server log must show no service crash (with SQLAlchemy 2.1 the scheduler failed on every loop:
"Can't evaluate bulk DML statement", and no scheduled run was ever created).
"""

from __future__ import annotations

import re
import time
from datetime import datetime, timedelta, timezone

import pytest
from prefect_server import all_artifacts, prefect_cli, prefect_server, stop

pytestmark = pytest.mark.slow

POOL = "sched-cpu"
CRASH = re.compile(r"Traceback|InvalidRequestError|Can't evaluate bulk DML|Unexpected error in", re.IGNORECASE)
BEST_EFFORT = ("Worker channel heartbeat persistence failed", "mark_work_queues_ready(")
"""Log lines of Prefect's best-effort background writes for polling workers (the worker's heartbeat; the work queue's
last-polled time, a docket task), each followed by its traceback when it loses SQLite's lock; the next poll writes
them again."""
API_FAILED = re.compile(r"Encountered exception in request|Exception in ASGI application")


def server_lines(log, since: int = 0) -> list[str]:
    """The server log's lines from byte `since` on (the server is shared by this module's tests, and each checks only
    its own stretch), without Prefect's best-effort background writes that lost SQLite's lock (`BEST_EFFORT`, each with
    its traceback): on SQLite one can lose the write lock to the runs' own writes (artifacts, logs) and is written
    again on the next poll; the runs, the scheduler and every API request are unaffected (Postgres for busy shared
    servers: docs/orchestration.md). Such a write that fails for any other reason stays in.
    """
    with open(log, "rb") as f:
        f.seek(since)
        text = f.read().decode(errors="replace")
    kept: list[str] = []
    block: list[str] = []  # a best-effort write's error line and its traceback so far

    def close_block() -> None:
        if not any("database is locked" in b for b in block):
            kept.extend(block)
        block.clear()

    for line in text.splitlines():
        if any(marker in line for marker in BEST_EFFORT):
            close_block()
            block.append(line)
        elif block and (
            not line or line.startswith(("Traceback", " ", "The above", "sqlite3.", "sqlalchemy.", "(", "["))
        ):
            block.append(line)
        else:
            close_block()
            kept.append(line)
    close_block()
    return kept


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """A Prefect server of its own on 127.0.0.1, the scheduler loop shortened; yields (api_url, environment for clients,
    server log)."""
    with prefect_server(
        tmp_path_factory.mktemp("prefect-server"),
        PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS="2",
        PREFECT_SERVER_SERVICES_SCHEDULER_RECENT_DEPLOYMENTS_LOOP_SECONDS="2",
    ) as started:
        yield started


def test_the_scheduler_creates_the_nightly_run_and_it_completes(server, tmp_path):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.schedules import RRule
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from farmflow.deployments import NIGHTLY, deploy

    api_url, env, server_log = server
    store = tmp_path / "store"
    # a nightly schedule whose first night is 90 s away (deploying takes 20-30 s here): the scheduler queues both
    # occurrences, the worker starts the first, the second waits for tomorrow. A fixed count rather than pausing a
    # fast interval after one run: a scheduler loop that read the deployment before the pause adds runs after it.
    deployed_at = datetime.now(timezone.utc)
    first_night = (deployed_at + timedelta(seconds=90)).replace(microsecond=0)
    schedule = RRule(f"DTSTART:{first_night:%Y%m%dT%H%M%S}Z\nRRULE:FREQ=DAILY;COUNT=2", timezone="UTC")
    since = server_log.stat().st_size
    overrides = [f"store.uri={store}", f"execution.cpu_pool={POOL}", "execution.unresponsive_after_s=null"]
    with temporary_settings({PREFECT_API_URL: api_url}):
        registered = deploy("synthetic-micro", overrides, nightly_methods=["best_of_n"], nightly_schedule=schedule)
        deployed = datetime.now(timezone.utc)
        # the scheduler only queues occurrences still ahead of it
        assert deployed < first_night - timedelta(seconds=10), f"deploying took {deployed - deployed_at}"
        assert f"compare/{NIGHTLY}" in {d["name"] for d in registered}
        worker_log = tmp_path / "worker.log"
        worker = prefect_cli(
            "worker", "start", "--pool", POOL, env=env | {"PREFECT_WORKER_QUERY_SECONDS": "1"}, log=worker_log
        )
        try:
            with get_client(sync_client=True) as client:
                nightly = client.read_deployment_by_name(f"compare/{NIGHTLY}")
                assert nightly.parameters["history"] is True and nightly.parameters["methods"] == ["best_of_n"]
                by_nightly = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[nightly.id]))
                deadline = time.monotonic() + 330
                first = None
                while True:
                    runs = client.read_flow_runs(flow_run_filter=by_nightly)
                    if first is None:
                        picked = [r for r in runs if r.state and not r.state.is_scheduled()]
                        if picked:
                            (first,) = picked
                    elif client.read_flow_run(first.id).state.is_final():
                        break
                    assert time.monotonic() < deadline, (
                        f"no scheduled run finished; runs: {[(r.state_name, r.expected_start_time) for r in runs]}\n"
                        f"first night {first_night}, deployed {deployed}\n"
                        f"--- server\n{server_log.read_text()[-3000:]}\n--- worker\n{worker_log.read_text()[-3000:]}"
                    )
                    time.sleep(1)
                run = client.read_flow_run(first.id)
                # created by the scheduler service, not by anyone calling run_deployment
                assert run.auto_scheduled and run.created_by.type == "SCHEDULE", run
                assert run.expected_start_time == first_night
                assert run.state.is_completed(), (run.state.message, worker_log.read_text()[-3000:])
                # the scheduler queued the next night as well, and nothing started it
                (tomorrow,) = [r for r in client.read_flow_runs(flow_run_filter=by_nightly) if r.id != run.id]
                assert tomorrow.state.is_scheduled() and tomorrow.expected_start_time == first_night + timedelta(days=1)
                artifacts = {a.key for a in all_artifacts(client) if a.flow_run_id == run.id}
                assert {"leaderboard", "leaderboard-table"} <= artifacts
        finally:
            stop(worker)
    from farmflow.storage import LocalStore

    recorded = LocalStore(store).read_rows("runs", "runs")
    assert sorted(set(recorded.column("method").to_pylist())) == ["best_of_4", "sft", "untrained"]
    assert set(recorded.column("flow_run_id").to_pylist()) == {str(run.id)} and all(
        recorded.column("history").to_pylist()
    )
    crashes = [line for line in server_lines(server_log, since) if CRASH.search(line)]
    assert not crashes, "\n".join(crashes[:20])


def test_three_comparisons_at_once_on_one_server(server, tmp_path):
    """Three compare runs at once on one local server (SQLite), each in its own flow-run process: all complete, the
    runs log no locked database, and no API request fails."""
    from prefect.client.orchestration import get_client
    from prefect.deployments import run_deployment
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from farmflow.deployments import deploy

    api_url, env, server_log = server
    pool = "concurrent-cpu"
    overrides = [f"store.uri={tmp_path / 'store'}", f"execution.cpu_pool={pool}", "execution.unresponsive_after_s=null"]
    worker_log = tmp_path / "worker.log"
    since = server_log.stat().st_size
    with temporary_settings({PREFECT_API_URL: api_url}):
        deploy("synthetic-micro", overrides)
        worker = prefect_cli(
            "worker",
            "start",
            "--pool",
            pool,
            "--limit",
            "3",
            env=env | {"PREFECT_WORKER_QUERY_SECONDS": "1"},
            log=worker_log,
        )
        try:
            seeds = (1, 2, 3)  # three different comparisons, sharing the store
            runs = [
                run_deployment(
                    "compare/farmflow",
                    timeout=0,
                    parameters={
                        "methods": ["best_of_n"],
                        "overrides": overrides + [f"best_of_n.seed={s}", f"sft.seed={s}"],
                    },
                )
                for s in seeds
            ]
            deadline = time.monotonic() + 420
            with get_client(sync_client=True) as client:
                while not all(client.read_flow_run(r.id).state.is_final() for r in runs):
                    assert time.monotonic() < deadline, worker_log.read_text()[-3000:]
                    time.sleep(2)
                finished = [client.read_flow_run(r.id) for r in runs]
                # when the worker took each run (Pending): a worker running them in turn takes the next only after
                # one ends; the start times (Running) add each process's imports, which a loaded machine stretches
                taken = sorted(
                    min(s.timestamp for s in client.read_flow_run_states(r.id) if s.is_pending()) for r in runs
                )
                ends = sorted(r.end_time for r in finished)
        finally:
            stop(worker)
    assert [r.state.name for r in finished] == ["Completed"] * 3, [r.state.message for r in finished]
    assert taken[-1] < ends[0]  # the three really ran at the same time
    # the runs never met a locked database, and no API request failed (an error there is what a run would see);
    # Prefect's own background writes (heartbeats, events) may lose SQLite's lock and retry (docs/orchestration.md)
    locked = [line for line in worker_log.read_text().splitlines() if "database is locked" in line.lower()]
    assert not locked, "\n".join(locked[:10])
    failed = [line for line in server_lines(server_log, since) if API_FAILED.search(line)]
    assert not failed, "\n".join(failed[:10])
