"""The plumbing every stage task shares: stage keys, store lookups, execution counts.

A stage module declares its tasks with ``@stage_task("name", version="1")`` and starts
each task body with ``store, key, hit = lookup("name", store_uri, config, **inputs)``:
on a hit it returns the committed ref, otherwise it computes and commits one artifact
under ``key``. Bump a stage's version whenever its code changes what it produces.

Where a GPU stage runs is decided here too, in one place: inside `launching(execution)`
(the flows' `StageRunner` enters it), a stage named in ``execution.gpu_stages`` with
``execution.launcher`` 'process' or 'accelerate' runs in a child process
(`farmflow.tasks.launch`) and its outputs are committed here; the stage key is the same.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections import Counter
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

from prefect import task
from pydantic import BaseModel

from farmflow.annotators import judges_key
from farmflow.config import AnnotatorConfig, ModelConfig
from farmflow.modelcache import model_files_key
from farmflow.models.checkpoint import Checkpointer
from farmflow.progress import log  # noqa: F401 (re-exported: the stages log through it)
from farmflow.storage import ArtifactRef, LocalStore, open_store, part_key, stage_key

EXECUTED: Counter[str] = Counter()
"""Per stage, how often its computation actually ran in this process (tests count these)."""
_EXECUTED_LOCK = threading.Lock()  # methods run in parallel threads (farmflow.flows.fan_out)

VERSIONS: dict[str, str] = {}
"""Stage name → code version, filled by `stage_task`; part of every stage key."""

TASKS: dict[str, Any] = {}
"""Stage name → its Prefect task, filled by `stage_task` (`load_stage_modules` imports them all)."""

KEY_EXTRA: dict[type, Callable[[Any], dict]] = {
    ModelConfig: lambda cfg: model_files_key(cfg.pretrained),
    AnnotatorConfig: judges_key,
}
"""Config type → what its fields alone do not pin down, added to its part of a stage key: a local model folder's
contents, each judge's identity (e.g. an endpoint from the environment, the prompt version)."""

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


def load_stage_modules() -> None:
    """Import every module that declares stage tasks, so `TASKS` knows them all."""
    import farmflow.tasks  # noqa: F401
    import farmflow.tasks.analysis  # noqa: F401
    import farmflow.tasks.methods  # noqa: F401
    import farmflow.tasks.rl  # noqa: F401


def key_config(config: Any) -> Any:
    """The part of a stage config that determines its output.

    Fields declared with ``json_schema_extra={"stage_key": False}`` (how many requests in
    flight, timeouts, prices, where a secret lives...) are left out, at any depth, so
    changing them never invalidates a stage or anything downstream of it. Pydantic models
    are validated again first: ``model_copy(update=...)`` skips validation, and an int
    left in a float field must not make a different key than the validated float.
    """
    if isinstance(config, BaseModel):
        config = type(config).model_validate(config.model_dump())
    return _key_part(config)


