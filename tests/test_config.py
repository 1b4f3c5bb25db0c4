"""farmflow.config: presets, overrides, validation errors that name the field, descriptions."""

import json
import typing

import pytest
from pydantic import BaseModel
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.config import (
    PRESETS,
    BestOfNConfig,
    ConfigError,
    FarmConfig,
    ModelConfig,
    OracleAnnotatorConfig,
    load_config,
    preset,
    validate_config,
)

# ----------------------------------------------------------------------------- presets


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_load_and_validate(name):
    cfg = preset(name)
    assert isinstance(cfg, FarmConfig)
    assert cfg.name == name
    # a preset survives a dump/validate round trip unchanged
    assert validate_config(cfg.model_dump()) == cfg
    assert load_config(name) == cfg


def test_preset_returns_fresh_copies():
    a = preset("synthetic-micro")
    a.best_of_n.n = 99
    assert preset("synthetic-micro").best_of_n.n == 4


def test_micro_preset_values():
    cfg = preset("synthetic-micro")
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.num_heads, cfg.model.vocab_size) == (32, 1, 2, 384)
    assert cfg.best_of_n.n == 4
    assert cfg.annotation.label_noise == 0.5  # p_sim^ann
    assert cfg.evaluation.annotator.label_noise == 0.0  # p_sim^eval


def test_lookup_preset_is_the_demo_on_the_lookup_families_with_the_papers_preference_pairs():
    """synthetic-lookup differs from synthetic-tiny in its name, task families and preference split alone (the
    paper's 10k pairs), so a study on each compares those, nothing else."""
    lookup, tiny = preset("synthetic-lookup").model_dump(), preset("synthetic-tiny").model_dump()
    assert lookup["data"].pop("families") == ["list_items", "categorize"]
    assert tiny["data"].pop("families") == ["arithmetic", "sort", "reverse", "list_items", "max_number", "categorize"]
    assert (lookup["data"].pop("pref_size"), tiny["data"].pop("pref_size")) == (10_000, 4_000)
    assert (lookup.pop("name"), tiny.pop("name")) == ("synthetic-lookup", "synthetic-tiny")
    assert lookup == tiny


def test_unknown_preset_lists_known_presets():
    with pytest.raises(ConfigError) as err:
        preset("synthetic-huge")
    msg = str(err.value)
    assert "'synthetic-huge'" in msg
    for name in PRESETS:
        assert name in msg
    with pytest.raises(
        ConfigError,
        match="known presets: alpaca-small, alpacafarm-7b, smol-cpu, smol-micro, synthetic-lookup, synthetic-micro, "
        "synthetic-tiny",
    ):
        load_config("nope")


# ----------------------------------------------------------------------------- overrides


def test_string_overrides_are_parsed_as_json():
    cfg = load_config("synthetic-micro", ["best_of_n.n=8", 'data.families=["sort", "reverse"]', "sft.lr=0.01"])
    assert cfg.best_of_n.n == 8 and isinstance(cfg.best_of_n.n, int)
    assert cfg.data.families == ["sort", "reverse"]
    assert cfg.sft.lr == 0.01
    # untouched fields keep the preset's values, not the class defaults
    assert cfg.sft.epochs == 1.0 and cfg.sft.batch_size == 16
    assert cfg.name == "synthetic-micro"


def test_string_override_bare_string_value():
    cfg = load_config("synthetic-micro", ["store.uri=/tmp/somewhere", "name=my-farm"])
    assert cfg.store.uri == "/tmp/somewhere"
    assert cfg.name == "my-farm"


def test_string_override_value_may_contain_equals():
    cfg = load_config("synthetic-micro", ["store.uri=/tmp/a=b"])
    assert cfg.store.uri == "/tmp/a=b"


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="section.field=value"):
        load_config("synthetic-micro", ["best_of_n.n"])


