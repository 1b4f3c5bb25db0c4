"""The reward-model report flow: the reward model beside baselines on the held-out pairs.

Builds (or fetches from the cache) the shared stages up to the reward model, then the
``reward_report`` stage (`farmflow.tasks.analysis.reward_report_task`). After `farmflow
demo` everything upstream is cached, so only the report runs (seconds).
"""

from __future__ import annotations

from typing import Any

from prefect import flow

from farmflow.config import FarmConfig
from farmflow.flows import PresetName, StageRunner, Upstream, _args_doc, _cfg, _flow_run_name
from farmflow.tasks.analysis import reward_report_task


@flow(name="reward-report", flow_run_name=_flow_run_name, log_prints=True)
@_args_doc()
def reward_report_flow(config: FarmConfig | None = None, preset: PresetName = "synthetic-tiny", overrides: list[str] | None = None) -> dict[str, Any]:
    """How good is the reward model? Held-out accuracy against labels, un-noised labels and gold, overall and per
    task family, beside the longer output, the SFT policy's log-likelihood, the gold reward and the pool's Bayes optimum."""
    cfg = _cfg(config, preset, overrides)
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    up = Upstream(run, cfg)
    config = {"annotation": cfg.annotation, "title": f"Reward model ({cfg.name}), held-out val pairs"}  # keyed without its operational fields
    ref = run(reward_report_task, config, preferences=up.preferences, sft=up.sft, reward=up.reward, batch_size=cfg.generation.batch_size)
    return {
        "preset": cfg.name,
        "store": str(run.store.root),
        "report": run.store.read_table(ref).to_pylist(),
        "markdown": run.store.read_file(ref, "report.md").decode(),
        "artifact": ref.uri,
        "reward_model": up.reward.key,
        "stages": run.timings,
    }
