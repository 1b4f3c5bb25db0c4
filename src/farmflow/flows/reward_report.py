"""The reward-model report flow: the reward model beside baselines on the held-out pairs.

Builds (or fetches from the cache) the shared stages up to the reward model, then the
``reward_report`` stage (`farmflow.tasks.analysis.reward_report_task`). After `farmflow
demo` everything upstream is cached, so only the report runs (seconds).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from farmflow.config import FarmConfig
from farmflow.flows.form import PresetName, prefect_run_name, run_config, with_form_doc
from farmflow.flows.pipeline import Upstream
from farmflow.flows.runner import StageRunner
from farmflow.tasks.analysis import reward_report_task


@flow(name="reward-report", flow_run_name=prefect_run_name, log_prints=True)
@with_form_doc()
def reward_report_flow(
    preset: PresetName | None = None,
    seed: int | None = None,
    eval_size: int | None = None,
    pref_size: int | None = None,
    overrides: list[str] | None = None,
    advanced: FarmConfig | None = None,
) -> dict[str, Any]:
    """How good is the reward model? Held-out accuracy against labels, un-noised labels and gold, overall and per task
    family, beside the longer output, the SFT policy's log-likelihood, the gold reward and the pool's Bayes optimum."""
    cfg = run_config(preset, advanced, overrides, seed, eval_size, pref_size)
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    up = Upstream(run, cfg)
    config = {
        "annotation": cfg.annotation,
        "title": f"Reward model ({cfg.name}), held-out val pairs",
    }  # keyed without its operational fields
    ref = run(
        reward_report_task,
        config,
        preferences=up.preferences,
        sft=up.sft,
        reward=up.reward,
        batch_size=cfg.generation.batch_size,
    )
    return {
        "preset": cfg.name,
        "store": str(run.store.root),
        "report": run.store.read_table(ref).to_pylist(),
        "markdown": run.store.read_file(ref, "report.md").decode(),
        "artifact": ref.uri,
        "reward_model": up.reward.key,
        "stages": run.timings,
    }
