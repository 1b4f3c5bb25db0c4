"""Deployments of every flow, the nightly comparison, the GPU stage runner, and their work pools.

`deployments()` builds them (nothing is sent anywhere); `deploy()` creates the work pools
when missing and registers the deployments on the Prefect server (``PREFECT_API_URL``);
``farmflow deploy`` is the command for it.

* ``<flow>/farmflow`` for every flow in `farmflow.flows.FLOWS` (compare, and one per method of
  `farmflow.config.METHODS`: best-of-n, dpo, ...) plus ``overoptimization/farmflow`` and
  ``reward-report/farmflow``, on the CPU pool: the flow itself orchestrates, annotates and evaluates there;
* ``compare/nightly-compare``: the compare flow on a cron schedule (time and timezone
  configurable) with ``history: true``, so each run appends its leaderboard to the
  store's ``leaderboard_history`` table, and ``replicates`` from the preset's
  ``evaluation.nightly_replicates``, so the history compares intervals (seed variance included), not single draws;
* ``study/farmflow``: the validation study (`farmflow.flows.study`);
* ``stage/gpu``: `farmflow.flows.distributed.stage_flow` on the GPU pool, one stage per flow
  run, for flows whose config says ``execution.mode: distributed``;
* the automation ``farmflow: crash unresponsive runs``: every deployed run sends a heartbeat
  every ``execution.heartbeat_s``; a farmflow run silent for ``execution.unresponsive_after_s``
  (its machine vanished) is marked Crashed, and the flow waiting on it retries the stage.

Entrypoints are module paths (``farmflow.flows.compare_flow``): a worker needs farmflow
installed, not a copy of this checkout.

The run form (`farmflow.flows.form`): a flow's deployment opens on ``preset`` (a drop-down of the
presets), the flow's own choices (``methods`` for compare), the knobs ``seed``, ``eval_size`` and
``pref_size`` (None: the preset's), ``overrides`` (``section.field=value`` items, the deployment's
``--set`` ones filled in), and last ``advanced``: the whole `FarmConfig`, every field described,
filled with the deployment preset's values (`farmflow.flows.form.deployment_parameters`). Submitted
unchanged, a run computes exactly ``load_config(preset, overrides)``; a switched preset gives the
new preset's values plus the fields edited in ``advanced``; a knob that is set wins over both.
"""

from __future__ import annotations

from typing import Any

DEPLOYMENT = "farmflow"
"""Name of every flow's deployment (``compare/farmflow``, ``dpo/farmflow``, ...)."""
NIGHTLY = "nightly-compare"
STAGE = "gpu"
TAG = "farmflow"
"""Tag of every deployment, so of every flow run they start (the unresponsive-run automation matches it)."""
UNRESPONSIVE = "farmflow: crash unresponsive runs"


