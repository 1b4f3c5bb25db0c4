"""Distributed execution: each GPU stage runs as its own flow run on the GPU work pool.

With ``execution.mode: distributed`` the `StageRunner` of a flow sends every stage named
in ``execution.gpu_stages`` to `run_remote`:

1. it computes the stage key, exactly as the stage task would; if the store already
   holds that artifact, nothing is sent (a cache hit costs one read of the store);
2. otherwise it triggers a flow run of the stage deployment (``stage/gpu``, `stage_flow`)
   on the GPU pool with the stage name, the store, the stage config and the input refs as
   parameters, and waits for it (`prefect.deployments.run_deployment`). A worker of
   that pool runs it in a fresh process, so the GPU memory is released when it ends;
3. it reads the committed artifact from the store (the store, not Prefect's result
   storage, is what parent and child share: a local folder on one machine, S3/MinIO
   across machines). A run that crashed (a lost worker, a killed process) is retried
   ``execution.retries`` times with backoff; a stage that failed is an error naming it.

`stage_flow` is the other side: it rebuilds the typed config from the task's signature
and runs the stage task, cached by its key like any local stage, through the calling flow's
launcher (inline, a child process, or `accelerate launch` over the worker's GPUs).
"""

from __future__ import annotations

import time
from typing import Any, get_type_hints

from prefect import Task, flow
from pydantic import TypeAdapter
from pydantic_core import to_jsonable_python

from farmflow.storage import ArtifactRef
from farmflow.tasks.core import VERSIONS, _cache_key, is_complete, log


class StageRunError(RuntimeError):
    """A stage sent to the GPU pool did not produce its artifact; the message names the stage and the flow run."""


def stage_tasks() -> dict[str, Task]:
    """Stage name → its Prefect task, for every stage declared with `stage_task`."""
    import farmflow.tasks
    import farmflow.tasks.analysis
    import farmflow.tasks.methods
    import farmflow.tasks.rl

    found = {}
    for module in (farmflow.tasks, farmflow.tasks.methods, farmflow.tasks.rl, farmflow.tasks.analysis):
        for obj in vars(module).values():
            if isinstance(obj, Task) and obj.name in VERSIONS:
                found[obj.name] = obj
    return found


def stage_key_of(stage: str, config: Any, inputs: dict[str, Any]) -> str:
    """The key the stage task will compute for this config and these inputs (options such as `checkpoints` are not part of it)."""
    return _cache_key(stage)(None, {"config": config, **inputs}).removeprefix(f"{stage}-")


def run_remote(runner, task: Task, config: Any, label: str, inputs: dict[str, Any]) -> tuple[ArtifactRef, bool]:
    """Run one stage as a flow run of the stage deployment on the GPU pool; returns (ref, cache hit)."""
    from prefect.deployments import run_deployment
    from prefect.exceptions import ObjectNotFound

    ex = runner.execution
    stage = task.name
    key = stage_key_of(stage, config, inputs)
    hit = runner.store.get(stage, key)
    if hit is not None and is_complete(stage, runner.store, hit, config):
        return hit, True
    refs = {k: v.model_dump(mode="json") for k, v in inputs.items() if isinstance(v, ArtifactRef)}
    options = {k: to_jsonable_python(v) for k, v in inputs.items() if not isinstance(v, ArtifactRef)}
    launcher = worker_execution(ex)
    parameters = {"stage": stage, "store_uri": runner.store_uri, "config": to_jsonable_python(config), "inputs": refs,
                  "options": options, "label": label, "launcher": launcher}
    name = f"{label.replace(' ', ':')}/{runner.preset or 'custom'}/{key[:8]}"
    for attempt in range(ex.retries + 1):
        log("%s: sent to pool %s as flow run %s", label, ex.gpu_pool, name)
        try:
            child = run_deployment(ex.stage_deployment, parameters=parameters, flow_run_name=name, poll_interval=ex.poll_seconds, timeout=None)
        except ObjectNotFound:
            raise StageRunError(f"stage {label}: deployment {ex.stage_deployment!r} is not registered on this Prefect API "
                                "(execution.mode is 'distributed': run `farmflow deploy` against the server first)") from None
        state = child.state
        if state is not None and state.is_completed():
            break
        if state is not None and state.is_crashed() and attempt < ex.retries:
            delay = ex.retry_delay_s * 2**attempt
            log("%s: flow run %s crashed (%s); retrying in %.0fs", label, child.name, state.message, delay)
            time.sleep(delay)
            continue
        raise StageRunError(f"stage {label}: flow run {child.name!r} ({child.id}) of {ex.stage_deployment!r} ended "
                            f"{state.name if state else 'without a state'}: {state.message if state else ''}")
    ref = runner.store.get(stage, key)
    if ref is None:
        raise StageRunError(f"stage {label}: flow run {child.name!r} completed but the store {runner.store.root} has no "
                            f"{stage}/{key} (do the workers see the same store?)")
    return ref, False


WORKER_FIELDS = ("launcher", "accelerate_config", "num_processes", "retries", "retry_delay_s", "gpu_stages")
"""The calling flow's execution settings a GPU worker runs its stage with (it runs it locally: mode stays 'local')."""


def worker_execution(ex: Any) -> dict[str, Any]:
    """What `stage_flow` gets as `launcher`: the calling flow's launcher, its retries and which stages it launches."""
    return {name: to_jsonable_python(getattr(ex, name)) for name in WORKER_FIELDS}


@flow(name="stage", log_prints=True)  # run name: given by run_remote (label/preset/key)
def stage_flow(
    stage: str, store_uri: str, config: Any = None, inputs: dict[str, ArtifactRef] | None = None,
    options: dict[str, Any] | None = None, label: str | None = None, launcher: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One stage in its own process (what the GPU pool runs in distributed mode); returns its artifact ref.

    Args:
        stage: Stage name (sft, generate, dpo, ...).
        store_uri: The artifact store both the calling flow and this worker use (a folder, or s3://... across machines).
        config: The stage's config as JSON (validated into the stage's config model).
        inputs: The stage's input artifacts (refs).
        options: Other keyword arguments of the stage task (e.g. checkpoints).
        label: Name of the stage in the calling flow (e.g. 'generate dpo').
        launcher: How the worker runs the stage: the calling flow's execution.launcher, accelerate_config, num_processes,
            retries, retry_delay_s and gpu_stages (e.g. {"launcher": "accelerate", "accelerate_config": "fsdp",
            "num_processes": 8}); None: inline with the defaults.
    """
    from farmflow.config import ExecutionConfig
    from farmflow.flows import StageRunner

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
