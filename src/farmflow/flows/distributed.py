"""Distributed execution, the worker side: `stage_flow` runs one stage as its own flow run on the GPU work pool.

With ``execution.mode: distributed`` a flow's `StageRunner` sends every stage named in
``execution.gpu_stages`` to the stage deployment (``stage/gpu``) and waits for it
(`farmflow.flows.remote.run_remote`). `stage_flow` rebuilds the typed config from the task's
signature and runs the stage task, cached by its key like any local stage, through the calling
flow's launcher (inline, a child process, or `accelerate launch` over the worker's GPUs). The
store, not Prefect's result storage, is what both sides share.
"""

from __future__ import annotations

from typing import Any, get_type_hints

from prefect import flow
from pydantic import TypeAdapter

from farmflow.config import ExecutionConfig
from farmflow.flows.remote import StageRunError, run_remote, stage_key_of, stage_tasks, worker_execution
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef


@flow(name="stage", log_prints=True)  # run name: given by run_remote (label/preset/key)
def stage_flow(
    stage: str,
    store_uri: str,
    config: Any = None,
    inputs: dict[str, ArtifactRef] | None = None,
    options: dict[str, Any] | None = None,
    label: str | None = None,
    launcher: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stage in its own process (what the GPU pool runs in distributed mode); returns its artifact ref.

    Args:
        stage: Stage name (sft, generate, dpo, ...).
        store_uri: The artifact store both the calling flow and this worker use (a folder, or s3://... across machines).
        config: The stage's config as JSON (validated into the stage's config model).
        inputs: The stage's input artifacts (refs).
        options: Other keyword arguments of the stage task (e.g. checkpoints).
        label: Name of the stage in the calling flow (e.g. 'generate dpo').
        launcher: How the worker runs the stage: the calling flow's execution.launcher, accelerate_config,
            num_processes, retries, retry_delay_s and gpu_stages (e.g. {"launcher": "accelerate",
            "accelerate_config": "fsdp", "num_processes": 8}); None: inline with the defaults.
    """
    tasks = stage_tasks()
    if stage not in tasks:
        raise ValueError(f"unknown stage {stage!r}; known: {', '.join(sorted(tasks))}")
    task = tasks[stage]
    hints = get_type_hints(task.fn)
    unknown = sorted(set(options or {}) - set(hints) | {"store_uri", "config"} & set(options or {}))
    if unknown:
        raise ValueError(f"stage {stage!r} takes no option(s) {unknown}")
    typed = TypeAdapter(hints["config"]).validate_python(config)
    opts = {k: TypeAdapter(hints[k]).validate_python(v) for k, v in (options or {}).items()}
    execution = ExecutionConfig.model_validate(launcher or {})  # mode local: the worker runs the stage itself
    ref = StageRunner(store_uri, execution)(task, typed, label or stage, **(inputs or {}), **opts)
    return ref.model_dump(mode="json")


__all__ = ["StageRunError", "run_remote", "stage_flow", "stage_key_of", "stage_tasks", "worker_execution"]
