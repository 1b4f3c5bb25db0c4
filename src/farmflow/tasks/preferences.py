"""Stages that make preferences without asking an annotator: people's labels of the sampled pairs, and a nested
share of the preferences.

* ``human_preferences``: sampled pairs + a person's labels in the store (`farmflow.labeling`) → a ``preferences``
  table of the pairs that person labeled (the paper's human arm: the reward model and DPO train on it as on any
  annotator's). Its config holds the labeler and a digest of their labels, so a new or undone label makes new
  preferences and everything downstream reruns, and unchanged labels reuse every stage.
* ``subsample_preferences``: preferences → the first `fraction` of the PREF pairs in a seeded random order (nested:
  a smaller share is a prefix of a larger one), the val pairs kept whole for held-out measurements (the
  feedback-size study, `farmflow.flows.feedback`).
"""

from __future__ import annotations

import hashlib
import math

import pyarrow as pa

from farmflow.annotators import unit_hash
from farmflow.data import gold_reward
from farmflow.labeling.labels import annotator, labels, own_preference, pair_key
from farmflow.storage import ArtifactRef
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.registry import STAGES
from farmflow.tasks.stage import StageRun, Table, stage_task


def labels_digest(store, labeler: str) -> str:
    """A digest of `labeler`'s labels in force (pair key and preference): the human_preferences stage's key part."""
    given = sorted((r["key"], r["preference"]) for r in labels(store, labeler))
    return hashlib.sha256(repr(given).encode()).hexdigest()[:16]


def human_config(store, labeler: str) -> dict:
    """The human_preferences stage's config for `labeler`'s labels as they are in `store` now."""
    return {"labeler": labeler, "labels": labels_digest(store, labeler)}


@stage_task(STAGES["human_preferences"])
def human_preferences_task(run: StageRun, config: dict, pairs: ArtifactRef) -> Table:
    """The sampled pairs a person labeled, with their preference (config: {"labeler", "labels": digest})."""
    labeler = config["labeler"]
    given = {r["key"]: r for r in labels(run.store, labeler)}
    rows = run.store.read_table(pairs).to_pylist()
    out = []
    for row in rows:
        label = given.get(pair_key(labeler, row))
        if label is None:
            continue
        out.append(
            {k: row[k] for k in ("id", "split", "instruction", "input", "output_1", "output_2", "task")}
            | {
                "annotator": annotator(labeler),
                "preference": own_preference(label, row),
                "noised": False,
                "swapped": None,
                "gold_1": gold_reward(row.get("task"), row["output_1"]),
                "gold_2": gold_reward(row.get("task"), row["output_2"]),
            }
        )
    train = sum(r["split"] == "pref" for r in out)
    if not train:
        raise ValueError(
            f"human_preferences: human:{labeler} labeled none of the PREF pairs of sample_pairs {pairs.key[:12]} "
            f"({len(out)} val pairs); label them with: farmflow label serve --pairs sample_pairs/{pairs.key[:12]} "
            f"--labeler {labeler}"
        )
    prefs = [r["preference"] for r in out]
    return Table(
        pa.Table.from_pylist(out, schema=SCHEMAS["preferences"]),
        "preferences",
        {
            "pairs": float(len(rows)),
            "labeled": float(len(out)),
            "labeled_pref": float(train),
            "output_2_preferred": sum(p > 1.5 for p in prefs) / len(prefs),
            "cost_usd": 0.0,
        },
    )


def subsample(rows: list[dict], fraction: float, seed: int) -> list[dict]:
    """The first ceil(fraction × PREF rows) PREF rows in a seeded order (nested across fractions) and every other
    row, in the table's order."""
    pref = [r for r in rows if r["split"] == "pref"]
    keep = math.ceil(fraction * len(pref))
    chosen = {r["id"] for r in sorted(pref, key=lambda r: unit_hash(seed, "feedback", r["id"]))[:keep]}
    return [r for r in rows if r["split"] != "pref" or r["id"] in chosen]


@stage_task(STAGES["subsample_preferences"])
def subsample_preferences_task(run: StageRun, config: dict, preferences: ArtifactRef) -> Table:
    """A nested share of the PREF pairs (config: {"fraction": f in (0, 1], "seed": int}); val pairs kept whole."""
    fraction = config["fraction"]
    if not 0 < fraction <= 1:
        raise ValueError(f"subsample_preferences: fraction {fraction} must be in (0, 1]")
    rows = subsample(run.store.read_table(preferences).to_pylist(), fraction, config.get("seed", 0))
    pref = sum(r["split"] == "pref" for r in rows)
    return Table(pa.Table.from_pylist(rows, schema=SCHEMAS["preferences"]), "preferences", {"pref_pairs": float(pref)})