def test_dict_overrides_nested():
    cfg = load_config("synthetic-micro", {"best_of_n": {"n": 3, "temperature": 0.5}, "model": {"hidden_size": 16}})
    assert cfg.best_of_n.n == 3 and cfg.best_of_n.temperature == 0.5
    assert cfg.model.hidden_size == 16
    assert cfg.model.num_heads == 2  # preset value kept
    # dotted keys in a dict work too, and give the same result as the string form
    assert load_config("synthetic-micro", {"best_of_n.n": 3}) == load_config("synthetic-micro", ["best_of_n.n=3"])


def test_dict_override_of_pool_list():
    pool = [{"name": "solo", "sharpness": 2.0}]
    cfg = load_config("synthetic-micro", {"annotation": {"pool": pool, "label_noise": 0.0}})
    assert cfg.annotation.pool == [OracleAnnotatorConfig(name="solo", sharpness=2.0)]
    assert cfg.annotation.label_noise == 0.0


def test_empty_section_override_is_a_no_op():
    assert load_config("synthetic-micro", {"sft": {}}) == preset("synthetic-micro")


def test_partial_section_override_keeps_the_preset_values():
    base = preset("synthetic-micro")
    for overrides in ({"sft": {"lr": 0.1}}, ['sft={"lr": 0.1}'], {"sft.lr": 0.1}):
        cfg = load_config("synthetic-micro", overrides)
        assert cfg.sft.lr == 0.1
        assert cfg.sft.epochs == base.sft.epochs and cfg.sft.batch_size == base.sft.batch_size


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["bogus=1"], "'bogus'"),
        (["sft.bogus=1"], "'sft.bogus'"),
        (["bogus.n=1"], "'bogus'"),
        (["best_of_n.n.deeper=1"], "'best_of_n.n.deeper'"),
        ({"sft": {"lrr": 0.5}}, "'sft.lrr'"),
        ({"evaluation": {"annotator": {"seeed": 1}}}, "'evaluation.annotator.seeed'"),
    ],
)
def test_unknown_field_names_the_dotted_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config("synthetic-micro", overrides)
    assert f"unknown field {field}" in str(err.value)


def test_a_field_inside_an_unset_optional_section_says_to_set_the_section_whole():
    with pytest.raises(ConfigError) as err:
        load_config("synthetic-micro", ["reward.backbone.model.hidden_size=64"])
    assert str(err.value) == (
        "'reward.backbone' is not set, so 'reward.backbone.model.hidden_size' cannot be changed alone; "
        "set the section whole: --set 'reward.backbone={...}'"
    )
    # set whole, its defaults are filled in, so a later override can change one of its fields
    cfg = load_config(
        "synthetic-micro", ['reward.backbone={"model": {"hidden_size": 48}}', "reward.backbone.model.num_layers=3"]
    )
    assert cfg == load_config("synthetic-micro", {"reward.backbone": {"model": {"hidden_size": 48, "num_layers": 3}}})
    assert (cfg.reward.backbone.model.hidden_size, cfg.reward.backbone.model.num_layers) == (48, 3)
    assert (
        load_config(
            "synthetic-micro", {"reward": {"backbone": {"model": {}}}, "reward.backbone.sft": {"lr": 0.5}}
        ).reward.backbone.sft.lr
        == 0.5
    )
    # a section that does not validate alone is left as given: the whole config's validation names the field
    with pytest.raises(ConfigError, match="reward.backbone.model.hidden_size"):
        load_config("synthetic-micro", ['reward.backbone={"model": {"hidden_size": "wide"}}'])


def test_unknown_field_inside_a_list_item():
    with pytest.raises(ConfigError) as err:
        load_config("synthetic-micro", {"annotation": {"pool": [{"name": "x", "bogus": 1}]}})
    assert "unknown field 'annotation.pool.0.bogus'" in str(err.value)


@pytest.mark.parametrize(
    "overrides, field",
    [
        (["sft.lr=-1"], "'sft.lr'"),
        (["reward.lr=0"], "'reward.lr'"),
        ({"best_of_n": {"n": 0}}, "'best_of_n.n'"),
        (["data.demo_error_rate=1.5"], "'data.demo_error_rate'"),
        (['best_of_n.n="many"'], "'best_of_n.n'"),
        (["pairs.top_p=0"], "'pairs.top_p'"),
        (["data.families=[]"], "'data.families'"),
        (["model.vocab_size=100"], "'model.vocab_size'"),
        (["sft.seed=-1"], "'sft.seed'"),  # numpy's generators refuse negative seeds: refused here, not mid-run
        (["evaluation.annotator.seed=-3"], "'evaluation.annotator.seed'"),
    ],
)
def test_invalid_value_names_the_field(overrides, field):
    with pytest.raises(ConfigError) as err:
        load_config("synthetic-micro", overrides)
    assert f"invalid value for {field}" in str(err.value)


