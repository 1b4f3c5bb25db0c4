"""Per-step training metrics: what every training loop records, what the store keeps, what trackers receive.

A loop asks for the recorder of the stage it runs in and logs one row per optimizer step::

    rec = recorder("sft")
    for step in ...:
        ...
        rec.log(step + 1, epoch=..., loss=loss, tokens=tokens_this_step, **rt.stats, accuracy=...)

`Recorder.log` adds the cumulative tokens seen, the wall time since the stage started (carried
over a resume) and the tokens per second of the step; ``rt.stats`` (`farmflow.models.runtime.Runtime.step`)
gives the learning rate of the step and the gradient norm that clipping measured. Any other
keyword is the method's own figure (DPO's margin, PPO's KL, ...); a row with ``split="val"``
holds validation figures.

The stage (`farmflow.tasks.stage.run_stage`) opens the recorder with `recording`, and its commit
writes the rows as ``training_metrics.parquet`` into the artifact (`FILE`, `write`); the
artifact's metric ``logged_steps`` says it has one, and `farmflow sql`'s ``training_metrics``
view unions them over all stages. Checkpoints keep the rows (`farmflow.models.checkpoint`
saves `Recorder.state` and gives it back to `Recorder.resume`), so a resumed stage's table has
every step once. A loop run outside a stage gets a recorder that only keeps its rows.

Trackers (``execution.report_to``): accelerate's tracker classes (the ones
``Accelerator(log_with=...)`` builds), started with the stage and its key as the run name
(``<stage>-<key[:12]>``) and fed every row (`open_trackers`); TensorBoard event files under
``<tracker_dir>/tensorboard/``, a local MLflow store in ``<tracker_dir>/mlflow/`` (``mlflow.db``,
SQLite: MLflow's plain-folder store is in maintenance mode; MLFLOW_TRACKING_URI overrides it), wandb
under ``<tracker_dir>/wandb/`` (``WANDB_MODE=offline`` for no account). Only the main process
writes (accelerate's trackers check it themselves).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Iterator, Sequence

import pyarrow as pa
import pyarrow.parquet as pq

logger = logging.getLogger("farmflow")

FILE = "training_metrics.parquet"
"""The metrics table's file name in a model artifact's model folder."""
ROWS_METRIC = "logged_steps"
"""Artifact metric: rows of its metrics table (present only when it has one)."""
FIXED = [
    ("step", pa.int64()),
    ("epoch", pa.float64()),
    ("split", pa.string()),
    ("tokens", pa.int64()),
    ("wall_s", pa.float64()),
    ("loss", pa.float64()),
    ("lr", pa.float64()),
    ("grad_norm", pa.float64()),
    ("tokens_per_s", pa.float64()),
]
"""The columns every stage's table has (null where a stage has no such figure), in this order; the method's own
figures follow as float64 columns in name order."""
REPORT_TO = ("none", "tensorboard", "mlflow", "wandb")
REPORT_ENV, TRACKER_DIR_ENV = "FARMFLOW_REPORT_TO", "FARMFLOW_TRACKER_DIR"
"""Environment variables that carry execution.report_to and tracker_dir into a launched child process."""

_START_LOCK = threading.Lock()
_CURRENT: ContextVar["Recorder | None"] = ContextVar("farmflow_recorder", default=None)


def _number(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)  # a 0-d tensor too (the one host sync of the step's figures)
    return value if math.isfinite(value) else None


class Recorder:
    """The rows of one training stage (`log`), its trackers, and what a checkpoint keeps (`state`/`resume`)."""

    def __init__(self, stage: str, key: str = "", trackers: Sequence[Any] = (), open: Any = None) -> None:
        self.stage, self.key, self.trackers = stage, key, list(trackers)
        self.open = open  # called at the first row: the trackers (a stage that trains nothing starts none)
        self.rows: list[dict[str, Any]] = []
        self.started = self.last = time.perf_counter()
        self.offset_s = 0.0  # wall time of the steps before a resume
        self.tokens: int | None = None  # None: the loop counts no tokens

    def log(
        self,
        step: int,
        *,
        epoch: float | None = None,
        loss: Any = None,
        lr: Any = None,
        grad_norm: Any = None,
        tokens: Any = None,
        split: str = "train",
        **figures: Any,
    ) -> dict[str, Any]:
        """Record step `step` (1-based: the optimizer steps completed); `tokens` are this step's. Returns the row."""
        now = time.perf_counter()
        row: dict[str, Any] = {"step": int(step), "epoch": _number(epoch), "split": split}
        if tokens is not None and split == "train":
            self.tokens = (self.tokens or 0) + int(tokens)
        row["tokens"] = self.tokens if split == "train" else None
        row["wall_s"] = self.offset_s + now - self.started
        row |= {"loss": _number(loss), "lr": _number(lr), "grad_norm": _number(grad_norm)}
        row["tokens_per_s"] = int(tokens) / max(now - self.last, 1e-9) if tokens is not None else None
        row |= {k: _number(v) for k, v in figures.items()}
        self.last = now  # a val row follows its measurement: the next step's rate leaves that time out
        self.rows.append(row)
        if self.open is not None:
            self.trackers, self.open = self.open(), None
        values = {
            (k if split == "train" else f"{split}/{k}"): v
            for k, v in row.items()
            if k not in ("step", "split") and v is not None
        }
        for tracker in self.trackers:
            tracker.log(values, step=int(step))
        return row

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (JSON): the rows so far."""
        return {"rows": self.rows, "tokens": self.tokens}

    def resume(self, step: int, state: dict[str, Any] | None) -> None:
        """Continue from a checkpoint at `step`: its rows (none after `step`), tokens and wall time."""
        if not state:
            return
        self.rows = [r for r in state.get("rows", []) if r["step"] <= step]
        self.tokens = state.get("tokens")
        self.offset_s = max((r["wall_s"] for r in self.rows), default=0.0)
        self.started = self.last = time.perf_counter()

    def table(self) -> pa.Table:
        """The rows as a table: the `FIXED` columns, then the method's figures (float64) by name."""
        names = sorted({k for r in self.rows for k in r} - {n for n, _ in FIXED})
        schema = pa.schema(FIXED + [(n, pa.float64()) for n in names])
        return pa.Table.from_pylist([{n: r.get(n) for n in schema.names} for r in self.rows], schema=schema)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.finish()
        self.trackers = []


