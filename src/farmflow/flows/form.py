"""The run form: the parameters every farm flow takes, and the one function that turns them into a `FarmConfig`.

A person starting a run in the Prefect UI sees, in this order: ``preset`` (a drop-down), the
flow's own choices (``methods`` for compare), the common knobs (``seed``, ``eval_size``,
``pref_size``), ``overrides`` (``section.field=value`` items), and last ``advanced``: the whole
`FarmConfig` as a nested form, which a deployment fills with its preset's values.

`run_config` gives those parameters one meaning:

1. the base: ``advanced`` when it was made from the chosen preset (``advanced.name == preset``),
   else the chosen preset with the fields of ``advanced`` that differ from the preset named in
   ``advanced.name`` (someone who only switches the drop-down gets the new preset, plus any
   field they edited in the advanced section). ``preset`` None: ``advanced`` as given (or
   synthetic-tiny without it);
2. then ``overrides``, in order;
3. then the knobs that are set (None leaves the value of step 2).

So a deployment's run form submitted unchanged runs exactly ``load_config(preset, overrides)``.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Literal, TypeVar

from farmflow.config import METHODS, PRESETS, ConfigError, FarmConfig, load_config, validate_config
from farmflow.config import preset as preset_config

PresetName = Literal[tuple(PRESETS)]  # type: ignore[valid-type] - the UI renders a drop-down of the presets
MethodName = Literal[tuple(METHODS)]  # type: ignore[valid-type] - the compare form's choices
DEFAULT_PRESET = "synthetic-tiny"
F = TypeVar("F", bound=Callable[..., Any])

KNOBS = ("seed", "eval_size", "pref_size")
"""The first-screen knobs, in form order; each set one overrides ``advanced`` and ``overrides``."""
KEPT_SEEDS = ("data",)
"""Sections whose seeds the ``seed`` knob leaves alone: the instructions and the evaluation set stay the same."""

FORM_ARGS = """
Args:
    preset: Named farm configuration (synthetic-tiny: the demo; synthetic-micro: tests; alpacafarm-7b: the paper).
        Switching it gives that preset's values, whatever the advanced section shows; fields edited there still apply.
        None: the advanced section as it is.
{extra}    seed: One seed for every stage (model initialization, SFT, sampling, annotation, reward model, methods,
        evaluation judges), the data splits excepted: each seed is one replicate of the experiment on the same
        instructions. None: the preset's seeds.
    eval_size: Evaluation instructions with reference outputs (data.eval_size; paper: 805). None: the preset's.
    pref_size: Instructions whose output pairs are annotated, the annotation budget (data.pref_size; paper: 10k).
        None: the preset's.
    overrides: Changes, one per item, as section.field=value (values parsed as JSON), e.g. dpo.beta=0.2 or
        execution.mode=distributed; applied after the advanced section, before the knobs above.
    advanced: The whole farm configuration (every field described), filled with the deployment preset's values.
        Fields changed here are kept, also when the preset above is switched; the knobs above override them.
"""


def form_doc(summary: str, extra: str = "") -> str:
    """A flow's docstring: `summary` and the form's parameter descriptions (the Prefect UI shows them); `extra`
    describes the flow's own parameters (Google style, 4-space indent), listed after ``preset``."""
    return inspect.cleandoc(summary) + "\n" + FORM_ARGS.format(extra=extra)


def with_form_doc(extra: str = "", module: str | None = None) -> Callable[[F], F]:
    """Decorator (below ``@flow``): appends the form's parameter descriptions to the function's docstring; `module`
    sets the module its deployments' entrypoint names (e.g. the package that re-exports it)."""

    def wrap(fn: F) -> F:
        fn.__doc__ = form_doc(fn.__doc__ or "", extra)
        fn.__module__ = module or fn.__module__
        return fn

    return wrap


def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        path = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out |= _flatten(v, path + ".")
        else:
            out[path] = v
    return out


def edits(config: FarmConfig, origin: FarmConfig) -> dict[str, Any]:
    """The fields of `config` that differ from `origin`, as dotted paths (lists and empty dicts count as one value;
    a dict's added or removed key counts as a change of the whole dict)."""
    new, old = config.model_dump(mode="json"), origin.model_dump(mode="json")
    changed: dict[str, Any] = {}

    def walk(a: Any, b: Any, path: str) -> None:
        if isinstance(a, dict) and isinstance(b, dict) and a and a.keys() == b.keys():
            for k in a:
                walk(a[k], b[k], f"{path}.{k}" if path else k)
        elif a != b:
            changed[path] = a

    walk(new, old, "")
    changed.pop("name", None)
    return changed


