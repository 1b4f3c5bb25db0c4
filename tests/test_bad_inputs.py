"""Every bad input of the table in bench/chaos/inputs.py fails in one clear line with no traceback, before any work.

In this process (the chaos suite, `make chaos`, runs the same table as real processes): a case that got past the
checks would start a flow, which `run_flow` refuses here, so it fails the test instead of running.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench package beside tests/

from bench.chaos.inputs import CASES, expand, judge, make_files  # noqa: E402
from farmflow.cli import app  # noqa: E402

SUBPROCESS_ONLY = {
    "model that is not available",  # these two ask the Hugging Face Hub (slow offline)
    "unknown model to get",
    "Prefect API that does not answer",  # Prefect's settings are read once per process
}


@pytest.fixture
def no_flows(monkeypatch, tmp_path):
    import farmflow.cli.runs as runs

    def refuse(*args, **kwargs):
        raise AssertionError("a bad input got past the checks: the flow would have started")

    monkeypatch.setattr(runs, "run_flow", refuse)
    monkeypatch.setattr(runs, "start_temporary_api", lambda: lambda: None)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("FARMFLOW_LOG_DIR", str(tmp_path / "logs"))
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "chaos-test")  # an unreachable endpoint, not a credentials lookup
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "chaos-test")
    monkeypatch.delenv("FARMFLOW_STORE", raising=False)
    monkeypatch.chdir(tmp_path)


def test_the_table_has_at_least_40_cases():
    assert len(CASES) >= 40 and len({what for what, _, _ in CASES}) == len(CASES)


@pytest.mark.parametrize("what,argv,env", [c for c in CASES if c[0] not in SUBPROCESS_ONLY], ids=lambda v: str(v)[:40])
def test_a_bad_input_fails_in_one_line(what, argv, env, tmp_path, no_flows):
    make_files(tmp_path / "in")
    result = CliRunner().invoke(app, expand(argv, tmp_path / "in"), env=env)
    raised = result.exception if not isinstance(result.exception, SystemExit) else None
    ok, seen = judge(result.exit_code, result.stdout, result.stderr + (f"Traceback: {raised!r}" if raised else ""))
    assert ok, f"{what}: rc {result.exit_code}, stderr {result.stderr!r}, raised {raised!r}"
    assert "got past the checks" not in seen


def test_reading_a_store_that_does_not_exist_creates_nothing(tmp_path, no_flows):
    missing = tmp_path / "not" / "there"
    for argv in (["annotations", "reparse"], ["artifacts", "ls"], ["sql", "SELECT 1"], ["leaderboard"], ["history"]):
        result = CliRunner().invoke(app, [*argv, "--store", str(missing)])
        assert result.exit_code == 1 and "does not exist" in result.stderr, (argv, result.stderr)
    assert not (tmp_path / "not").exists()


def test_an_unwritable_output_fails_before_any_annotation(tmp_path, no_flows, monkeypatch):
    import farmflow.annotators as annotators

    def never(*args, **kwargs):
        raise AssertionError("annotated before checking --output")

    monkeypatch.setattr(annotators, "annotate", never)
    make_files(tmp_path / "in")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "out.json").mkdir()  # a folder where the file should go: not writable as a file
    result = CliRunner().invoke(
        app, ["annotate", str(tmp_path / "in" / "pairs.json"), "--output", str(tmp_path / "ro" / "out.json")]
    )
    assert result.exit_code == 2 and "is a folder" in result.stderr, result.stderr
