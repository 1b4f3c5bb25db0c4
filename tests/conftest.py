"""Test environment: Prefect state in a temp folder, one Prefect test harness per session."""

from __future__ import annotations

import os
import tempfile

# Before anything imports prefect: never touch ~/.prefect, no analytics.
os.environ["PREFECT_HOME"] = tempfile.mkdtemp(prefix="farmflow-prefect-")
os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("FARMFLOW_LOG_DIR", tempfile.mkdtemp(prefix="farmflow-logs-"))  # run logs of CLI runs in tests

import pytest  # noqa: E402

# The files that take longest (2 to 6 minutes each on 2 cores), first in the collection order, so a serial run starts
# them first. `make test`'s two xdist workers take one file at a time, the files with the most tests first; among
# files with as many tests they keep this order.
LONGEST_FIRST = (
    "test_orchestration_distributed.py",
    "test_smol_e2e.py",
    "test_flow.py",
    "test_schedule.py",
    "test_cli_output.py",
    "test_shutdown.py",
    "test_s3_store.py",
    "test_launch.py",
    "test_bench_harness.py",
    "test_leases.py",
    "test_rl_distributed.py",
    "test_cli_server.py",
)


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests stay together, in order


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


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one torch thread is faster, and much faster on a busy 2-core machine."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
