"""Deployments: the run form as every flow's parameter schema (preset, knobs, overrides, the whole config last), the
nightly cron, pools, `farmflow deploy`."""

from __future__ import annotations

import importlib

import pytest
from typer.testing import CliRunner

from farmflow.config import PRESETS, ConfigError, FarmConfig, preset
from farmflow.deployments import deployments
from farmflow.flows import FLOWS, METHODS


def _schema(dep) -> dict:
    return dep._parameter_openapi_schema.model_dump()


def _defs(schema: dict) -> dict:
    return schema.get("definitions") or schema.get("$defs") or {}


@pytest.fixture(scope="module")
def deps():
    return {
        f"{d.flow_name}/{d.name}": d
        for d in deployments(overrides=["dpo.beta=0.2"], nightly_cron="30 2 * * 1-5", timezone="Europe/Paris")
    }


def test_one_deployment_per_flow_plus_nightly_and_gpu_stage(deps):
    expected = {f"{name}/farmflow" for name in FLOWS} | {
        "overoptimization/farmflow",
        "reward-report/farmflow",
        "validation-study/farmflow",
        "compare/nightly-compare",
        "stage/gpu",
    }
    assert set(deps) == expected
    for name, dep in deps.items():
        assert dep.work_pool_name == ("farmflow-gpu" if name == "stage/gpu" else "farmflow-cpu"), name
        module, _, attr = dep.entrypoint.rpartition(".")  # a module path: workers need the package, not this checkout
        assert getattr(importlib.import_module(module), attr).name == dep.flow_name


def test_every_flow_form_has_the_described_config(deps):
    advanced = preset("synthetic-tiny").model_dump(mode="json")
    del advanced["store"]["uri"]  # the machine's default store, not the deploying machine's
    for name, dep in deps.items():
        if name == "stage/gpu":
            continue
        schema = _schema(dep)
        props = schema["properties"]
        assert {"advanced", "preset", "seed", "overrides"} <= set(props), name
        farm = _defs(schema)["FarmConfig"]
        assert set(farm["properties"]) == set(FarmConfig.model_fields), name
        assert all(field.get("description") for field in farm["properties"].values()), name
        # a nested section: every field with its description and default (paper defaults)
        bon = _defs(schema)["BestOfNConfig"]
        assert "reranked" in bon["properties"]["n"]["description"] and bon["properties"]["n"]["default"] == 16
        execution = _defs(schema)["ExecutionConfig"]["properties"]
        assert execution["mode"]["enum"] == ["local", "distributed"] and execution["mode"]["default"] == "local"
        assert props["preset"]["anyOf"][0]["enum"] == list(PRESETS)  # a drop-down
        assert props["preset"]["description"].startswith("Named farm configuration")
        assert "section.field=value" in props["overrides"]["description"]
        # the form's order (Prefect sorts by position): preset and the knobs first, the whole config last
        order = [k for k, _ in sorted(props.items(), key=lambda kv: kv[1]["position"])]
        assert order[0] == "preset" and order[-2:] == ["overrides", "advanced"], (name, order)
        assert order.index("seed") < order.index("eval_size") < order.index("pref_size") < 5, (name, order)
        assert (dep.parameters["preset"], dep.parameters["overrides"]) == ("synthetic-tiny", ["dpo.beta=0.2"]), name
        assert dep.parameters["advanced"] == advanced and dep.parameters["seed"] is None, name
        assert set(dep.parameters) == set(props), name  # every field: what the UI sends back for an unchanged form
        assert dep.parameters.get("history", False) is (name == "compare/nightly-compare"), name
    compare = _schema(deps["compare/farmflow"])["properties"]
    assert compare["methods"]["anyOf"][0]["items"]["enum"] == list(METHODS) and compare["methods"]["position"] == 1
    assert "leaderboard_history" in compare["history"]["description"]


def test_nightly_compare_has_the_configured_cron_and_records_history(deps):
    nightly = deps["compare/nightly-compare"]
    (sched,) = nightly.schedules
    assert sched.schedule.cron == "30 2 * * 1-5" and sched.schedule.timezone == "Europe/Paris"
    assert nightly.parameters["history"] is True
    assert nightly.parameters["replicates"] == 3  # evaluation.nightly_replicates: the history compares intervals
    assert not deps["compare/farmflow"].schedules


def test_stage_deployment_takes_stage_store_config_and_refs(deps):
    props = _schema(deps["stage/gpu"])["properties"]
    assert {"stage", "store_uri", "config", "inputs", "options"} <= set(props)
    assert "ArtifactRef" in _defs(_schema(deps["stage/gpu"]))