def test_hidden_size_not_divisible_by_heads():
    with pytest.raises(ConfigError) as err:
        load_config("synthetic-micro", ["model.num_heads=3"])
    msg = str(err.value)
    assert "invalid value for 'model'" in msg
    assert "hidden_size (32) must be divisible by num_heads (3)" in msg
    # directly on the model too
    with pytest.raises(ValueError, match="divisible"):
        ModelConfig(hidden_size=30, num_heads=4)
    assert ModelConfig(hidden_size=32, num_heads=4).hidden_size == 32


def test_several_errors_are_all_reported():
    with pytest.raises(ConfigError) as err:
        validate_config({"sft": {"lr": -1, "batch_size": 0}})
    msg = str(err.value)
    assert "'sft.lr'" in msg and "'sft.batch_size'" in msg


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


def test_validate_assignment_and_forbid_extra():
    cfg = BestOfNConfig()
    with pytest.raises(ValueError):
        cfg.n = 0
    with pytest.raises(ValueError):
        BestOfNConfig(n=2, m=3)


# ----------------------------------------------------------------------------- descriptions


def _models_in(annotation) -> list[type[BaseModel]]:
    """Pydantic model classes reachable from a field annotation (through list[...], X | None...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


def _walk(model: type[BaseModel], prefix: str, seen: dict[str, type[BaseModel]]) -> list[tuple[str, str | None]]:
    fields = []
    for name, info in model.model_fields.items():
        path = f"{prefix}{name}"
        fields.append((path, info.description))
        for sub in _models_in(info.annotation):
            seen[path] = sub
            fields.extend(_walk(sub, path + ".", seen))
    return fields


def test_every_field_has_a_description():
    seen: dict[str, type[BaseModel]] = {}
    fields = _walk(FarmConfig, "", seen)
    missing = [path for path, desc in fields if not (desc and desc.strip())]
    assert missing == []
    # the walk really reached the nested models (including the pool's list items)
    assert {
        "data",
        "model",
        "sft",
        "annotation",
        "annotation.pool",
        "evaluation.annotator",
        "evaluation.annotator.pool",
        "best_of_n",
        "store",
    } <= set(seen)
    assert seen["annotation.pool"] is OracleAnnotatorConfig
    assert "annotation.pool.sharpness" in dict(fields)
    assert len(fields) > 60


# ----------------------------------------------------------------------------- a leaf package


def test_the_config_package_is_a_leaf():
    # pydantic and the standard library only: the CLI validates a config without torch or Prefect, and no farmflow
    # module outside the package is loaded (nothing can import the config back into a cycle)
    import subprocess
    import sys

    code = (
        "import sys, farmflow.config; print(' '.join(sorted(m for m in sys.modules "
        "if m.startswith(('farmflow', 'torch', 'prefect', 'transformers', 'pyarrow')))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert "farmflow.config.presets" in loaded
    assert [m for m in loaded if not m.startswith("farmflow.config") and m != "farmflow"] == []


# ----------------------------------------------------------------------------- CLI


def test_cli_config_show_bad_override_exits_2():
    result = CliRunner().invoke(app, ["config", "show", "synthetic-micro", "--set", "sft.bogus=1"])
    assert result.exit_code == 2
    assert "unknown field 'sft.bogus'" in result.output


def test_cli_config_show_prints_the_overridden_config():
    result = CliRunner().invoke(app, ["config", "show", "synthetic-micro", "--set", "best_of_n.n=8"])
    assert result.exit_code == 0, result.output
    shown = json.loads(result.output)
    assert shown["best_of_n"]["n"] == 8
    assert shown["name"] == "synthetic-micro"
    assert FarmConfig.model_validate(shown) == load_config("synthetic-micro", ["best_of_n.n=8"])


def test_cli_config_show_unknown_preset_exits_2():
    result = CliRunner().invoke(app, ["config", "show", "nope"])
    assert result.exit_code == 2
    assert "unknown preset 'nope'" in result.output


def test_cli_creates_a_missing_prefect_home(tmp_path, monkeypatch):
    """A fresh clone has no .farmflow/prefect: Prefect's SQLite database needs the folder."""
    from farmflow.cli.server import prefect_env as _prefect_env

    home = tmp_path / "fresh" / "prefect"
    monkeypatch.setenv("PREFECT_HOME", str(home))
    _prefect_env()
    assert home.is_dir()


