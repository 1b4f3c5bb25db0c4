"""What every config section shares: strict pydantic models and the one error type of the package."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class ConfigError(ValueError):
    """A bad preset name, unknown field or invalid value; the message names it."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, frozen=False)


# Bounds of sizes and counts: beyond them a run would exhaust memory (every split's rows, every batch's tensors
# are held in memory) or run for years, so the value is refused at validation with the bound in the message.
MAX_ROWS = 1_000_000
"""Most instructions in one data split or evaluation set (the paper's largest split: 20k)."""
MAX_BATCH = 100_000
"""Most sequences, pairs or prompts in one batch or rollout (the paper's largest: 512)."""
MAX_EPOCHS = 10_000
"""Most passes, rounds or optimizer steps per rollout (the paper's largest: 10 epochs)."""
MAX_TOKENS = 131_072
"""Most tokens in one sequence or response."""
MAX_SAMPLES = 65_536
"""Most samples drawn per prompt (best-of-n; the paper's largest: n=1024)."""
MAX_WIDTH = 1_048_576
"""Most units in one dimension of a model built from scratch (width, layers, heads, vocabulary, adapter rank)."""
MAX_IN_FLIGHT = 1_024
"""Most requests open at once to one API (each holds a connection, and a process has ~1024 file descriptors)."""
