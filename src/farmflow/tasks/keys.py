"""What a stage key is made of: the part of a config that determines a stage's output.

A stage key (`farmflow.storage.stage_key`) hashes the stage name, its code version, `key_config(config)` and its
inputs' keys (narrowed to the parts the stage reads, `farmflow.tasks.registry.Stage.keyed_inputs`).
"""

from __future__ import annotations

from typing import Any, Callable

from pydantic import BaseModel

from farmflow.annotators import judges_key
from farmflow.config import AnnotatorConfig, ModelConfig
from farmflow.modelcache import model_files_key

KEY_EXTRA: dict[type, Callable[[Any], dict]] = {
    ModelConfig: lambda cfg: model_files_key(cfg.pretrained),
    AnnotatorConfig: judges_key,
}
"""Config type → what its fields alone do not pin down, added to its part of a stage key: a local model folder's
contents, each judge's identity (e.g. an endpoint from the environment, the prompt version)."""


def key_config(config: Any) -> Any:
    """The part of a stage config that determines its output.

    Fields declared with ``json_schema_extra={"stage_key": False}`` (how many requests in
    flight, timeouts, prices, where a secret lives...) are left out, at any depth, so
    changing them never invalidates a stage or anything downstream of it. Fields declared
    with ``{"stage_key": "unless_default"}`` enter the key only when set to something else
    than their default: an option added to a stage keeps the keys of every run that does
    not use it, so stores made before it stay valid. Pydantic models
    are validated again first: ``model_copy(update=...)`` skips validation, and an int
    left in a float field must not make a different key than the validated float.
    """
    if isinstance(config, BaseModel):
        config = type(config).model_validate(config.model_dump())
    return _key_part(config)


def _key_part(config: Any) -> Any:
    if isinstance(config, BaseModel):
        out = {}
        for name, field in type(config).model_fields.items():
            extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
            value, keyed = getattr(config, name), extra.get("stage_key", True)
            if keyed is True or (keyed == "unless_default" and value != field.get_default(call_default_factory=True)):
                out[name] = _key_part(value)
        derived = KEY_EXTRA.get(type(config))
        return out | (derived(config) if derived else {})
    if isinstance(config, dict):
        return {k: key_config(v) if isinstance(v, BaseModel) else _key_part(v) for k, v in config.items()}
    if isinstance(config, (list, tuple)):
        return [_key_part(v) for v in config]
    return config


def config_get(config: Any, name: str, default: Any = None) -> Any:
    """A field of a config that is a pydantic model or (from JSON) a dict."""
    return config.get(name, default) if isinstance(config, dict) else getattr(config, name, default)