def deployments(
    preset: str = "synthetic-tiny",
    overrides: list[str] | None = None,
    nightly_cron: str = "0 3 * * *",
    timezone: str = "UTC",
    nightly_methods: list[str] | None = None,
    cpu_pool: str | None = None,
    gpu_pool: str | None = None,
    cfg: Any = None,
    nightly_schedule: Any = None,
) -> list[Any]:
    """Runner deployments: one per flow, the nightly comparison and the GPU stage runner.

    Every flow deployment's default parameters are ``preset``, ``overrides`` and ``advanced`` (the preset's
    config; `farmflow.flows.form.deployment_parameters`), every other form field at its default
    (`form_parameters`), all editable in the UI per run. Pools default to the preset's ``execution.cpu_pool`` and
    ``execution.gpu_pool``. `cfg`: the config ``preset`` and ``overrides`` load to, when the caller has it already.
    `nightly_schedule`: any Prefect schedule (e.g. ``Interval``) in place of the cron, for comparisons more often
    than nightly.
    """
    from prefect.schedules import Cron
    from prefect.types.entrypoint import EntrypointType

    from farmflow.config import load_config
    from farmflow.flows import FLOWS, compare_flow, deployment_parameters
    from farmflow.flows.distributed import stage_flow
    from farmflow.flows.overoptimization import overoptimization_flow
    from farmflow.flows.reward_report import reward_report_flow
    from farmflow.flows.study import study_flow

    if cfg is None:
        cfg = load_config(preset, list(overrides or []))  # fails early, naming the field, on a bad preset or override
    cpu_pool, gpu_pool = cpu_pool or cfg.execution.cpu_pool, gpu_pool or cfg.execution.gpu_pool
    flow_name, _, stage_name = cfg.execution.stage_deployment.partition("/")
    if flow_name != stage_flow.name or not stage_name:
        raise ValueError(
            f"execution.stage_deployment must be '{stage_flow.name}/<name>', got {cfg.execution.stage_deployment!r}"
        )
    params = deployment_parameters(preset, overrides)
    heartbeat = {"env": {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(cfg.execution.heartbeat_s)}}
    common = {"entrypoint_type": EntrypointType.MODULE_PATH, "tags": [TAG], "job_variables": heartbeat}
    flows = [*FLOWS.values(), overoptimization_flow, reward_report_flow, study_flow]
    out = [
        fl.to_deployment(name=DEPLOYMENT, parameters=form_parameters(fl, params), work_pool_name=cpu_pool, **common)
        for fl in flows
    ]
    nightly = form_parameters(
        compare_flow,
        params
        | {
            "history": True,
            "methods": list(nightly_methods or []) or None,
            "replicates": cfg.evaluation.nightly_replicates,
        },
    )
    schedule = nightly_schedule or Cron(nightly_cron, timezone=timezone)
    when = f"every night ({nightly_cron}, {timezone})" if nightly_schedule is None else "on its schedule"
    out.append(
        compare_flow.to_deployment(
            name=NIGHTLY,
            parameters=nightly,
            schedules=[schedule],
            work_pool_name=cpu_pool,
            description=f"The method comparison {when}, {cfg.evaluation.nightly_replicates} replicates; appends the "
            "leaderboard with intervals to leaderboard_history.",
            **common,
        )
    )
    out.append(
        stage_flow.to_deployment(
            name=stage_name,
            work_pool_name=gpu_pool,
            description="One GPU stage per flow run (SFT, generation, reward and policy training) "
            "for flows with execution.mode=distributed.",
            **common,
        )
    )
    return out


def form_parameters(flow: Any, parameters: dict[str, Any]) -> dict[str, Any]:
    """`parameters` plus every other parameter of `flow` at its default: all that the UI's run form sends back, so a
    run submitted unchanged has exactly the deployment's parameters."""
    import inspect

    return {name: p.default for name, p in inspect.signature(flow.fn).parameters.items()} | parameters


