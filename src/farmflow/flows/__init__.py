"""Prefect flows: they only wire stage tasks together (see `farmflow.tasks`).

Every flow runs the shared upstream stages (`Upstream`: data → base model → SFT →
pairs → annotation → reward model, each only when a method needs it), then its
method's stages (`method_outputs`), generation on the evaluation set, evaluation of the
method and of the baselines (untrained, SFT) against the reference outputs, and one
leaderboard. There is one flow per method of `farmflow.config.METHODS` (`best_of_n_flow`, `dpo_flow`, ...), all
made by `method_flow` from one function, and `compare_flow`, which runs any list of methods over the same upstream
artifacts, the methods in parallel (`fan_out`, `execution.max_parallel_methods`),
and ends with the over-optimization curve. Every run appends its leaderboard to the store's
``runs`` table; the nightly deployment (``history``) also publishes the trend across runs.

Every flow takes the run form's parameters (`farmflow.flows.form`): a preset, the common knobs,
overrides and the whole config as ``advanced``; `run_config` turns them into the farm config.

Where a stage runs is `StageRunner`'s business (`execution.mode`): in this process, or,
for GPU stages in distributed mode, as a flow run on the GPU work pool
(`farmflow.flows.remote`, `farmflow.flows.distributed`). Stages that touch the network are
retried with backoff.

Every stage is cached by its stage key: a rerun with the same config executes nothing;
a changed hyperparameter reruns only the stages downstream of it (e.g. `best_of_n.n`:
best-of-n and its evaluation).

Prefect's result records (the persisted `ArtifactRef`s) are kept inside the store under
``_prefect/``, so wiping the store also wipes Prefect's cache, and a cached ref whose
artifact has disappeared from the store is recomputed instead of trusted.

Modules: `form` (parameters → config), `runner` (running one stage), `remote` and
`distributed` (stages on the GPU pool), `pipeline` (upstream, methods, fan-out), `record`
(runs table, history), `methods` (the method and compare flows), `replicates` (a comparison under K seeds, the
leaderboard with intervals), `overoptimization`, `reward_report`, `study` (the validation study).
"""

from farmflow.config import METHODS
from farmflow.flows.form import MethodName, PresetName, deployment_parameters, run_config
from farmflow.flows.methods import FLOWS, METHOD_FLOWS, compare_flow, method_flow, run_methods
from farmflow.flows.pipeline import (
    BASELINES,
    PREFERENCE_METHODS,
    REWARD_METHODS,
    Upstream,
    best_of_n_outputs,
    config_key,
    fan_out,
    generate_outputs,
    method_label,
    method_outputs,
    round_seed,
    shared_upstream,
)
from farmflow.flows.record import HISTORY_RUNS, history_task, publish_curve, record_run_task
from farmflow.flows.runner import MODEL_LOCK, StageRunner, network_stage, retry_options, transient

__all__ = [
    "BASELINES",
    "FLOWS",
    "HISTORY_RUNS",
    "METHODS",
    "METHOD_FLOWS",
    "MODEL_LOCK",
    "MethodName",
    "PREFERENCE_METHODS",
    "PresetName",
    "REWARD_METHODS",
    "StageRunner",
    "Upstream",
    "best_of_n_outputs",
    "compare_flow",
    "config_key",
    "deployment_parameters",
    "fan_out",
    "generate_outputs",
    "history_task",
    "method_flow",
    "method_label",
    "method_outputs",
    "network_stage",
    "publish_curve",
    "record_run_task",
    "retry_options",
    "round_seed",
    "run_config",
    "run_methods",
    "shared_upstream",
    "transient",
]

# farmflow.flows.<method>_flow for every method (best_of_n_flow, dpo_flow, ...): the deployments' entrypoints
globals().update({fl.fn.__name__: fl for fl in METHOD_FLOWS.values()})
__all__ += [fl.fn.__name__ for fl in METHOD_FLOWS.values()]
