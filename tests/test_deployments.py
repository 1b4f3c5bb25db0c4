"""Deployments expose the pydantic config as the flow's parameter schema (the UI form)."""

from __future__ import annotations

from farmflow.deployments import deployments


def _find(schema: dict, name: str) -> dict:
    defs = schema.get("definitions") or schema.get("$defs") or {}
    return defs[name]


def test_best_of_n_deployment_schema_has_described_config_fields():
    (dep,) = deployments()
    assert dep.name == "best-of-n"
    schema = dep._parameter_openapi_schema.model_dump() if hasattr(dep, "_parameter_openapi_schema") else dep.parameter_openapi_schema.model_dump()
    assert {"config", "preset"} <= set(schema["properties"])
    farm = _find(schema, "FarmConfig")
    assert {"data", "model", "sft", "best_of_n", "annotation"} <= set(farm["properties"])
    bon = _find(schema, "BestOfNConfig")
    assert "reranked" in bon["properties"]["n"]["description"]
    assert bon["properties"]["n"]["default"] == 16


def test_cron_schedule_is_attached():
    (dep,) = deployments(schedule_cron="0 3 * * *", timezone="Europe/Paris")
    (sched,) = dep.schedules
    assert sched.schedule.cron == "0 3 * * *" and sched.schedule.timezone == "Europe/Paris"