def test_config_diff_lists_what_a_preset_changes_from_the_paper_defaults():
    from typer.testing import CliRunner

    from farmflow.cli import app

    out = CliRunner().invoke(app, ["config", "diff", "synthetic-tiny", "--section", "dpo"], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "dpo.lr" in out.output and "1e-06" in out.output and "0.0001" in out.output
    assert "dpo.beta" not in out.output and "sft.lr" not in out.output  # unchanged; other section
    everything = CliRunner().invoke(
        app, ["config", "diff", "synthetic-tiny", "--section", "dpo", "--all"], terminal_width=200
    )
    assert "dpo.beta" in everything.output


def test_config_diff_shows_an_annotator_preset_as_one_row_and_presets_one_line_each():
    """`config diff alpacafarm-7b` shows the annotator preset as one row, not the ~200 fields of the pools it fixes."""
    from typer.testing import CliRunner

    from farmflow.cli import app

    out = CliRunner().invoke(app, ["config", "diff", "alpacafarm-7b"], terminal_width=200)
    assert out.exit_code == 0, out.output
    assert "annotation.preset" in out.output and "'p_sim_ann'" in out.output and "best_of_n.n" in out.output
    assert "api_pool" not in out.output
    listed = CliRunner().invoke(app, ["config", "presets"], terminal_width=200)
    assert [ln.split(":")[0] for ln in listed.output.splitlines()[:-1]] == [
        "alpaca-small",
        "alpacafarm-7b",
        "smol-cpu",
        "smol-micro",
        "synthetic-lookup",
        "synthetic-micro",
        "synthetic-tiny",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["run", "nonexist"], "unknown flow 'nonexist'"),
        (["run", "dpo", "--method", "ppo"], "--method only applies to the compare flow"),
        (["run", "best-of-n", "--set", "sft.lrr=1"], "unknown field 'sft.lrr'"),
        (["demo", "--method", "foo"], "unknown method(s) foo"),
        (["demo", "--annotator", "nope"], "unknown annotator 'nope'"),
        (["demo", "--preset", "nope"], "unknown preset"),
        (["overopt", "--n", "4", "--n", "0"], "Invalid value for '--n'"),
        (["study", "validate", "--n", "0"], "Invalid value for '--n'"),
        (["study", "validate", "--seed", "-1"], "Invalid value for '--seed'"),
        (["study", "validate", "--set", "reward.backbone.model.hidden_size=64"], "'reward.backbone' is not set"),
        (["judge-server", "--port", "99999"], "Invalid value for '--port'"),
        (["overopt", "--labeller", "bogus"], "--labeller: unknown annotator(s) ['bogus']; known: p_sim^ann, greedy"),
        (["overopt", "--annotator", "p_sim_ann,nobody"], "--annotator: unknown annotator(s) ['nobody']"),
        (["label", "serve", "--pairs", "x.json", "--port", "99999"], "Invalid value for '--port'"),
    ],
)
def test_cli_refuses_bad_names_before_starting_prefect(monkeypatch, args, message):
    """A bad name is refused before Prefect's temporary API starts, so a typo is reported at once, not after ~15 s."""
    from typer.testing import CliRunner

    import farmflow.cli as cli
    from farmflow.config import FLOW_NAMES, METHODS

    started = []
    monkeypatch.setattr(cli.runs, "start_temporary_api", lambda: started.append(1))
    monkeypatch.setattr(cli.study, "start_temporary_api", lambda: started.append(1))
    out = CliRunner().invoke(cli.app, args, terminal_width=200)
    assert out.exit_code == 2 and message in " ".join(out.output.split()), out.output
    assert not started
    assert FLOW_NAMES == (
        "compare",
        "feedme",
        "reward-conditioning",
        "dpo",
        "best-of-n",
        "expert-iteration",
        "ppo",
        "quark",
    )
    assert len(METHODS) == 7


