"""Distributed execution, the calling side: each GPU stage runs as its own flow run on the GPU work pool.

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

`farmflow.flows.distributed.stage_flow` is the other side.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import Task
from pydantic_core import to_jsonable_python

from farmflow.storage import ArtifactRef
from farmflow.tasks.core import VERSIONS, cache_key, is_complete, log


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
    """The key the stage task will compute for this config and these inputs (options such as `checkpoints` are not
    part of it)."""
    return cache_key(stage)(None, {"config": config, **inputs}).removeprefix(f"{stage}-")


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
    parameters = {
        "stage": stage,
        "store_uri": runner.store_uri,
        "config": to_jsonable_python(config),
        "inputs": refs,
        "options": options,
        "label": label,
        "launcher": launcher,
    }
    name = f"{label.replace(' ', ':')}/{runner.preset or 'custom'}/{key[:8]}"
    for attempt in range(ex.retries + 1):
        log("%s: sent to pool %s as flow run %s", label, ex.gpu_pool, name)
        try:
            child = run_deployment(
                ex.stage_deployment,
                parameters=parameters,
                flow_run_name=name,
                poll_interval=ex.poll_seconds,
                timeout=None,
            )
        except ObjectNotFound:
            raise StageRunError(
                f"stage {label}: deployment {ex.stage_deployment!r} is not registered on this Prefect API "
                "(execution.mode is 'distributed': run `farmflow deploy` against the server first)"
            ) from None
        state = child.state
        if state is not None and state.is_completed():
            break
        if state is not None and state.is_crashed() and attempt < ex.retries:
            delay = ex.retry_delay_s * 2**attempt
            log("%s: flow run %s crashed (%s); retrying in %.0fs", label, child.name, state.message, delay)
            time.sleep(delay)
            continue
        raise StageRunError(
            f"stage {label}: flow run {child.name!r} ({child.id}) of {ex.stage_deployment!r} ended "
            f"{state.name if state else 'without a state'}: {state.message if state else ''}"
        )
    ref = runner.store.get(stage, key)
    if ref is None:
        raise StageRunError(
            f"stage {label}: flow run {child.name!r} completed but the store {runner.store.root} has no "
            f"{stage}/{key} (do the workers see the same store?)"
        )
    return ref, False


WORKER_FIELDS = ("launcher", "accelerate_config", "num_processes", "retries", "retry_delay_s", "gpu_stages")
"""The calling flow's execution settings a GPU worker runs its stage with (it runs it locally: mode stays 'local')."""


def worker_execution(ex: Any) -> dict[str, Any]:
    """What `stage_flow` gets as `launcher`: the calling flow's launcher, its retries and which stages it launches."""
    return {name: to_jsonable_python(getattr(ex, name)) for name in WORKER_FIELDS}
