"""The run form: what its parameters mean (`run_config`, plain functions), what a deployment offers through a real
Prefect server (the common fields first, the preset's whole config as ``advanced``), and a real browser (Debian's
chromium, headless) submitting a deployment's run page unchanged: the created run gets the preset's parameters.
"""

from __future__ import annotations

import importlib
import time
from pathlib import Path

import pytest
from prefect_server import prefect_server

from farmflow.config import ConfigError, load_config, preset
from farmflow.flows import deployment_parameters, run_config
from farmflow.flows.form import config_of, flow_run_name

CHROMIUM = Path("/usr/bin/chromium")
PRESET = "synthetic-micro"  # not the flows' default: a form that fell back to global defaults would show
COMMON = ["preset", "methods", "seed", "eval_size", "pref_size"]


def dump(cfg) -> dict:
    return cfg.model_dump(mode="json")


def advanced_of(name: str, **edits) -> dict:
    """A deployment's ``advanced`` default for preset `name`, with dotted-path `edits` (``best_of_n__n=3``)."""
    data = deployment_parameters(name)["advanced"]
    for path, value in edits.items():
        *parents, last = path.split("__")
        node = data
        for p in parents:
            node = node[p]
        node[last] = value
    return data


# ------------------------------------------------------------------ the semantics, no server
def test_an_unchanged_form_is_exactly_the_preset_with_the_deployments_overrides():
    params = deployment_parameters(PRESET, ["dpo.beta=0.2"])
    assert params["advanced"]["name"] == PRESET and "uri" not in params["advanced"]["store"]
    assert dump(run_config(**params)) == dump(load_config(PRESET, ["dpo.beta=0.2"]))
    assert dump(run_config(**deployment_parameters("synthetic-tiny"))) == dump(load_config("synthetic-tiny"))
    assert dump(run_config()) == dump(load_config("synthetic-tiny"))  # nothing given: the demo preset


def test_switching_the_preset_gives_the_new_preset_not_the_old_values_in_advanced():
    cfg = run_config("synthetic-tiny", advanced_of(PRESET))
    assert dump(cfg) == dump(load_config("synthetic-tiny"))
    assert (cfg.name, cfg.data.eval_size, cfg.model.hidden_size) == ("synthetic-tiny", 1860, 128)  # micro: 16, 32


def test_a_field_edited_in_advanced_is_kept_with_the_same_or_a_switched_preset():
    edited = advanced_of(PRESET, best_of_n__n=3, data__families=["sort"])
    same = run_config(PRESET, edited)
    assert dump(same) == dump(load_config(PRESET, ["best_of_n.n=3", 'data.families=["sort"]']))
    switched = run_config("synthetic-tiny", edited)
    assert dump(switched) == dump(load_config("synthetic-tiny", ["best_of_n.n=3", 'data.families=["sort"]']))
    # a Python caller's whole config (no preset): taken as it is, custom name and all
    custom = load_config(PRESET, ["name=my-farm", "dpo.beta=0.3"])
    assert run_config(advanced=custom) is custom
    with pytest.raises(ConfigError, match="advanced.name 'my-farm' is not a preset"):
        run_config("synthetic-tiny", custom)


def test_knobs_override_advanced_and_overrides():
    edited = advanced_of(PRESET, data__eval_size=10, data__pref_size=50, dpo__seed=5)
    cfg = run_config(PRESET, edited, ["data.eval_size=11", "sft.seed=4"], seed=7, eval_size=12)
    assert (cfg.data.eval_size, cfg.data.pref_size) == (12, 50)  # the knob beats advanced and overrides; unset keeps
    seeds = {
        name: getattr(cfg, name).seed
        for name in (
            "model",
            "sft",
            "pairs",
            "annotation",
            "reward",
            "best_of_n",
            "dpo",
            "expert_iteration",
            "ppo",
            "quark",
            "generation",
        )
    }
    assert set(seeds.values()) == {7} and cfg.data.seed == 0, seeds  # one replicate: every seed but the data's
    assert cfg.expert_iteration.train.seed == cfg.reward_conditioning.train.seed == cfg.evaluation.annotator.seed == 7
    assert run_config(PRESET, edited, pref_size=30).data.pref_size == 30
    with pytest.raises(ConfigError, match="data.eval_size"):
        run_config(PRESET, eval_size=1)  # validated like any config: one line naming the field