def test_flow_names_are_the_flows():
    from farmflow.config import FLOW_NAMES
    from farmflow.flows import FLOWS

    assert set(FLOWS) == set(FLOW_NAMES) and len(FLOW_NAMES) == len(FLOWS)


@pytest.mark.parametrize(
    "override, field",
    [
        ("store.uri=s3://AKIAEXAMPLE:SECRETVALUE@bucket/prefix", "store.uri"),
        ("store.uri=s3://bucket/prefix?endpoint_url=http://admin:SECRETVALUE@127.0.0.1:9000", "store.uri"),
        ("annotation.base_url=http://127.0.0.1:8000/v1?api_key=SECRETVALUE", "annotation.base_url"),
        (
            'evaluation.annotator.api_pool=[{"name": "x", "model": "m", "base_url": "http://u:SECRETVALUE@127.0.0.1/v1"}]',
            "evaluation.annotator.api_pool.0.base_url",
        ),
    ],
)
def test_urls_with_credentials_are_refused_without_repeating_them(override, field):
    """A URL with credentials is refused at load time and the error names the field without the secret: a config
    value reaches errors, Prefect parameters and artifact records, so a secret must never be in one."""
    with pytest.raises(ConfigError) as err:
        load_config("synthetic-micro", [override])
    assert f"invalid value for {field!r}: Value error, must not carry credentials" in str(err.value)
    assert "SECRETVALUE" not in str(err.value) and "AKIA" not in str(err.value)


def test_store_endpoint_and_direct_store_uris_with_credentials_are_refused(monkeypatch):
    from farmflow.annotators.cache import resolve_base_url
    from farmflow.config import AnnotatorConfig, ApiAnnotatorConfig
    from farmflow.storage import StoreError, open_store

    with pytest.raises(ConfigError, match="store.endpoint_url") as err:
        load_config(
            "synthetic-micro", ["store.uri=s3://bucket/p", "store.endpoint_url=http://admin:SECRETVALUE@127.0.0.1:9000"]
        )
    assert "SECRETVALUE" not in str(err.value)
    with pytest.raises(StoreError, match="must not carry credentials") as err:
        open_store("s3://AKIAEXAMPLE:SECRETVALUE@bucket/prefix")
    assert "SECRETVALUE" not in str(err.value)
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1?token=SECRETVALUE")
    with pytest.raises(ValueError, match=r"\$OPENAI_BASE_URL must not carry credentials") as err:
        resolve_base_url(ApiAnnotatorConfig(name="x", model="m"), AnnotatorConfig())
    assert "SECRETVALUE" not in str(err.value)
    # plain endpoints still work
    assert load_config(
        "synthetic-micro", ["store.uri=s3://bucket/p?endpoint_url=http://127.0.0.1:9000"]
    ).store.uri.startswith("s3://bucket/p")
    monkeypatch.setenv("OPENAI_BASE_URL", "http://127.0.0.1:9/v1/")
    assert resolve_base_url(ApiAnnotatorConfig(name="x", model="m"), AnnotatorConfig()) == "http://127.0.0.1:9/v1"


def test_evaluation_has_no_temperature_that_nothing_reads():
    """generation.temperature samples the evaluated outputs; evaluation has no temperature, and setting one is an
    error that names it (accepted, it would change nothing and silently keep the cached outputs)."""
    with pytest.raises(ConfigError, match="unknown field 'evaluation.temperature'"):
        load_config("synthetic-micro", ["evaluation.temperature=1.0"])
    assert load_config("synthetic-tiny").generation.temperature == 0.7