def recorder(stage: str) -> Recorder:
    """The recorder of the stage this loop runs in; outside a stage, a fresh one that only keeps its rows."""
    return _CURRENT.get() or Recorder(stage)


def current() -> Recorder | None:
    """The recorder of the running stage, if any (checkpoints save and restore its state)."""
    return _CURRENT.get()


@contextmanager
def recording(stage: str, key: str, execution: Any = None, config: Any = None) -> Iterator[Recorder]:
    """Open a stage's recorder (and its trackers, from `execution` or the environment) for the block."""
    report_to = getattr(execution, "report_to", None) or os.environ.get(REPORT_ENV, "none")
    tracker_dir = getattr(execution, "tracker_dir", None) or os.environ.get(TRACKER_DIR_ENV) or ".farmflow/trackers"
    if report_to not in REPORT_TO:
        raise ValueError(f"execution.report_to must be one of {', '.join(REPORT_TO)}, got {report_to!r}")
    rec = Recorder(stage, key, open=lambda: open_trackers(report_to, f"{stage}-{key[:12]}", tracker_dir, config))
    token = _CURRENT.set(rec)
    try:
        yield rec
    finally:
        _CURRENT.reset(token)
        rec.close()


def tracker_env(execution: Any) -> dict[str, str]:
    """Environment variables that give a launched child the parent's trackers."""
    if execution is None:
        return {}
    return {REPORT_ENV: execution.report_to, TRACKER_DIR_ENV: str(Path(execution.tracker_dir).absolute())}


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    """A config as flat ``a.b`` keys with scalar values (what trackers take as hyperparameters)."""
    if hasattr(config, "model_dump"):
        config = config.model_dump(mode="json")
    if not isinstance(config, dict):
        return {prefix.rstrip("."): config} if prefix else {}
    out: dict[str, Any] = {}
    for k, v in config.items():
        if isinstance(v, dict) or hasattr(v, "model_dump"):
            out |= _flat(v, f"{prefix}{k}.")
        elif isinstance(v, (bool, int, float, str)):
            out[f"{prefix}{k}"] = v
        elif v is not None:
            out[f"{prefix}{k}"] = str(v)
    return out