def test_run_names_come_from_the_form():
    name = flow_run_name("compare", deployment_parameters(PRESET) | {"methods": ["dpo"], "seed": 3})
    assert name.startswith(f"compare:dpo/{PRESET}/") and name != flow_run_name("compare", deployment_parameters(PRESET))
    assert flow_run_name("dpo", {"preset": PRESET, "overrides": ["dpo.nope=1"]}) == "dpo/invalid-config"


# ---------------------------------------------------------------- a real server, a real browser
@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    """A Prefect server of its own with every deployment of preset synthetic-micro; yields (ui url, api url)."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from farmflow.deployments import deploy

    with prefect_server(tmp_path_factory.mktemp("prefect-form")) as (api_url, _env, _log):
        with temporary_settings({PREFECT_API_URL: api_url}):
            deploy(PRESET, ["execution.unresponsive_after_s=null"])
            yield api_url.removesuffix("/api"), api_url


def _deployment(api_url: str, name: str):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        return client.read_deployment_by_name(name)


def test_the_server_offers_the_common_fields_first_and_the_presets_config_as_advanced(deployed):
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    _, api_url = deployed
    compare = _deployment(api_url, "compare/farmflow")
    props = compare.parameter_openapi_schema["properties"]
    order = [k for k, _ in sorted(props.items(), key=lambda kv: kv[1]["position"])]
    assert order == [*COMMON, "history", "replicates", "overrides", "advanced"]
    assert props["preset"]["anyOf"][0]["enum"][:2] == ["synthetic-tiny", PRESET] and compare.enforce_parameter_schema
    expected = preset(PRESET).model_dump(mode="json")
    del expected["store"]["uri"]  # the worker's default store (or a --set store.uri override)
    assert compare.parameters == {
        "preset": PRESET,
        "methods": None,
        "seed": None,
        "eval_size": None,
        "pref_size": None,
        "history": False,
        "replicates": None,
        "overrides": ["execution.unresponsive_after_s=null"],
        "advanced": expected,
    }
    dpo = _deployment(api_url, "dpo/farmflow")
    module, _, attr = dpo.entrypoint.rpartition(".")
    assert dpo.entrypoint == "farmflow.flows.dpo_flow" and getattr(importlib.import_module(module), attr).name == "dpo"
    assert [
        k for k, _ in sorted(dpo.parameter_openapi_schema["properties"].items(), key=lambda kv: kv[1]["position"])
    ] == ["preset", "seed", "eval_size", "pref_size", "overrides", "advanced"]
    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        run = client.create_flow_run_from_deployment(compare.id)  # no parameter changed
    assert run.parameters == compare.parameters
    assert dump(config_of(run.parameters)) == dump(load_config(PRESET, ["execution.unresponsive_after_s=null"]))


@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs Debian's chromium at /usr/bin/chromium (CI installs it)")
def test_the_run_page_submitted_unchanged_in_a_browser_runs_the_preset(deployed, tmp_path):
    from playwright.sync_api import sync_playwright
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterDeploymentId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    ui_url, api_url = deployed
    dep = _deployment(api_url, "best-of-n/farmflow")
    by_dep = FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(any_=[dep.id]))
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1400, "height": 2400})
            page.goto(f"{ui_url}/deployments/deployment/{dep.id}/run", timeout=60_000)
            page.get_by_text("advanced (Optional)", exact=True).wait_for(timeout=60_000)  # the form has rendered
            page.get_by_role("button", name="Submit", exact=True).click()
            deadline = time.monotonic() + 60
            with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
                while not (runs := client.read_flow_runs(flow_run_filter=by_dep)):
                    assert time.monotonic() < deadline, "the submitted form created no flow run"
                    time.sleep(0.5)
        finally:
            browser.close()
    (run,) = runs
    # the form sends every field of `advanced`, schema defaults included, where the deployment's dump leaves out
    # fields that are unset (e.g. a labeler); the config both make is checked next
    assert {k: v for k, v in run.parameters.items() if k != "advanced"} == {
        k: v for k, v in dep.parameters.items() if k != "advanced"
    }
    assert dump(config_of(run.parameters)) == dump(load_config(PRESET, ["execution.unresponsive_after_s=null"]))