def _key_part(config: Any) -> Any:
    if isinstance(config, BaseModel):
        out = {}
        for name, field in type(config).model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            if extra.get("stage_key", True):
                out[name] = _key_part(getattr(config, name))
        derived = KEY_EXTRA.get(type(config))
        return out | (derived(config) if derived else {})
    if isinstance(config, dict):
        return {k: key_config(v) if isinstance(v, BaseModel) else _key_part(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [_key_part(v) for v in config]
    return config


def _inputs(params: dict[str, Any]) -> dict[str, ArtifactRef]:
    return {k: v for k, v in params.items() if isinstance(v, ArtifactRef)}


COMPLETE: dict[str, Callable[[Any, ArtifactRef, Any], bool]] = {}
"""Stage → (store, committed ref, config) → does that artifact hold all this config asks for (`stage_task(complete=...)`)."""


def is_complete(stage: str, store: Any, ref: ArtifactRef, config: Any) -> bool:
    """A committed artifact serves `config` unless the stage says something it asks for is missing (e.g. PPO snapshots)."""
    return stage not in COMPLETE or COMPLETE[stage](store, ref, config)


READS: dict[str, Callable[[Any], dict[str, tuple[str, ...] | None]]] = {}
"""Stage → config → {input name: the parts of that input the stage reads} (`stage_task(reads=...)`)."""


def keyed_inputs(stage: str, config: Any, inputs: dict[str, ArtifactRef]) -> dict[str, ArtifactRef | str]:
    """The inputs as the stage key sees them: an input the stage reads only parts of counts by those parts' digests.

    So SFT, which reads the data artifact's ``sft`` split, keeps its key when only the
    evaluation split changes (`farmflow.storage.part_key`).
    """
    reads = READS[stage](config) if stage in READS else {}
    return {name: part_key(ref, reads[name]) if name in reads else ref for name, ref in inputs.items()}


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a config that is a pydantic model or (from JSON) a dict."""
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)


TYPED: dict[str, Callable[[Any], Any]] = {}
"""Stage → the function that types its config when it can arrive as plain JSON (a dict config with sections inside)."""


def typed_config(stage: str, config: Any) -> Any:
    """`config` as the stage's own function sees it, so every key computed for it is the same."""
    return TYPED[stage](config) if stage in TYPED else config


def _cache_key(stage: str):
    def key_fn(_ctx: Any, params: dict[str, Any]) -> str:
        config = typed_config(stage, params["config"])
        return f"{stage}-{stage_key(stage, VERSIONS[stage], key_config(config), keyed_inputs(stage, config, _inputs(params)))}"

    return key_fn


def lookup(stage: str, store_uri: str, config: Any, **inputs: ArtifactRef) -> tuple[LocalStore, str, ArtifactRef | None]:
    """The store, the stage key and the committed artifact for it (None: compute it now)."""
    key = stage_key(stage, VERSIONS[stage], key_config(config), keyed_inputs(stage, config, inputs))
    if OUTBOX is not None:  # a launched child: the parent found no artifact; write to the outbox
        return OUTBOX, key, None
    store = open_store(store_uri)
    hit = store.get(stage, key)
    if hit is not None and not is_complete(stage, store, hit, config):
        log("%s: %s is committed without something this run asks for; computing it again", stage, key[:12])
        hit = None
    if hit is not None:
        log("%s: reusing %s from the store", stage, key[:12])
    else:
        with _EXECUTED_LOCK:
            EXECUTED[stage] += 1
    return store, key, hit


def stage_task(
    stage: str, version: str, typed: Callable[[Any], Any] | None = None,
    reads: Callable[[Any], dict[str, tuple[str, ...] | None]] | None = None,
    complete: Callable[[Any, ArtifactRef, Any], bool] | None = None, **options: Any,
):
    """A Prefect task for `stage`: cached by its stage key, result persisted as JSON.

    The task's first two parameters must be ``store_uri`` and ``config``; every
    `ArtifactRef` parameter is an input whose key enters the stage key. `typed` turns a
    config that arrived as JSON (a GPU worker's stage flow) into the typed one the stage
    uses, so operational fields inside it stay out of every key (`typed_config`).
    `reads(config)` names the parts of an input the stage reads (the data artifact's
    splits, ``()`` for none): those parts' digests replace the input's key (`keyed_inputs`).
    It must name every split the stage's body reads, or a change there would be missed.
    `complete(store, ref, config)` says whether a committed artifact holds everything an
    operational setting asks for (PPO's snapshots): if not, the stage runs again under
    the same key, adds what is missing, and the first commit of the artifact stays.
    """
    if typed is not None:
        TYPED[stage] = typed
    if reads is not None:
        READS[stage] = reads
    if complete is not None:
        COMPLETE[stage] = complete
    if VERSIONS.get(stage, version) != version:
        raise ValueError(f"stage {stage!r} declared twice with versions {VERSIONS[stage]!r} and {version!r}")
    VERSIONS[stage] = version

    def declare(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            execution = LAUNCH.get()
            if OUTBOX is not None or execution is None or execution.launcher == "inline" or stage not in execution.gpu_stages:
                return fn(*args, **kwargs)
            from farmflow.tasks.launch import run_in_child

            params = signature.bind(*args, **kwargs).arguments
            store_uri, config = params.pop("store_uri"), typed_config(stage, params.pop("config"))
            store, key, hit = lookup(stage, store_uri, config, **_inputs(params))
            return hit or run_in_child(stage, store, key, store_uri, config, params, execution)

        TASKS[stage] = task(
            name=stage, cache_key_fn=_cache_key(stage), persist_result=True, result_serializer="json",
            task_run_name=stage, **options,
        )(run)
        return TASKS[stage]

    return declare


def checkpointer(store: LocalStore, stage: str, key: str, checkpoints: Any = None) -> Checkpointer:
    """The store-backed `Checkpointer` of a stage run (`checkpoints`: a CheckpointConfig or None = off)."""
    if checkpoints is None:
        return Checkpointer(None, stage, key)
    return Checkpointer(store, stage, key, checkpoints.every_steps, checkpoints.every_seconds)


def commit_policy(
    store: LocalStore, stage: str, key: str, model, tokenizer, config: Any, inputs: dict, metrics: dict,
    ckpt: Checkpointer, extra_files: dict[str, str] | None = None,
) -> ArtifactRef:
    """Commit a trained policy (weights + tokenizer + `extra_files`) as the stage's artifact, then drop its checkpoints."""
    from farmflow.models import save

    with store.put_model(stage, key, "policy", config=config, inputs=inputs) as (folder, m):
        save(model, tokenizer, folder)
        for name, text in (extra_files or {}).items():
            (folder / name).write_text(text)
        m.update(metrics)
    ckpt.clear()
    return store.get(stage, key)
