"""The method flows and the compare flow: the run form's parameters → a farm config → `run_methods`.

One function backs every method flow (`method_flow`); each method of `farmflow.config.METHODS` still has its own
Prefect flow (``best-of-n``, ``dpo``, ...; `METHOD_FLOWS`), so each has its own deployment, run names and UI page,
and its own module-path entrypoint (``farmflow.flows.dpo_flow``, an attribute `farmflow.flows` sets for every
method). `compare_flow` runs any list of methods over the same upstream artifacts, the methods in parallel
(``execution.max_parallel_methods``), and ends with the over-optimization curve.
"""

from __future__ import annotations

from typing import Any

from prefect import Flow, flow

from farmflow.config import METHODS, FarmConfig, Method
from farmflow.evaluation.overopt import CurvePoint
from farmflow.flows.form import MethodName, PresetName, prefect_run_name, run_config, with_form_doc
from farmflow.flows.overoptimization import evaluate_points
from farmflow.flows.pipeline import (
    BASELINES,
    Upstream,
    config_key,
    fan_out,
    method_label,
    method_outputs,
    shared_upstream,
)
from farmflow.flows.record import history_task, publish_curve, record_run_task
from farmflow.flows.replicates import run_replicates
from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef
from farmflow.tasks import evaluate_task, leaderboard_task, reward_model_summary
from farmflow.tasks.analysis import proxy_reward_task

ENTRYPOINT_MODULE = "farmflow.flows"
"""Where workers import the flows from (``farmflow.flows.<method>_flow``): the package re-exports every flow."""


def run_methods(
    cfg: FarmConfig, methods: list[str] | tuple[str, ...], title: str, curve: bool = False, history: bool = False
) -> dict[str, Any]:
    """Baselines plus `methods` on one farm config: train, generate, evaluate, one leaderboard.

    The shared upstream stages run first, then the methods fan out (`fan_out`). With
    `curve`, a proxy reward per method joins its branch and the over-optimization curve
    (proxy reward vs win rate and gold reward, one point per method) ends the run, when a
    reward model was trained. Every run appends its leaderboard rows to the store's ``runs``
    table (`record_run_task`); with `history`, the trend of the preset's runs is published too
    (`history_task`). Returns a JSON-able summary: leaderboard rows, the run's id,
    reward-model metrics (when a method used it), per-stage timing, rows and cache hits.
    """
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; known: {', '.join(METHODS)}")
    run = StageRunner(cfg.store.location, cfg.execution, cfg.name)
    up = Upstream(run, cfg)
    shared_upstream(up, methods)
    with_proxy = curve and "reward" in up.refs()
    names = {m: method_label(cfg, m) for m in (*BASELINES, *methods)}

    def branch(m: str) -> tuple[ArtifactRef, ArtifactRef]:
        outputs = method_outputs(up, m)
        evaluation = run(evaluate_task, cfg.evaluation.annotator, f"evaluate {names[m]}", outputs=outputs, data=up.data)
        if with_proxy and m != "untrained":
            run(
                proxy_reward_task,
                {},
                f"proxy_reward {names[m]}",
                outputs=outputs,
                reward=up.reward,
                batch_size=cfg.generation.batch_size,
            )
        return outputs, evaluation

    done = fan_out(list(names), branch, cfg.execution)
    outputs = {names[m]: done[m][0] for m in names}
    evaluations = {names[m]: done[m][1] for m in names}
    board = leaderboard_task(run.store_uri, evaluations, title)
    refs = up.refs()
    summary = {
        "preset": cfg.name,
        "config_key": config_key(cfg),
        "store": str(run.store.root),
        "leaderboard": run.store.read_table(board).to_pylist(),
        "reference_mean_gold": next(iter(evaluations.values())).metrics.get("reference_mean_gold"),
        "reward_model": reward_model_summary(refs["reward"].metrics) if "reward" in refs else {},
        "stages": run.timings,
        "artifacts": {
            **{name: ref.uri for name, ref in refs.items() if name in ("sft", "reward", "preferences")},
            "leaderboard": board.uri,
        },
    }
    if with_proxy:
        points = [
            CurvePoint(
                label=names[m],
                family=m,
                pressure=cfg.best_of_n.n if m == "best_of_n" else float(m != "sft"),
                outputs=outputs[names[m]],
            )
            for m in ("sft", *methods)
        ]
        curve_title = f"Over-optimization: {cfg.name} (one point per method)"
        curve_ref = evaluate_points(up, points, {"p_sim^eval": cfg.evaluation.annotator}, curve_title)
        summary["overoptimization"] = {"rows": publish_curve(run, curve_ref, curve_title), "artifact": curve_ref.uri}
        summary["artifacts"]["overoptimization"] = curve_ref.uri
    summary["run"] = record_run_task(run.store_uri, board, cfg.name, summary["config_key"], history)
    if history and (published := history_task(run.store_uri, cfg.name)) is not None:
        summary["artifacts"]["history"] = published.uri
    return summary


