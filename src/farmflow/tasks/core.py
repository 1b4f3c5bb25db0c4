"""Every stage task by name (`TASKS`), and the by-name helpers the flows use.

The stages' facts are in `farmflow.tasks.registry.STAGES`, the shared plumbing (key, cache hit, commit, launcher) in
`farmflow.tasks.stage`, the stage functions in `farmflow.tasks.pipeline`, `.methods`, `.rl` and `.analysis`.
"""

from __future__ import annotations

from typing import Any, Callable

from prefect import Task

import farmflow.tasks.analysis as analysis
import farmflow.tasks.methods as methods
import farmflow.tasks.pipeline as pipeline
import farmflow.tasks.preferences as preferences
import farmflow.tasks.rl as rl
from farmflow.progress import log  # noqa: F401 (re-exported: the flows log through it)
from farmflow.storage import ArtifactRef, LocalStore
from farmflow.tasks.keys import config_get, key_config  # noqa: F401 (re-exported)
from farmflow.tasks.registry import STAGES, VERSIONS  # noqa: F401 (re-exported)
from farmflow.tasks.stage import EXECUTED, LAUNCH, launching  # noqa: F401 (re-exported)
from farmflow.tasks.stage import cache_key as _stage_cache_key
from farmflow.tasks.stage import lookup as _lookup

TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        pipeline.data_task,
        pipeline.base_model_task,
        pipeline.sft_task,
        pipeline.sample_pairs_task,
        pipeline.annotate_task,
        pipeline.train_reward_task,
        preferences.human_preferences_task,
        preferences.subsample_preferences_task,
        pipeline.generate_task,
        pipeline.write_task,
        pipeline.evaluate_task,
        methods.best_of_n_task,
        methods.best_of_n_prefix_task,
        methods.best_of_n_rescore_task,
        *methods.TRAINED_ON_PAIRS.values(),
        methods.reference_logps_task,
        methods.dpo_task,
        methods.expert_iteration_task,
        rl.ppo_task,
        rl.quark_task,
        analysis.proxy_reward_task,
        analysis.overoptimization_task,
        analysis.reward_report_task,
    )
}
"""Stage name → its Prefect task: one per entry of `STAGES`."""


def cache_key(stage: str) -> Callable[[Any, dict[str, Any]], str]:
    """Prefect's cache key function of the stage task `stage` (``<stage>-<stage key>``)."""
    return _stage_cache_key(STAGES[stage])


def typed_config(stage: str, config: Any) -> Any:
    """`config` as the stage's own function sees it, so every key computed for it is the same."""
    return STAGES[stage].typed_config(config)


def keyed_inputs(stage: str, config: Any, inputs: dict[str, ArtifactRef]) -> dict[str, ArtifactRef | str]:
    """The inputs as the stage key sees them (`farmflow.tasks.registry.Stage.keyed_inputs`)."""
    return STAGES[stage].keyed_inputs(config, inputs)


def is_complete(stage: str, store: Any, ref: ArtifactRef, config: Any) -> bool:
    """A committed artifact serves `config` unless the stage says something it asks for is missing (PPO snapshots)."""
    return STAGES[stage].is_complete(store, ref, config) if stage in STAGES else True


def lookup(
    stage: str, store_uri: str, config: Any, **inputs: ArtifactRef
) -> tuple[LocalStore, str, ArtifactRef | None]:
    """The store, the stage key and the committed artifact for it (None: it would be computed now)."""
    return _lookup(STAGES[stage], store_uri, typed_config(stage, config), inputs)
