"""Test environment: Prefect state in a temp folder, one Prefect test harness per session."""

from __future__ import annotations

import os
import tempfile

# Before anything imports prefect: never touch ~/.prefect, no analytics.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="farmflow-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("FARMFLOW_LOG_DIR", tempfile.mkdtemp(prefix="farmflow-logs-"))  # run logs of CLI runs in tests
# One compute thread in this process and in every process it starts (flow runs, workers, launched children): the
# suite runs two workers on two cores, and a process's second torch thread spins on the core the other worker needs.
# Beside one busy process, 200 steps of synthetic-micro's SFT took 32 s (39 CPU-s) with two threads and 14 s with one;
# alone, 14 s and 16 s: the tiny models' matrices gain little from a second thread.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

# `make test` hands whole files to two xdist workers (--dist loadfile) in this order (--no-loadscope-reorder): the
# long files first, so that none is left running alone at the end. The distributed-mode tests, the SmolLM2 run and
# the schedule tests take 4-8 min each on 2 cores (process start-up, servers and model compute), the next files 2-4
# min. xdist gives a worker its next file while the current one still has two tests to go, so the short files at the
# head go to whichever worker asks first; in two suite runs of 2026-11-30 the two workers ended 0.2 min apart (26.8 and
# 27.0 min) and together (23.9 min). The remaining files follow, those with the most tests first.
LONG_FILES_FIRST = (
    "test_orchestration_distributed.py",
    "test_cli_output.py",
    "test_smol_e2e.py",
    "test_schedule.py",
    "test_flow.py",
    "test_s3_store.py",
    "test_launch.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    count: dict = {}
    for item in items:
        count[item.path] = count.get(item.path, 0) + 1
    # stable: a file's tests stay together, in their order
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -count[item.path], str(item.path)))


@pytest.fixture(scope="session")
def prefect_harness():
    """A real (temporary) Prefect API for flow tests; entered once (~15 s)."""
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def micro_config(tmp_path):
    """The synthetic-micro preset with a fresh store in tmp_path."""
    from farmflow.config import load_config

    return load_config("synthetic-micro", [f"store.uri={tmp_path / 'store'}"])


from s3_server import s3_server, s3_uri  # noqa: E402,F401 - a real S3 server (moto) on 127.0.0.1


@pytest.fixture(scope="session")
def postgres():
    """A private PostgreSQL cluster on 127.0.0.1 (tests/postgres.py), started on first use (~2 s); the tests that need
    one are skipped on a machine without Debian's postgresql package (.ci/run installs it)."""
    from postgres import installed, postgres_cluster

    if not installed():
        pytest.skip("needs PostgreSQL's binaries (Debian's postgresql package; CI installs it)")
    with postgres_cluster() as cluster:
        yield cluster