def _set(data: dict[str, Any], path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for p in parents:
        data = data[p]
    data[last] = value


def with_edits(base: FarmConfig, changed: dict[str, Any]) -> FarmConfig:
    """`base` with the fields in `changed` (dotted paths, as `edits` gives them) replaced, validated."""
    data = base.model_dump(mode="json")
    for path, value in changed.items():
        _set(data, path, value)
    return validate_config(data)


def map_seeds(cfg: FarmConfig, new_seed: Callable[[int], int], kept: tuple[str, ...] | set[str]) -> FarmConfig:
    """`cfg` with every ``seed`` field s set to ``new_seed(s)``, except under the `kept` sections (dotted paths, e.g.
    ``data`` or ``reward.backbone``)."""
    data = cfg.model_dump(mode="json")

    def walk(node: Any, path: str) -> None:
        if path in kept:
            return
        if isinstance(node, dict):
            for k, v in node.items():
                if k == "seed" and isinstance(v, int) and not isinstance(v, bool):
                    node[k] = new_seed(v)
                else:
                    walk(v, f"{path}.{k}" if path else k)
        elif isinstance(node, list):
            for v in node:
                walk(v, path)

    walk(data, "")
    return validate_config(data)


def with_seed(cfg: FarmConfig, seed: int) -> FarmConfig:
    """`cfg` with every ``seed`` field set to `seed`, except in the `KEPT_SEEDS` sections."""
    return map_seeds(cfg, lambda _: seed, KEPT_SEEDS)


def base_config(preset: str | None, advanced: FarmConfig | dict | None) -> FarmConfig:
    """Step 1 of `run_config`: the chosen preset, rebased edits of ``advanced``, or ``advanced`` itself."""
    if advanced is None:
        return preset_config(preset or DEFAULT_PRESET)
    cfg = advanced if isinstance(advanced, FarmConfig) else validate_config(advanced)
    if preset is None or preset == cfg.name:
        return cfg
    if cfg.name not in PRESETS:
        raise ConfigError(
            f"advanced.name {cfg.name!r} is not a preset, so its fields cannot be moved onto preset "
            f"{preset!r}: set advanced.name to the preset it was made from, or preset to None to run it "
            "as it is"
        )
    chosen = preset_config(preset)
    return with_edits(chosen, edits(cfg, preset_config(cfg.name)))


def run_config(
    preset: str | None = None,
    advanced: FarmConfig | dict | None = None,
    overrides: list[str] | None = None,
    seed: int | None = None,
    eval_size: int | None = None,
    pref_size: int | None = None,
) -> FarmConfig:
    """The farm config a run form means (module docstring): base, then `overrides`, then the knobs that are set."""
    base = base_config(preset, advanced)
    cfg = load_config(base.name, list(overrides), base=base) if overrides else base
    if seed is not None:
        cfg = with_seed(cfg, seed)
    sizes = {k: v for k, v in (("data.eval_size", eval_size), ("data.pref_size", pref_size)) if v is not None}
    return load_config(cfg.name, sizes, base=cfg) if sizes else cfg


def deployment_parameters(preset: str, overrides: list[str] | None = None) -> dict[str, Any]:
    """A deployment's default form: the preset, the knobs (None), its overrides, and the preset's full config as
    ``advanced`` (every key the UI sends back, so a run submitted unchanged has exactly these parameters).

    ``store.uri`` is left out of ``advanced``: its default depends on the machine (``$FARMFLOW_STORE`` or
    ``./.farmflow/store``), so a run takes the worker's default, or the deployment's ``store.uri`` override.
    """
    advanced = preset_config(preset).model_dump(mode="json")
    del advanced["store"]["uri"]
    return {
        "preset": preset,
        **dict.fromkeys(KNOBS),
        "overrides": list(overrides) if overrides else None,
        "advanced": advanced,
    }


def config_of(parameters: dict[str, Any]) -> FarmConfig:
    """`run_config` of a flow run's parameters (the form's keys; a flow's own, such as ``methods``, are ignored)."""
    return run_config(**{k: parameters.get(k) for k in ("preset", "advanced", "overrides", *KNOBS)})


def flow_run_name(flow_name: str, parameters: dict[str, Any]) -> str:
    """'<flow>[:<methods>]/<preset>/<config key>', e.g. 'compare:dpo+ppo/synthetic-tiny/3fa2c1e0'."""
    from farmflow.flows.pipeline import config_key

    try:
        cfg = config_of(parameters)
    except (ConfigError, ValueError):
        return f"{flow_name}/invalid-config"
    methods = parameters.get("methods")
    what = f"{flow_name}:{'+'.join(methods)}" if methods else flow_name
    return f"{what}/{cfg.name}/{config_key(cfg)}"


def prefect_run_name() -> str:
    """`flow_run_name` of the running flow (Prefect's ``flow_run_name`` callable)."""
    from prefect.runtime import flow_run

    return flow_run_name(flow_run.flow_name, flow_run.parameters)
