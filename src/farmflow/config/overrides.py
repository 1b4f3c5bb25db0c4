"""`load_config`: a preset, then overrides (``section.field=value`` or a nested dict), validated as a whole.

Any validation problem becomes one `ConfigError` line naming the field, never a pydantic traceback, and a value that
carries credentials is not repeated back.
"""

from __future__ import annotations

import json
import types
import typing
from typing import Any

from pydantic import BaseModel, ValidationError

from farmflow.config.annotators import AnnotatorConfig
from farmflow.config.base import ConfigError
from farmflow.config.credentials import CredentialsInValue
from farmflow.config.farm import FarmConfig
from farmflow.config.pools import ANNOTATOR_PRESETS
from farmflow.config.presets import preset


def describe_validation_error(err: ValidationError, prefix: str = "") -> str:
    """A pydantic error on one line: each problem names its field (`prefix.field`), joined by '; '."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in (prefix, *e["loc"]) if p != "")
        if e["type"] == "extra_forbidden":
            lines.append(f"unknown field {loc!r}")
        else:
            got = e.get("input")  # a whole section, or a value with credentials in it, is not repeated back
            quiet = isinstance(got, dict) or isinstance((e.get("ctx") or {}).get("error"), CredentialsInValue)
            lines.append(f"invalid value for {loc!r}: {e['msg']}" + ("" if quiet else f" (got {got!r})"))
    return "; ".join(lines)


def _parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like section.field=value")
    path, raw = item.split("=", 1)
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw  # a bare string
    return path.strip().split("."), value


def load_config(
    preset_name: str = "synthetic-tiny", overrides: list[str] | dict | None = None, base: FarmConfig | None = None
) -> FarmConfig:
    """A preset (or the config `base`) with overrides applied, validated as a whole.

    `overrides` is either a nested dict or a list of ``section.field=value`` strings whose
    values are parsed as JSON when possible (``best_of_n.n=8``, ``data.families=["sort"]``).
    """
    base = (base or preset(preset_name)).model_dump()
    if isinstance(overrides, dict):
        items = [(k.split("."), v) for k, v in overrides.items()]
    else:
        items = [_parse_override(o) for o in overrides or []]
    for path, value in items:
        node = base
        for i, part in enumerate(path[:-1]):
            if not isinstance(node, dict) or part not in node:
                raise ConfigError(f"unknown field {'.'.join(path[: i + 1])!r}")
            if node[part] is None:  # an optional section that is off has no fields to change one by one
                section = ".".join(path[: i + 1])
                raise ConfigError(
                    f"{section!r} is not set, so {'.'.join(path)!r} cannot be changed alone; set the section whole: "
                    f"--set '{section}={{...}}'"
                )
            node = node[part]
        if not isinstance(node, dict) or path[-1] not in node:
            raise ConfigError(f"unknown field {'.'.join(path)!r}")
        if path[-1] == "preset" and "api_pool" in node and isinstance(value, str):  # annotation.preset=NAME
            _select_preset(node, value)
            continue
        if (
            isinstance(node[path[-1]], dict) and "preset" in node[path[-1]] and isinstance(value, str)
        ):  # annotation=NAME; annotation=human:NAME (a person's labels: no preset)
            if value.startswith("human:"):
                node[path[-1]] |= {"preset": None, "kind": "human", "labeler": value.removeprefix("human:")}
            else:
                _select_preset(node[path[-1]], value)
            continue
        if (
            isinstance(node[path[-1]], dict) and node[path[-1]] and isinstance(value, dict)
        ):  # (an empty dict is a dict field)
            _merge(node[path[-1]], value, ".".join(path))  # a section: update only the fields given
        else:
            node[path[-1]] = _filled(path, value) if node[path[-1]] is None else value
    return validate_config(base)


def _section_model(path: list[str]) -> type[BaseModel] | None:
    """The config class of the (possibly optional) section at `path` in `FarmConfig`, or None for a plain field."""
    model: type[BaseModel] = FarmConfig
    for part in path:
        field = model.model_fields.get(part)
        if field is None:
            return None
        kinds = typing.get_args(field.annotation) if isinstance(field.annotation, types.UnionType) else ()
        found = [k for k in (*kinds, field.annotation) if isinstance(k, type) and issubclass(k, BaseModel)]
        if not found:
            return None
        model = found[0]
    return model


def _filled(path: list[str], value: Any) -> Any:
    """A section set whole where it was unset (None), with its defaults filled in, so that a later override can
    change one of its fields (``reward.backbone={...}`` then ``reward.backbone.model.num_layers=2``); left as given
    when it does not validate alone (the whole config's validation names the field)."""
    model = _section_model(path) if isinstance(value, dict) else None
    if model is None:
        return value
    try:
        return model.model_validate(value).model_dump()
    except ValidationError:
        return value


def _select_preset(section: dict, name: str) -> None:
    """Select annotator preset `name` in an annotator section (dict), keeping every field the preset does not fix.

    `annotation=NAME` and `annotation.preset=NAME` mean the same, whatever came before or
    after them (endpoint, limits, prices, seed stay); the fields the previous preset fixed
    make way for the new one's.
    """
    for chosen in (section.get("preset"), name):  # what the old and the new preset fix takes the new preset's values
        for field in ANNOTATOR_PRESETS.get(chosen or "", {}):
            section.pop(field, None)
    section["preset"] = name


def _merge(target: dict, update: dict, where: str) -> None:
    if "preset" in update and "api_pool" in target:  # an annotator section: its preset first, then the fields given
        _select_preset(target, update["preset"])
        update = {k: v for k, v in update.items() if k != "preset"}
        for k in update.keys() - target.keys():  # a field the preset fixed, given again: validation says if it clashes
            if k in AnnotatorConfig.model_fields:
                target[k] = None
    for k, v in update.items():
        if k not in target:
            raise ConfigError(f"unknown field {where + '.' + k!r}")
        if isinstance(target[k], dict) and isinstance(v, dict):
            _merge(target[k], v, f"{where}.{k}")
        else:
            target[k] = _filled(f"{where}.{k}".split("."), v) if target[k] is None else v


def validate_config(data: dict | FarmConfig) -> FarmConfig:
    if isinstance(data, FarmConfig):
        data = data.model_dump()
    try:
        return FarmConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError(describe_validation_error(err)) from None