def test_bad_settings_are_clear_errors():
    with pytest.raises(ConfigError, match="unknown field 'dpo.betta'"):
        deployments(overrides=["dpo.betta=1"])
    with pytest.raises(ValueError):
        deployments(nightly_cron="every night")
    with pytest.raises(ValueError, match="stage_deployment"):
        deployments(overrides=["execution.stage_deployment=gpu"])


@pytest.mark.usefixtures("prefect_harness")
def test_farmflow_deploy_registers_everything_on_the_server(tmp_path):
    from prefect.client.orchestration import get_client

    from farmflow.cli import app

    store = str(tmp_path / "store")
    result = CliRunner().invoke(
        app,
        [
            "deploy",
            "--preset",
            "synthetic-micro",
            "--set",
            "execution.gpu_pool=test-gpu",
            "--set",
            "execution.cpu_pool=test-cpu",
            "--store",
            store,
            "--gpu-slots",
            "2",
            "--nightly-cron",
            "15 4 * * *",
            "--timezone",
            "America/New_York",
            "--nightly-method",
            "dpo,best-of-n",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "compare/nightly-compare" in result.output and "prefect worker start --pool test-gpu" in result.output
    with get_client(sync_client=True) as client:
        pools = {p: client.read_work_pool(p) for p in ("test-cpu", "test-gpu")}
        assert pools["test-gpu"].type == "process" and pools["test-gpu"].concurrency_limit == 2
        assert pools["test-cpu"].concurrency_limit is None
        nightly = client.read_deployment_by_name("compare/nightly-compare")
        compare = client.read_deployment_by_name("compare/farmflow")
        stage = client.read_deployment_by_name("stage/gpu")
    assert nightly.work_pool_name == "test-cpu" and stage.work_pool_name == "test-gpu"
    (sched,) = nightly.schedules
    assert sched.schedule.cron == "15 4 * * *" and sched.schedule.timezone == "America/New_York"
    assert nightly.parameters["history"] is True and nightly.parameters["methods"] == ["dpo", "best_of_n"]
    assert nightly.parameters["overrides"] == [
        "execution.gpu_pool=test-gpu",
        "execution.cpu_pool=test-cpu",
        f'store.uri="{store}"',
    ]
    # what the UI renders: the stored schema has the config fields with their descriptions
    farm = _defs(compare.parameter_openapi_schema)["FarmConfig"]
    assert "Supervised fine-tuning" in farm["properties"]["sft"]["description"]
    dpo = _defs(compare.parameter_openapi_schema)["DPOConfig"]["properties"]["beta"]
    assert dpo["default"] == 0.1 and "KL" in dpo["description"]
    assert compare.entrypoint == "farmflow.flows.compare_flow" and compare.enforce_parameter_schema

    bad = CliRunner().invoke(app, ["deploy", "--timezone", "Mars/Olympus"])
    assert bad.exit_code == 2 and "deploy failed" in bad.output

    # the unresponsive-run automation: one, updated by a second deploy, removed when switched off
    from farmflow.deployments import UNRESPONSIVE

    def automations():
        with get_client(sync_client=True) as client:
            return client.read_automations_by_name(UNRESPONSIVE)

    (auto,) = automations()
    assert auto.trigger.within.total_seconds() == 300 and auto.trigger.posture == "Proactive"
    assert auto.actions[0].state == "CRASHED" and "prefect.tag.farmflow" in str(auto.trigger.match_related)
    again = CliRunner().invoke(
        app, ["deploy", "--preset", "synthetic-micro", "--store", store, "--set", "execution.unresponsive_after_s=600"]
    )
    assert again.exit_code == 0 and "silent for 600 s" in again.output, again.output
    (updated,) = automations()
    assert updated.id == auto.id and updated.trigger.within.total_seconds() == 600
    off = CliRunner().invoke(
        app, ["deploy", "--preset", "synthetic-micro", "--store", store, "--set", "execution.unresponsive_after_s=null"]
    )
    assert off.exit_code == 0 and automations() == [] and "silent for" not in off.output


def test_deployed_runs_send_heartbeats_and_the_automation_waits_longer(deps):
    from farmflow.deployments import unresponsive_automation

    for name, dep in deps.items():
        assert dep.job_variables["env"]["PREFECT_FLOWS_HEARTBEAT_FREQUENCY"] == "60" and "farmflow" in dep.tags, name
    auto = unresponsive_automation(300)
    assert auto.trigger.after == {"prefect.flow-run.heartbeat"} and "prefect.flow-run.Completed" in auto.trigger.expect
    assert auto.trigger.for_each == {"prefect.resource.id"}  # one countdown per flow run
    with pytest.raises(ConfigError, match="unresponsive_after_s"):
        deployments(overrides=["execution.heartbeat_s=120", "execution.unresponsive_after_s=100"])
    with pytest.raises(ConfigError, match="heartbeat_s"):
        deployments(overrides=["execution.heartbeat_s=10"])
