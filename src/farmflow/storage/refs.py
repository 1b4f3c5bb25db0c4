"""Artifact handles and stage keys: what is the same for every store backend."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, Field
from pydantic_core import to_jsonable_python

COMMIT_FILE = "_COMMIT.json"


class ArtifactRef(BaseModel):
    """A small, JSON-serializable handle on a committed artifact (what tasks pass around)."""

    uri: str = Field(description="Location of the artifact folder.")
    stage: str = Field(description="Stage that produced it.")
    key: str = Field(description="Stage key (content address).")
    kind: Literal["table", "model"] = Field(description="A Parquet table or a model folder.")
    format: str = Field(description="Table schema name (instructions, pairs, ...) or model type (policy, reward).")
    rows: int | None = Field(None, description="Rows of a table; None for models.")
    created: str = Field(description="UTC time of the commit, ISO 8601.")
    metrics: dict[str, float] = Field(
        default_factory=dict, description="Scalars the stage reported (loss, accuracy, seconds...)."
    )
    parts: dict[str, str] = Field(
        default_factory=dict,
        description="Content digests of named parts of a table (a data artifact's splits): a stage that reads only "
        "some parts is keyed on theirs (`part_key`), so a change elsewhere in the table does not rerun it.",
    )


def canonical_json(obj: Any) -> str:
    """Deterministic JSON of configs (pydantic models at any depth), the basis of stage keys."""
    return json.dumps(to_jsonable_python(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)


def digest(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj` (hex)."""
    return hashlib.sha256(canonical_json(obj).encode()).hexdigest()


def part_key(ref: ArtifactRef, parts: tuple[str, ...] | None) -> str:
    """What a stage that reads only `parts` of `ref` is keyed on: the digests of those parts.

    ``None`` means the whole artifact (its key), and so does an artifact committed without
    part digests (older stores keep their keys); ``()`` means the stage reads none of it.
    """
    if parts is None or not ref.parts:
        return ref.key
    unknown = sorted(set(parts) - set(ref.parts))
    if unknown:
        raise ValueError(f"artifact {ref.stage}/{ref.key[:12]} has no part {unknown[0]!r}; it has {sorted(ref.parts)}")
    return "parts:" + digest({"stage": ref.stage, "parts": {p: ref.parts[p] for p in sorted(set(parts))}})[:32]


def stage_key(stage: str, version: str | int, config: Any, inputs: dict[str, "ArtifactRef | str"] | None = None) -> str:
    """Content address of a stage output: same inputs and config ⇒ same key, anywhere."""
    input_keys = {name: (ref.key if isinstance(ref, ArtifactRef) else str(ref)) for name, ref in (inputs or {}).items()}
    return digest({"stage": stage, "version": str(version), "config": config, "inputs": input_keys})[:32]


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds")