def method_flow(method: Method) -> Flow:
    """The Prefect flow of one method (named `Method.flow`): the run form's parameters, then `run_methods` with it."""

    def run(
        preset: PresetName | None = None,
        seed: int | None = None,
        eval_size: int | None = None,
        pref_size: int | None = None,
        overrides: list[str] | None = None,
        advanced: FarmConfig | None = None,
    ) -> dict[str, Any]:
        cfg = run_config(preset, advanced, overrides, seed, eval_size, pref_size)
        return run_methods(cfg, [method.name], f"{method.name} on {cfg.name}")

    run.__name__ = run.__qualname__ = f"{method.name}_flow"
    run.__doc__ = method.summary
    with_form_doc(module=ENTRYPOINT_MODULE)(run)
    return flow(name=method.flow, flow_run_name=prefect_run_name, log_prints=True)(run)


@flow(name="compare", flow_run_name=prefect_run_name, log_prints=True)
@with_form_doc(
    """    methods: Methods to compare (default: all); the baselines (untrained, SFT) are always evaluated.
    history: Publish the trend of this preset's runs (Prefect artifact history, plot in the store) and count the run
        in the leaderboard_history view (the nightly comparison does); every run is recorded in the store's runs table.
    replicates: Run the comparison under this many seeds and show means with 95% intervals and each method's paired
        difference to SFT (None: evaluation.replicates; 1: one draw, the over-optimization curve included).
""",
    module=ENTRYPOINT_MODULE,
)
def compare_flow(
    preset: PresetName | None = None,
    methods: list[MethodName] | None = None,
    seed: int | None = None,
    eval_size: int | None = None,
    pref_size: int | None = None,
    history: bool = False,
    replicates: int | None = None,
    overrides: list[str] | None = None,
    advanced: FarmConfig | None = None,
) -> dict[str, Any]:
    """Every chosen method (default: all) on one farm; shared stages run once, methods in parallel; leaderboard and
    over-optimization curve (with replicates: a leaderboard with intervals, `farmflow.flows.replicates`)."""
    cfg = run_config(preset, advanced, overrides, seed, eval_size, pref_size)
    chosen = list(methods) if methods else list(METHODS)
    k = replicates or cfg.evaluation.replicates
    if k > 1:
        return run_replicates(cfg, chosen, f"Leaderboard: {cfg.name}, {k} replicates", k, history=history)
    return run_methods(cfg, chosen, f"Leaderboard: {cfg.name}", curve=True, history=history)


METHOD_FLOWS: dict[str, Flow] = {m.flow: method_flow(m) for m in METHODS.values()}
"""Flow name → the flow of one method (``best-of-n``, ``dpo``, ...), one per `METHODS` entry."""

FLOWS: dict[str, Flow] = {"compare": compare_flow, **METHOD_FLOWS}
"""Flow name → flow, for the CLI and deployments."""
