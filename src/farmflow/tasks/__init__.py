"""Prefect tasks: one per stage, each a thin wrapper around plain functions.

Every stage task takes the store URI, the config that determines its output and the
`ArtifactRef`s of its inputs. It

1. computes the stage key (stage name, code version, config, input keys);
2. returns the committed artifact if the store already has that key;
3. otherwise loads its inputs, calls one plain function, commits one artifact.

The stages are declared once in `farmflow.tasks.registry.STAGES`; steps 1-3 are `farmflow.tasks.stage.stage_task`;
the stage functions are in `pipeline` (the shared upstream), `methods`, `rl` (PPO, Quark) and `analysis`.
`EXECUTED` counts, per stage, how often step 3 actually ran in this process.
"""

from farmflow.tasks import core, rl  # noqa: F401 (farmflow.tasks.core, farmflow.tasks.rl as attributes)
from farmflow.tasks.analysis import leaderboard_task, overoptimization_task, proxy_reward_task, reward_report_task
from farmflow.tasks.core import EXECUTED, TASKS, VERSIONS, config_get, log, lookup
from farmflow.tasks.methods import (
    CANDIDATES,
    TRAINED_ON_PAIRS,
    best_of_n_prefix_task,
    best_of_n_rescore_task,
    best_of_n_task,
    dpo_task,
    expert_iteration_task,
    feedme_task,
    reference_logps_task,
    reward_conditioning_task,
)
from farmflow.tasks.pipeline import (
    annotate_task,
    base_model_task,
    data_task,
    evaluate_task,
    generate_task,
    heldout_accuracies,
    reward_model_summary,
    sample_pairs_task,
    sft_snapshot,
    sft_task,
    train_reward_task,
    write_task,
)
from farmflow.tasks.registry import STAGES, Stage, generate_config
from farmflow.tasks.stage import stage_task

__all__ = [
    "CANDIDATES",
    "EXECUTED",
    "STAGES",
    "Stage",
    "TASKS",
    "TRAINED_ON_PAIRS",
    "VERSIONS",
    "annotate_task",
    "base_model_task",
    "best_of_n_prefix_task",
    "best_of_n_rescore_task",
    "best_of_n_task",
    "config_get",
    "data_task",
    "dpo_task",
    "evaluate_task",
    "expert_iteration_task",
    "feedme_task",
    "generate_config",
    "generate_task",
    "write_task",
    "heldout_accuracies",
    "reward_model_summary",
    "leaderboard_task",
    "log",
    "lookup",
    "overoptimization_task",
    "proxy_reward_task",
    "reference_logps_task",
    "reward_conditioning_task",
    "reward_report_task",
    "sample_pairs_task",
    "sft_snapshot",
    "sft_task",
    "stage_task",
    "train_reward_task",
]
