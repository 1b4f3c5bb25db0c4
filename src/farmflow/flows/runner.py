"""Running stages: `StageRunner` runs a stage task in this process or on the GPU pool, with retries and timings.

Where a stage runs is `StageRunner`'s business (`execution.mode`): in this process (a Prefect task,
cached by its stage key, retried with backoff when it touches the network) or, for GPU stages in
distributed mode, as a flow run of the stage deployment on the GPU pool (`farmflow.flows.remote`).
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from datetime import datetime
from typing import Any

from farmflow import shutdown
from farmflow.config import ExecutionConfig
from farmflow.flows.remote import run_remote
from farmflow.storage import ArtifactRef, StoreError, open_store
from farmflow.tasks.core import is_complete, launching, log


def network_stage(stage: str, config: Any, store_uri: str) -> bool:
    """Does this stage touch the network? Every stage on an s3:// store; annotate/evaluate with API annotators."""
    return store_uri.startswith("s3://") or (
        stage in ("annotate", "evaluate") and getattr(config, "kind", None) == "api"
    )


def transient(err: BaseException | None) -> bool:
    """Is a stage's error worth a retry? Store/network errors and annotation runs with failed pairs (not a spent
    cost cap)."""
    from farmflow.annotators import AnnotationIncomplete

    if isinstance(err, AnnotationIncomplete):  # failed pairs are re-asked, judged ones come from the row cache
        return "max_cost_usd" not in str(err)  # a retry would spend the cap again
    return isinstance(err, (StoreError, ConnectionError, TimeoutError))


def _retry_condition(_task, _task_run, state) -> bool:
    return transient(state.result(raise_on_failure=False))


def retry_options(stage: str, config: Any, store_uri: str, execution: ExecutionConfig) -> dict[str, Any]:
    """Prefect task options for a stage: retries with exponential backoff on transient errors of network stages."""
    if not execution.retries or not network_stage(stage, config, store_uri):
        return {}
    return {
        "retries": execution.retries,
        "retry_delay_seconds": [execution.retry_delay_s * 2**i for i in range(execution.retries)],
        "retry_condition_fn": _retry_condition,
    }


MODEL_LOCK = threading.Lock()
"""Stages that load a model (`execution.gpu_stages`) take turns within a process: one device, and
loading Hugging Face models while another thread trains is not safe. Other stages (evaluation,
API annotation) of parallel methods overlap them."""


class StageRunner:
    """Runs stage tasks against one store and records, per stage, seconds, rows and cache hits.

    `execution` says where: in this process (Prefect task, cached by stage key, retried when
    it touches the network) or, for GPU stages in distributed mode, as a flow run of the
    stage deployment on the GPU pool (`farmflow.flows.remote`). Safe to call from
    several threads (parallel methods; model stages in this process take turns, `MODEL_LOCK`).
    """

    def __init__(self, store_uri: str, execution: ExecutionConfig | None = None, preset: str = ""):
        self.store_uri = store_uri
        self.store = open_store(store_uri)
        self.result_storage = self.store.result_storage()  # <store>/_prefect: a Path locally, a saved block on S3
        self.execution = execution or ExecutionConfig()
        self.preset = preset
        self.timings: list[dict[str, Any]] = []

    def remote(self, stage: str) -> bool:
        """Does `stage` run on the GPU pool (distributed mode) rather than in this process?"""
        return self.execution.mode == "distributed" and stage in self.execution.gpu_stages

    def __call__(self, task, config: Any, label: str | None = None, **inputs: Any) -> ArtifactRef:
        """Run `task` with `config` and keyword inputs (ArtifactRefs, plus options such as `checkpoints`)."""
        label = label or task.name
        shutdown.check(label)  # after SIGTERM/SIGINT no stage starts
        remote = self.remote(task.name)
        start = time.perf_counter()
        try:
            if remote:
                ref, cached = run_remote(self, task, config, label, inputs)
                waited = 0.0
            else:
                ref, cached, waited = self._local(task, config, inputs, start)
        except BaseException as err:
            log(
                "%s: failed after %.1fs (%s); its inputs stay cached, a rerun resumes here",
                label,
                time.perf_counter() - start,
                type(err).__name__,
            )
            raise
        seconds = time.perf_counter() - start
        where = f"pool {self.execution.gpu_pool}" if remote else "local"
        self.timings.append(
            {
                "stage": label,
                "key": ref.key,
                "seconds": seconds,
                "waited_seconds": waited,
                "cached": cached,
                "rows": ref.rows,
                "where": where,
            }
        )
        size = f"{ref.rows} rows" if ref.rows is not None else f"{ref.format} model"
        queued = f" ({waited:.1f}s of it waiting for another model stage)" if waited >= 0.05 else ""
        log(
            "%s: %s, %s, %.1fs%s, key %s (%s)",
            label,
            "cache hit" if cached else "ran",
            size,
            seconds,
            queued,
            ref.key[:12],
            where,
        )
        return ref

    def _local(self, task, config: Any, inputs: dict[str, Any], start: float) -> tuple[ArtifactRef, bool, float]:
        """(ref, cached, seconds spent waiting for MODEL_LOCK before running)."""
        model = task.name in self.execution.gpu_stages
        with MODEL_LOCK if model else nullcontext():
            waited = time.perf_counter() - start if model else 0.0
            shutdown.check(task.name)  # the stop came while this stage waited for another model stage
            return *self._run_task(task, config, inputs, start), waited

    def _run_task(self, task, config: Any, inputs: dict[str, Any], start: float) -> tuple[ArtifactRef, bool]:
        options = retry_options(task.name, config, self.store_uri, self.execution)
        bound = task.with_options(result_storage=self.result_storage, **options)
        with launching(self.execution):  # GPU stages in a child process when execution.launcher says so
            state = bound(self.store_uri, config, return_state=True, **inputs)
            ref: ArtifactRef = state.result()
            if not self.store.exists(ref) or not is_complete(task.name, self.store, ref, config):
                # Prefect remembered a result the store no longer has, or one without what this config asks for
                state = bound.with_options(refresh_cache=True)(self.store_uri, config, return_state=True, **inputs)
                ref = state.result()
        started = time.time() - (time.perf_counter() - start)
        return ref, state.name == "Cached" or _created_before(ref, started)


def _created_before(ref: ArtifactRef, epoch: float) -> bool:
    return datetime.fromisoformat(ref.created).timestamp() < epoch
