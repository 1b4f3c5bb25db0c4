"""The plumbing every stage shares, so a stage's function holds only its work.

``@stage_task(STAGES["dpo"])`` turns a stage function into a Prefect task. The function takes a `StageRun` (store,
key, checkpointer), its config, its input `ArtifactRef`s and options, and returns what to commit: a `Table` or a
`Model`. The task takes ``store_uri`` in place of the `StageRun` and

1. computes the stage key (`farmflow.tasks.registry.Stage.key`);
2. returns the committed artifact if the store has that key (and it is complete; `Store.get` checks its files'
   sizes and quarantines a damaged one, which is then computed again here);
3. otherwise takes the stage key's lease in the store (`farmflow.storage.leases`): while another run holds it, waits
   for that run's commit and returns it (single flight: two runs needing one stage compute it once; a dead holder's
   lease expires);
4. holding the lease, counts the run (`EXECUTED`), calls the function, commits its result with the config, the
   inputs and the run's seconds, gives the memory it freed back to the system (`release_memory`), drops its
   checkpoints, releases the lease and logs the stage's summary line.

Prefect's cache key is the same stage key and the persisted result is the `ArtifactRef` as JSON, so a rerun with the
same config does not even enter the task. Options (``checkpoints``, ``batch_size``, ``backend``) are not part of the
key.

Where a GPU stage runs is decided here too: inside `launching(execution)` (the flows' `StageRunner` enters it), a
stage named in ``execution.gpu_stages`` with ``execution.launcher`` 'process' or 'accelerate' runs in a child process
(`farmflow.tasks.launch`), whose outputs are committed here under the same key.
"""

from __future__ import annotations

import ctypes
import functools
import inspect
import threading
import time
from collections import Counter, defaultdict
from contextlib import contextmanager, nullcontext
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterator

import pyarrow as pa
from prefect import task

import farmflow.tasks.launch as launch
from farmflow import curves, training_metrics
from farmflow.progress import log
from farmflow.storage import ArtifactRef, open_store
from farmflow.storage.leases import Leases, single_flight
from farmflow.tasks.registry import Stage

if TYPE_CHECKING:
    from farmflow.models.checkpoint import Checkpointer

EXECUTED: Counter[str] = Counter()
"""Per stage, how often its computation actually ran in this process (tests count these)."""
_EXECUTED_LOCK = threading.Lock()  # methods run in parallel threads (farmflow.flows.fan_out)

LAUNCH: ContextVar[Any] = ContextVar("farmflow_launch", default=None)
"""The `ExecutionConfig` whose launcher applies to the stages run in this context (None: inline)."""

OUTBOX: Any = None
"""In a child process started by the launcher: the `farmflow.tasks.launch.OutboxStore` that stages write to."""


@contextmanager
def launching(execution: Any) -> Iterator[None]:
    """Stages run inside this block follow ``execution.launcher`` (the flows' `StageRunner` wraps each stage in it)."""
    token = LAUNCH.set(execution)
    try:
        yield
    finally:
        LAUNCH.reset(token)


# --------------------------------------------------------------------- what a stage returns
@dataclass
class Table:
    """A table artifact: `table` in the `format` schema (`farmflow.storage.schemas`), plus files and tables."""

    table: pa.Table
    format: str
    metrics: dict[str, float] = field(default_factory=dict)
    extra_files: dict[str, bytes] = field(default_factory=dict)
    extra_tables: dict[str, tuple[pa.Table, str]] = field(default_factory=dict)
    parts: dict[str, str] | None = None


@dataclass
class Model:
    """A model artifact: weights and tokenizer (`farmflow.models.save`), plus text files in the model folder."""

    model: Any
    tokenizer: Any
    metrics: dict[str, float] = field(default_factory=dict)
    format: str = "policy"
    extra_files: dict[str, str] = field(default_factory=dict)


