"""What every config section shares: strict pydantic models and the one error type of the package."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A bad preset name, unknown field or invalid value; the message names it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)
