"""execution.report_to: a training stage's per-step metrics reach TensorBoard event files and a local MLflow store
(accelerate's trackers), run named after the stage key, with the same numbers as the store's table."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from farmflow import training_metrics
from farmflow.config import ExecutionConfig, load_config
from farmflow.storage import open_store
from farmflow.tasks.stage import launching


def event_scalars(folder: Path) -> dict[str, dict[int, float]]:
    """tag → {step: value} of every scalar in a run folder's TensorBoard event files (TFRecord framing)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    for path in folder.rglob("events.out.tfevents.*"):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                out.setdefault(v.tag, {})[event.step] = v.simple_value
    return out


@pytest.fixture(scope="module")
def farm(tmp_path_factory):
    from farmflow import tasks

    cfg = load_config("synthetic-micro", [f"store.uri={tmp_path_factory.mktemp('trackers') / 'store'}"])
    data = tasks.data_task.fn(cfg.store.uri, cfg.data)
    return cfg, data, tasks.base_model_task.fn(cfg.store.uri, cfg.model, data)


def train_sft(farm, execution: ExecutionConfig, seed: int):
    from farmflow import tasks

    cfg, data, base = farm
    with launching(execution):
        return tasks.sft_task.fn(cfg.store.uri, cfg.sft.model_copy(update={"seed": seed}), data, base)


def test_tensorboard_event_files_hold_every_step(farm, tmp_path):
    pytest.importorskip("tensorboardX")
    ref = train_sft(farm, ExecutionConfig(report_to="tensorboard", tracker_dir=str(tmp_path)), seed=11)
    run_dir = tmp_path / "tensorboard" / f"sft-{ref.key[:12]}"
    scalars = event_scalars(run_dir)
    table = training_metrics.read(open_store(farm[0].store.uri), ref).to_pylist()
    assert scalars["loss"] == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in table}
    assert set(scalars["grad_norm"]) == {r["step"] for r in table}


def test_mlflow_store_holds_the_run(farm, tmp_path):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    ref = train_sft(farm, ExecutionConfig(report_to="mlflow", tracker_dir=str(tmp_path)), seed=12)
    client = MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}")
    [run] = client.search_runs([client.get_experiment_by_name("farmflow").experiment_id])
    assert run.info.run_name == f"sft-{ref.key[:12]}"
    assert run.data.params["seed"] == "12"  # the stage's config as hyperparameters
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "loss")}
    table = training_metrics.read(open_store(farm[0].store.uri), ref).to_pylist()
    assert history == {r["step"]: pytest.approx(r["loss"], rel=1e-6) for r in table}


def test_a_stage_that_trains_nothing_starts_no_tracker_run(tmp_path):
    with training_metrics.recording(
        "data", "k" * 64, ExecutionConfig(report_to="tensorboard", tracker_dir=str(tmp_path))
    ):
        pass
    assert not (tmp_path / "tensorboard").exists()
    with training_metrics.recording(
        "sft", "k" * 64, ExecutionConfig(report_to="tensorboard", tracker_dir=str(tmp_path))
    ):
        training_metrics.recorder("sft").log(1, loss=2.0)
    assert event_scalars(tmp_path / "tensorboard" / "sft-kkkkkkkkkkkk") == {
        "loss": {1: 2.0},
        "wall_s": pytest.approx({1: 0.0}, abs=1),
    }


def test_a_tracker_without_its_package_is_one_clear_error(monkeypatch):
    import accelerate.utils

    monkeypatch.setattr(accelerate.utils, "is_wandb_available", lambda: False)
    with pytest.raises(ValueError, match=r"report_to='wandb' needs the wandb package"):
        training_metrics.open_trackers("wandb", "sft-x", "/nonexistent")