@dataclass
class StageRun:
    """What a stage function gets besides its config and inputs: store and URI, stage key, checkpointer."""

    store: Any
    store_uri: str
    stage: str
    key: str
    ckpt: Checkpointer | None = None

    def checkpointer(self, checkpoints: Any = None) -> Checkpointer:
        """The store-backed `Checkpointer` of this run (`checkpoints`: a CheckpointConfig, or None = off)."""
        from farmflow.models.checkpoint import Checkpointer  # torch: imported by the stages that train

        if checkpoints is None:
            self.ckpt = Checkpointer(None, self.stage, self.key)
        else:
            self.ckpt = Checkpointer(
                self.store, self.stage, self.key, checkpoints.every_steps, checkpoints.every_seconds
            )
        return self.ckpt

    def snapshot(self, stage: str, key: str, model: Any, tokenizer: Any, config: dict[str, float], parent: str) -> None:
        """Commit `model` mid-training as a policy artifact of `stage` under `key` (config: where in the run it was
        taken, also its metrics; `parent`: the input name under which it records this run's key), unless one is
        committed already (a resumed run passes the same point again)."""
        from farmflow.models import save

        if self.store.get(stage, key) is None:
            with self.store.put_model(stage, key, "policy", config=config, inputs={parent: self.key}) as (folder, m):
                save(model, tokenizer, folder)
                m.update({k: float(v) for k, v in config.items()})


# ------------------------------------------------------------------------------- running
def lookup(
    stage: Stage, store_uri: str, config: Any, inputs: dict[str, ArtifactRef]
) -> tuple[Any, str, ArtifactRef | None]:
    """The store, the stage key and the committed artifact for it (None: not committed yet; `claimed` decides who
    computes it)."""
    key = stage.key(config, inputs)
    if OUTBOX is not None:  # a launched child: the parent found no artifact and holds the lease; write to the outbox
        return OUTBOX, key, None
    store = open_store(store_uri)
    hit = find(stage, store, key, config, say=True)
    if hit is not None:
        log("%s: reusing %s from the store", stage.name, key[:12])
    return store, key, hit


def find(stage: Stage, store: Any, key: str, config: Any, say: bool = False) -> ArtifactRef | None:
    """The committed artifact for `key` if it serves `config`, else None (`say`: log an incomplete one; the lookup
    says it once, the single-flight checks after it do not)."""
    hit = store.get(stage.name, key)
    if hit is not None and not stage.is_complete(store, hit, config):
        if say:
            log("%s: %s is committed without something this run asks for; computing it again", stage.name, key[:12])
        hit = None
    return hit


@contextmanager
def claimed(stage: Stage, store: Any, key: str, config: Any) -> Iterator[ArtifactRef | None]:
    """Single flight: yields the artifact another run committed meanwhile (waiting while it computes it), or None when
    this run holds the stage key's lease and computes it now (counted in `EXECUTED`)."""
    if OUTBOX is not None:  # a launched child: its parent holds the lease
        leases, flight = None, nullcontext(None)
    else:
        leases = Leases(store)
        flight = single_flight(
            leases, f"stages/{stage.name}/{key}", lambda: find(stage, store, key, config), f"{stage.name} {key[:12]}"
        )
    try:
        with flight as hit:
            if hit is None:
                with _EXECUTED_LOCK:
                    EXECUTED[stage.name] += 1
            yield hit
    finally:
        if leases is not None:
            leases.close()


def run_stage(
    stage: Stage, fn: Callable[..., Table | Model], store_uri: str, config: Any, params: dict[str, Any]
) -> ArtifactRef | None:
    """Key → hit? → lease → `fn` → commit: one stage run in this process (`params`: its inputs and options).

    Returns the committed artifact (None in the processes of a launched child other than the main one)."""
    config = stage.typed_config(config)
    inputs = {k: v for k, v in params.items() if isinstance(v, ArtifactRef)}
    store, key, hit = lookup(stage, store_uri, config, inputs)
    if hit is not None:
        return hit
    with claimed(stage, store, key, config) as hit:
        if hit is not None:
            return hit
        run = StageRun(store, store_uri, stage.name, key)
        started = time.perf_counter()
        try:
            with training_metrics.recording(stage.name, key, LAUNCH.get(), config):  # the loop's per-step rows
                out = fn(run, config, **params)
                ref = commit(run, out, config, inputs, time.perf_counter() - started)
            del out
        finally:
            release_memory()
    if run.ckpt is not None:
        run.ckpt.clear()
    if stage.summary and ref is not None:  # None: a launched child's other processes, which do not write
        metrics = defaultdict(lambda: float("nan"), ref.metrics)
        log(
            "%s: %s",
            stage.name,
            stage.summary(metrics) if callable(stage.summary) else stage.summary.format_map(metrics),
        )
    return ref


