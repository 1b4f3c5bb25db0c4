"""Instruction data: the synthetic farm's splits, the prompt template, gold rewards.

`build_synthetic_farm(cfg)` returns one ``instructions`` table holding every split
(AlpacaFarm's proportions SFT : PREF : unlabeled : val = 10 : 10 : 20 : 2, plus the
evaluation set). SFT rows carry a demonstration, eval rows a reference output from the
fixed reference policy, and every row its task as JSON so the gold reward of any output
can be computed later (`gold_reward`).
"""

from __future__ import annotations

import random

import pyarrow as pa

from farmflow.config import DataConfig
from farmflow.data import synthetic
from farmflow.data.prompts import format_prompt
from farmflow.storage.refs import digest

SPLITS = ("sft", "pref", "unlabeled", "val", "eval")


def build_synthetic_farm(cfg: DataConfig) -> pa.Table:
    """Every split of the synthetic farm, deterministic in cfg.seed.

    Families are interleaved round-robin so each split has the same mix. The evaluation
    split is generated first from its own seed stream, so its instructions and reference
    outputs do not change when other split sizes change.
    """
    unknown = [f for f in cfg.families if f not in synthetic.FAMILIES]
    if unknown:
        raise ValueError(f"data.families: unknown task family {unknown}; known: {list(synthetic.FAMILIES)}")
    sizes = {
        "eval": cfg.eval_size,
        "sft": cfg.sft_size,
        "pref": cfg.pref_size,
        "unlabeled": cfg.unlabeled_size,
        "val": cfg.val_size,
    }
    columns: dict[str, list] = {k: [] for k in ("id", "split", "family", "instruction", "input", "output", "task")}
    for split in ("eval", "sft", "pref", "unlabeled", "val"):
        rng = random.Random(f"{cfg.seed}/{split}")
        for i in range(sizes[split]):
            family = cfg.families[i % len(cfg.families)]
            task = synthetic.sample_task(family, rng)
            if split == "sft":
                output = synthetic.demonstrate(task, rng, cfg.demo_error_rate)
            elif split == "eval":
                output = synthetic.reference_output(task, rng, cfg.reference_error_rate)
            else:
                output = ""
            for name, value in (
                ("id", f"{split}-{i:05d}"),
                ("split", split),
                ("family", family),
                ("instruction", task.instruction),
                ("input", task.input),
                ("output", output),
                ("task", synthetic.task_to_json(task)),
            ):
                columns[name].append(value)
    return pa.table(columns)


def split_digests(table: pa.Table) -> dict[str, str]:
    """Split → content digest of its rows (in order): what a stage reading only some splits is keyed on."""
    rows: dict[str, list[dict]] = {split: [] for split in SPLITS}
    for r in table.to_pylist():
        rows.setdefault(r["split"], []).append(r)
    return {split: digest(rs) for split, rs in rows.items()}


def split_rows(table: pa.Table, split: str) -> list[dict]:
    """Rows of one split as dicts (order preserved)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; known: {SPLITS}")
    return [r for r in table.to_pylist() if r["split"] == split]


def gold_reward(task_json: str | None, output: str) -> float | None:
    """Gold reward of `output` for a synthetic task; None in the real farm (no task)."""
    if not task_json:
        return None
    task = synthetic.task_from_json(task_json)
    return synthetic.gold_reward(task.family, task.params, output)


def prompts_of(rows: list[dict]) -> list[str]:
    return [format_prompt(r["instruction"], r["input"]) for r in rows]


__all__ = [
    "SPLITS",
    "build_synthetic_farm",
    "format_prompt",
    "gold_reward",
    "prompts_of",
    "split_digests",
    "split_rows",
]
