"""Progress of long stages where nobody watches a terminal: periodic log lines, the run's Prefect logs."""

import logging

import pytest
from prefect import flow, task
from test_api_annotators import KEY, judge, make_rows, pool

from farmflow import progress as progress_module
from farmflow.annotators import annotate
from farmflow.annotators.server import JudgeConfig, JudgeServer
from farmflow.config import AnnotatorConfig
from farmflow.progress import progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = Clock()
    monkeypatch.setattr(progress_module.time, "perf_counter", fake)
    monkeypatch.delenv("FARMFLOW_PROGRESS", raising=False)
    monkeypatch.setenv("FARMFLOW_PROGRESS_EVERY_S", "30")
    return fake


def lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == "farmflow"]


def test_hidden_bar_logs_count_speed_time_left_and_latest_values(clock, caplog):
    """A hidden bar (CI, workers, `make demo > log`) still counts: a log line every 30 s, then the totals."""
    caplog.set_level(logging.INFO, logger="farmflow")
    with progress("sft", 100, unit="step") as bar:
        for _ in range(100):
            clock.now += 1.0  # one step per second
            bar.update()
            bar.set_postfix(loss=f"{1 / bar.n:.3f}")
    assert lines(caplog) == [
        "sft: 30/100 steps (30%), 1.0 steps/s, 1:10 left, loss 0.034",  # the postfix set after step 29
        "sft: 60/100 steps (60%), 1.0 steps/s, 0:40 left, loss 0.017",
        "sft: 90/100 steps (90%), 1.0 steps/s, 0:10 left, loss 0.011",
        "sft: 100 steps in 100.0s (1.0 steps/s)",
    ]


def test_resumed_loop_counts_from_its_checkpoint_and_zero_turns_lines_off(clock, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="farmflow")
    with progress("ppo", 50, unit="step", initial=40) as bar:
        for _ in range(10):
            clock.now += 4.0
            bar.update()
    assert lines(caplog) == ["ppo: 48/50 steps (96%), 0.2 steps/s, 0:08 left", "ppo: 10 steps in 40.0s (0.2 steps/s)"]
    caplog.clear()
    monkeypatch.setenv("FARMFLOW_PROGRESS_EVERY_S", "0")
    with progress("ppo", 50, unit="step") as bar:
        for _ in range(50):
            clock.now += 4.0
            bar.update()
    assert lines(caplog) == ["ppo: 50 steps in 200.0s (0.2 steps/s)"]
    monkeypatch.setenv("FARMFLOW_PROGRESS_EVERY_S", "30s")
    with pytest.raises(ValueError, match="FARMFLOW_PROGRESS_EVERY_S must be a number of seconds .*got '30s'"):
        with progress("ppo", 50):
            pass


def test_skipped_units_move_the_bar_but_not_the_rate(clock, caplog):
    """Rows a loop had no work for (repeats, cached features) count as done, like a resume's `initial`."""
    caplog.set_level(logging.INFO, logger="farmflow")
    with progress("reward: features", 100, unit="output") as bar:
        bar.skip(40)
        for _ in range(60):
            clock.now += 1.0
            bar(1)  # the bar is its own update
    assert lines(caplog) == [
        "reward: features: 70/100 outputs (70%), 1.0 outputs/s, 0:30 left",
        "reward: features: 60 outputs in 60.0s (1.0 outputs/s)",
    ]


def test_inside_a_task_run_the_lines_go_to_the_runs_prefect_logs(clock, caplog):
    caplog.set_level(logging.INFO, logger="prefect.task_runs")  # conftest sets Prefect's level to WARNING

    @task
    def loop():
        with progress("dpo", 3, unit="step") as bar:
            for _ in range(3):
                clock.now += 20.0
                bar.update()

    @flow
    def one_stage():
        loop()

    one_stage()
    ours = [(r.name, r.getMessage()) for r in caplog.records if r.getMessage().startswith("dpo:")]
    assert ours == [
        ("prefect.task_runs", "dpo: 2/3 steps (67%), 0.1 steps/s, 0:20 left"),
        ("prefect.task_runs", "dpo: 3 steps in 60.0s (0.1 steps/s)"),
    ]


def test_a_slow_loop_still_shows_its_rate(clock, caplog):
    caplog.set_level(logging.INFO, logger="farmflow")
    with progress("ppo", 3, unit="step") as bar:
        for _ in range(3):
            clock.now += 25.0  # 0.04 steps/s
            bar.update()
    assert lines(caplog) == ["ppo: 2/3 steps (67%), 0.04 steps/s, 0:25 left", "ppo: 3 steps in 75.0s (0.04 steps/s)"]


def test_with_a_terminal_bar_a_run_still_gets_its_progress_lines(clock, caplog, monkeypatch, prefect_harness):
    """The bar is for the terminal; the Prefect UI shows the run's logs, so the periodic lines go there too."""
    caplog.set_level(logging.INFO, logger="prefect.task_runs")
    monkeypatch.setenv("FARMFLOW_PROGRESS", "1")  # a bar, as on a terminal

    @task
    def loop():
        with progress("sft", 4, unit="step") as bar:
            for _ in range(4):
                clock.now += 20.0
                bar.update()
            return bar.bar is not None

    @flow
    def one_stage():
        return loop()

    assert one_stage()
    ours = [r.getMessage() for r in caplog.records if r.getMessage().startswith("sft:")]
    assert ours == ["sft: 2/4 steps (50%), 0.1 steps/s, 0:40 left", "sft: 4 steps in 80.0s (0.1 steps/s)"]


def test_annotation_reports_every_pair_cached_asked_or_oracle(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    rows = make_rows(30)
    with JudgeServer(JudgeConfig(api_key=KEY)) as url:
        cfg = pool(judge(base_url=url, batch_size=4))
        first: list[int] = []
        annotate(rows[:12], cfg, str(tmp_path), progress=first.append)
        assert sum(first) == 12 and len(first) == 1 + 3  # nothing settled without a request, then three requests of 4
        again: list[int] = []
        annotate(rows, cfg, str(tmp_path), progress=again.append)
        assert again[0] == 12 and sum(again) == 30  # the cached pairs at once, then the rest as answered
    oracle: list[int] = []
    annotate(rows, AnnotatorConfig(), progress=oracle.append)
    assert oracle == [30]