def open_trackers(report_to: str, run_name: str, tracker_dir: str | os.PathLike, config: Any = None) -> list[Any]:
    """Started accelerate trackers for ``execution.report_to`` (none: no tracker), with `config` as hyperparameters."""
    if report_to in (None, "", "none"):
        return []
    if report_to not in REPORT_TO:
        raise ValueError(f"execution.report_to must be one of {', '.join(REPORT_TO)}, got {report_to!r}")
    from accelerate.tracking import MLflowTracker, TensorBoardTracker, WandBTracker
    from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

    available = {"tensorboard": is_tensorboard_available, "mlflow": is_mlflow_available, "wandb": is_wandb_available}
    package = {"tensorboard": "tensorboardX (or tensorboard)", "mlflow": "mlflow-skinny (or mlflow)", "wandb": "wandb"}
    if not available[report_to]():
        raise ValueError(
            f"execution.report_to={report_to!r} needs the {package[report_to]} package: "
            "pip install 'farmflow[trackers]'"
        )
    root = Path(tracker_dir).absolute() / report_to
    root.mkdir(parents=True, exist_ok=True)
    if report_to == "tensorboard":
        tracker = TensorBoardTracker(run_name, root)
    elif report_to == "mlflow":
        import mlflow

        mlflow.set_tracking_uri(os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root / 'mlflow.db'}")
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME", "farmflow")
        tracker = MLflowTracker(experiment, logging_dir=str(root / "artifacts"), run_name=run_name)
    else:
        tracker = WandBTracker(run_name, project=os.environ.get("WANDB_PROJECT", "farmflow"), dir=str(root))
    with _START_LOCK:  # start() imports the backend: a first import racing in two threads fails in one of them
        tracker.start()
    hparams = _flat(config)
    if hparams:
        tracker.store_init_configuration(hparams)
    return [tracker]


class Pairs:
    """One step's chosen/rejected scores of preference pairs → accuracy, margin and the mean of each (the reward
    model's scores, DPO's implicit rewards β·(log π − log π_ref))."""

    def __init__(self) -> None:
        self.chosen: list[Any] = []
        self.rejected: list[Any] = []

    def add(self, chosen: Any, rejected: Any) -> None:
        self.chosen.append(chosen.detach().float().reshape(-1))
        self.rejected.append(rejected.detach().float().reshape(-1))

    def add_preferred(self, score_1: Any, score_2: Any, preference: Any) -> None:
        """Scores of output_1 and output_2 with the preference (1: output_1, 2: output_2); ties (1.5) left out."""
        p = preference.to(score_1.device).reshape(-1)
        keep, second = p != 1.5, p > 1.5
        self.add(score_2.where(second, score_1)[keep], score_1.where(second, score_2)[keep])

    def figures(self, reduce: Any = float) -> dict[str, float]:
        """The step's figures (`reduce` sums a number over processes, e.g. `Runtime.sum`); starts the next step."""
        if not self.chosen:
            return {}
        import torch

        c, r = torch.cat(self.chosen), torch.cat(self.rejected)
        self.chosen, self.rejected = [], []
        n = reduce(float(c.numel()))
        sums = {
            "accuracy": (c > r).float().sum(),
            "margin": (c - r).sum(),
            "chosen_reward": c.sum(),
            "rejected_reward": r.sum(),
        }
        return {k: reduce(float(v)) / n for k, v in sums.items()} if n else {}


def reward_quantiles(scores: Any, bins: int) -> dict[str, float]:
    """Mean reward of each of `bins` equal quantile bins of a rollout's scores (``reward_q1`` lowest), Quark's
    figures."""
    ordered = sorted(float(s) for s in scores)
    n = len(ordered)
    out = {}
    for b in range(bins):
        part = ordered[b * n // bins : (b + 1) * n // bins]
        out[f"reward_q{b + 1}"] = sum(part) / len(part) if part else float("nan")
    return out


def write(rec: Recorder | None, folder: Path, metrics: dict[str, float]) -> None:
    """Write the recorder's rows into `folder` (a model artifact's model folder), noting their count in `metrics`."""
    if rec is None or not rec.rows:
        return
    pq.write_table(rec.table(), Path(folder) / FILE)
    metrics[ROWS_METRIC] = float(len(rec.rows))


def read(store: Any, ref: Any) -> pa.Table | None:
    """A committed stage's metrics table (None when it has none)."""
    if not (ref.metrics or {}).get(ROWS_METRIC):
        return None
    return pq.read_table(pa.BufferReader(store.read_file(ref, f"model/{FILE}")))