def release_memory() -> None:
    """Give the memory a finished stage freed back to the system: trim glibc's heaps (``malloc_trim(0)``, about a
    millisecond).

    Why: a stage loads models of hundreds of MB and drops them when it returns (by reference count: models hold no
    reference cycles, so a garbage collection frees nothing more), but glibc keeps freed chunks in its per-thread
    heaps for reuse, and the next stage, often on another thread (`farmflow.flows.fan_out`), allocates in another
    heap. A flow of many model stages (the study's replicates with a pretrained reward model) then holds gigabytes it
    no longer uses. Elsewhere than glibc there is nothing to call."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL(None).malloc_trim  # the C library this process already has loaded
    except (AttributeError, OSError):  # not glibc (macOS, musl without it)
        return None


def commit(
    run: StageRun, out: Table | Model, config: Any, inputs: dict[str, ArtifactRef], seconds: float
) -> ArtifactRef:
    """Commit a stage function's result as the run's artifact, recording its config, inputs and metrics."""
    metrics = {**out.metrics, "seconds": seconds}
    if isinstance(out, Table):
        return run.store.put_table(
            run.stage,
            run.key,
            out.table,
            out.format,
            config=config,
            inputs=inputs or None,
            metrics=metrics,
            extra_files=out.extra_files or None,
            extra_tables=out.extra_tables or None,
            parts=out.parts,
        )
    from farmflow.models import save

    with run.store.put_model(run.stage, run.key, out.format, config=config, inputs=inputs or None) as (folder, m):
        save(out.model, out.tokenizer, folder)
        training_metrics.write(training_metrics.current(), folder, m)
        for name, text in out.extra_files.items():
            (folder / name).write_text(text)
        m.update(metrics)
    return run.store.get(run.stage, run.key)


def stage_task(stage: Stage, **options: Any):
    """Decorator: stage function ``fn(run: StageRun, config, *inputs, **options) -> Table | Model`` → Prefect task.

    The task's signature is the function's with ``store_uri: str`` in place of `run`; it is cached by the stage key
    and its result (the `ArtifactRef`) persisted as JSON.
    """

    def declare(fn: Callable[..., Table | Model]):
        signature = inspect.signature(fn)
        params = list(signature.parameters.values())
        store_uri = inspect.Parameter("store_uri", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation="str")
        task_signature = signature.replace(parameters=[store_uri, *params[1:]])

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> ArtifactRef:
            params = dict(task_signature.bind(*args, **kwargs).arguments)
            uri, config = params.pop("store_uri"), params.pop("config")
            execution = LAUNCH.get()
            if (
                OUTBOX is None
                and execution is not None
                and execution.launcher != "inline"
                and stage.name in execution.gpu_stages
            ):
                config = stage.typed_config(config)
                store, key, hit = lookup(
                    stage, uri, config, {k: v for k, v in params.items() if isinstance(v, ArtifactRef)}
                )
                if hit is not None:
                    ref = hit
                else:
                    with claimed(stage, store, key, config) as hit:
                        ref = hit or launch.run_in_child(stage.name, store, key, uri, config, params, execution)
            else:
                ref = run_stage(stage, fn, uri, config, params)
            curves.publish(uri, ref)  # in a flow run: the training curves and their summary as Prefect artifacts
            return ref

        run.__signature__ = task_signature
        run.__annotations__ = {
            "store_uri": "str",
            **{k: v for k, v in fn.__annotations__.items() if k != params[0].name},
        }
        return task(
            name=stage.name,
            cache_key_fn=cache_key(stage),
            persist_result=True,
            result_serializer="json",
            task_run_name=stage.name,
            **options,
        )(run)

    return declare


def cache_key(stage: Stage) -> Callable[[Any, dict[str, Any]], str]:
    """Prefect's cache key of a stage task: ``<stage>-<stage key>``."""

    def key_fn(_ctx: Any, params: dict[str, Any]) -> str:
        config = stage.typed_config(params["config"])
        return f"{stage.name}-{stage.key(config, {k: v for k, v in params.items() if isinstance(v, ArtifactRef)})}"

    return key_fn


def stage_function(task: Any) -> Callable[..., Table | Model]:
    """The stage function behind a stage task (what a launched child runs, without the launcher hook)."""
    return task.fn.__wrapped__