def ensure_pools(pools: dict[str, int | None]) -> list[str]:
    """Create the process work pools that do not exist yet (name → concurrency limit); returns the names created."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    created = []
    with get_client(sync_client=True) as client:
        for name, limit in pools.items():
            try:
                client.read_work_pool(name)
            except ObjectNotFound:
                client.create_work_pool(
                    WorkPoolCreate(
                        name=name,
                        type="process",
                        concurrency_limit=limit,
                        base_job_template=ProcessWorker.get_default_base_job_template(),
                    )
                )
                created.append(name)
    return created


def unresponsive_automation(after_s: int) -> Any:
    """The automation that marks a farmflow flow run Crashed after `after_s` without a heartbeat or a final state.

    Prefect's recipe for zombie runs (heartbeat events, a proactive trigger per flow run),
    limited to runs tagged ``farmflow``. A crashed GPU stage run is retried by the flow that
    waits on it (`farmflow.flows.remote.run_remote`).
    """
    from datetime import timedelta

    from prefect.client.schemas.objects import StateType
    from prefect.events.actions import ChangeFlowRunState
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture
    from prefect.events.schemas.events import ResourceSpecification

    final = {f"prefect.flow-run.{s}" for s in ("Completed", "Failed", "Cancelled", "Crashed")}
    return AutomationCore(
        name=UNRESPONSIVE,
        description=f"A flow run tagged {TAG!r} that sent no heartbeat and reached no final state for {after_s} s: "
        "its machine or process is gone. Marked Crashed, so the flow waiting on it retries the stage "
        "(execution.retries).",
        trigger=EventTrigger(
            match=ResourceSpecification({"prefect.resource.id": "prefect.flow-run.*"}),
            match_related=ResourceSpecification(
                {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{TAG}"}
            ),
            after={"prefect.flow-run.heartbeat"},
            expect={"prefect.flow-run.heartbeat", *final},
            for_each={"prefect.resource.id"},
            posture=Posture.Proactive,
            threshold=1,
            within=timedelta(seconds=after_s),
        ),
        actions=[
            ChangeFlowRunState(
                state=StateType.CRASHED,
                message=f"no heartbeat for {after_s} s: the machine or process running it is gone",
            )
        ],
    )


def ensure_unresponsive_automation(after_s: int | None) -> str | None:
    """Create or update the unresponsive-run automation (None: delete it); returns its id."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        existing = client.read_automations_by_name(UNRESPONSIVE)
        if after_s is None:
            for a in existing:
                client.delete_automation(a.id)
            return None
        automation = unresponsive_automation(after_s)
        if existing:
            for a in existing[1:]:
                client.delete_automation(a.id)
            client.update_automation(existing[0].id, automation)
            return str(existing[0].id)
        return str(client.create_automation(automation))


def deploy(
    preset: str = "synthetic-tiny",
    overrides: list[str] | None = None,
    nightly_cron: str = "0 3 * * *",
    timezone: str = "UTC",
    nightly_methods: list[str] | None = None,
    gpu_slots: int | None = 1,
    cpu_slots: int | None = None,
    create_pools: bool = True,
    nightly_schedule: Any = None,
) -> list[dict[str, str]]:
    """Register every deployment on the Prefect server (``PREFECT_API_URL``), creating the work pools first.

    `gpu_slots` / `cpu_slots`: concurrency limits of newly created pools (flow runs at once
    across the pool's workers; None: unlimited). Returns name, id and pool per deployment, then
    name and id of the unresponsive-run automation (when execution.unresponsive_after_s is set).
    """
    from prefect.settings import get_current_settings

    if not get_current_settings().api.url:
        raise RuntimeError(
            "PREFECT_API_URL is not set: start a server (`prefect server start`) and point PREFECT_API_URL at it "
            "(e.g. http://127.0.0.1:4200/api)"
        )
    from farmflow.config import load_config

    cfg = load_config(preset, list(overrides or []))
    deps = deployments(
        preset, overrides, nightly_cron, timezone, nightly_methods, cfg=cfg, nightly_schedule=nightly_schedule
    )
    gpu_pool = deps[-1].work_pool_name
    cpu_pool = deps[0].work_pool_name
    if create_pools:
        ensure_pools({cpu_pool: cpu_slots, gpu_pool: gpu_slots})
    registered = []
    for dep in deps:
        dep_id = dep.apply(work_pool_name=dep.work_pool_name)
        registered.append({"name": f"{dep.flow_name}/{dep.name}", "id": str(dep_id), "pool": dep.work_pool_name})
    after_s = cfg.execution.unresponsive_after_s
    automation = ensure_unresponsive_automation(after_s)
    if automation:
        registered.append(
            {
                "name": f"automation {UNRESPONSIVE!r}: a farmflow run silent for {after_s} s is marked Crashed",
                "id": automation,
            }
        )
    return registered


__all__ = [
    "DEPLOYMENT",
    "NIGHTLY",
    "STAGE",
    "TAG",
    "UNRESPONSIVE",
    "deploy",
    "deployments",
    "ensure_pools",
    "ensure_unresponsive_automation",
    "unresponsive_automation",
]
