"""Where instructions come from: the synthetic farm, local AlpacaFarm-format files or the Hugging Face hub."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from farmflow.config.base import MAX_ROWS, Section

FARM_SPLIT_FILES = {"sft": "sft", "pref": "preference", "unlabeled": "unlabeled", "val": "val"}
"""Our split names -> the file names of tatsu-lab/alpaca_farm's alpaca_instructions/ folder."""


class DataConfig(Section):
    source: Literal["synthetic", "local", "hub"] = Field(
        "synthetic",
        description="Where instructions come from. 'synthetic': the offline farm with a known gold reward; 'local': "
        "AlpacaFarm-format JSON/JSONL/Parquet files (instructions_path or split_paths, and eval_path); 'hub': "
        "tatsu-lab/alpaca_farm from the Hugging Face hub (needs the optional 'datasets' package and a network).",
    )
    instructions_path: str | None = Field(
        None,
        description="source 'local': one file of (instruction, input, output) rows, split deterministically (seed) "
        "into SFT, PREF, unlabeled and val with the sizes below, or in their proportions when the file is smaller "
        "(paper: 10 : 10 : 20 : 2).",
    )
    split_paths: dict[str, str] = Field(
        default_factory=dict,
        description="source 'local': one file per split instead (keys sft, pref, unlabeled, val), e.g. the hub's "
        "splits exported; all four are needed; each split keeps its first *_size rows (the rows left out are counted "
        "in the data stage's metrics).",
    )
    eval_path: str | None = Field(
        None,
        description="source 'local': the evaluation set in AlpacaEval format (instruction, output = reference, "
        "generator, dataset).",
    )
    farm_dir: str | None = Field(
        None,
        description="source 'local': a folder in the layout of the tatsu-lab/alpaca_farm dataset repository: "
        "alpaca_instructions/{sft,preference,unlabeled,val}.json (or .jsonl/.parquet) and alpaca_farm_evaluation.json "
        "(at the top or inside alpaca_instructions/). Fills split_paths and eval_path (those given explicitly win).",
    )
    hub_name: str = Field(
        "tatsu-lab/alpaca_farm",
        description="source 'hub': the dataset repository (configs alpaca_instructions, alpaca_farm_evaluation).",
    )
    hub_revision: str | None = Field(
        None, description="source 'hub': the dataset revision (a commit pins the data, and so the stage key)."
    )
    content_sha256: dict[str, str] = Field(
        default_factory=dict,
        description="Filled in on validation: SHA-256 of each local data file that exists, so an edited file is a new "
        "data stage key (kept as given where the file is not on this machine).",
    )
    seed: int = Field(0, ge=0, description="Seed for task generation and split assignment.")
    families: list[str] = Field(
        default_factory=lambda: ["arithmetic", "sort", "reverse", "list_items", "max_number", "categorize"],
        min_length=1,
        description="Synthetic task families to draw instructions from (see farmflow.data.synthetic.FAMILIES).",
    )
    sft_size: int = Field(
        10_000, ge=1, le=MAX_ROWS, description="Instructions with demonstrations for SFT (paper: 10k)."
    )
    pref_size: int = Field(
        10_000, ge=1, le=MAX_ROWS, description="Instructions for pairwise preference collection (paper: 10k)."
    )
    unlabeled_size: int = Field(
        20_000,
        ge=0,
        le=MAX_ROWS,
        description="Unlabeled instructions for expert iteration, PPO and Quark (paper: 20k).",
    )
    val_size: int = Field(
        2_000,
        ge=1,
        le=MAX_ROWS,
        description="Validation instructions; their annotated pairs measure reward-model accuracy (paper: 2k).",
    )
    eval_size: int = Field(
        805, ge=2, le=MAX_ROWS, description="Evaluation instructions with reference outputs (paper: 805)."
    )
    demo_error_rate: float = Field(
        0.2,
        ge=0,
        le=1,
        description="Probability that an SFT demonstration contains a mistake (demonstrations are decent, not "
        "perfect).",
    )
    reference_error_rate: float = Field(
        0.35,
        ge=0,
        le=1,
        description="Probability that the reference policy's evaluation output contains a mistake; calibrated so a "
        "decent model wins about half the time.",
    )

    @model_validator(mode="before")
    @classmethod
    def _farm_dir(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not data.get("farm_dir"):
            return data
        root = Path(data["farm_dir"])
        if not root.is_dir():
            raise ValueError(f"farm_dir: {root} is not a folder")

        def find(folder: Path, stem: str) -> str:
            for suffix in (".json", ".jsonl", ".parquet"):
                if (folder / f"{stem}{suffix}").is_file():
                    return str(folder / f"{stem}{suffix}")
            raise ValueError(
                f"farm_dir: no {stem}.json, .jsonl or .parquet in {folder} (tatsu-lab/alpaca_farm's layout)"
            )

        instructions = root / "alpaca_instructions"
        splits = {ours: find(instructions, theirs) for ours, theirs in FARM_SPLIT_FILES.items()}
        if not data.get("eval_path"):
            try:
                data = data | {"eval_path": find(root, "alpaca_farm_evaluation")}
            except ValueError:
                data = data | {"eval_path": find(instructions, "alpaca_farm_evaluation")}
        return data | {"split_paths": splits | dict(data.get("split_paths") or {})}

    @model_validator(mode="after")
    def _local_files(self) -> "DataConfig":
        unknown = sorted(set(self.split_paths) - {"sft", "pref", "unlabeled", "val"})
        if unknown:
            raise ValueError(f"split_paths: unknown split {unknown}; known: sft, pref, unlabeled, val")
        missing = [s for s in ("sft", "pref", "unlabeled", "val") if self.split_paths and s not in self.split_paths]
        if missing:
            raise ValueError(
                f"split_paths: no file for split(s) {missing}; give one file for each of sft, pref, unlabeled and val, "
                "or one file in instructions_path to split"
            )
        if self.source != "local":
            return self
        if not self.eval_path or not (self.instructions_path or self.split_paths):
            raise ValueError("source 'local' needs eval_path and either instructions_path or split_paths")
        files = {
            "instructions": self.instructions_path,
            "eval": self.eval_path,
            **{f"split.{k}": v for k, v in self.split_paths.items()},
        }
        digests = dict(self.content_sha256)
        for name, path in files.items():
            if path and Path(path).is_file():
                digests[name] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
        if digests != self.content_sha256:
            object.__setattr__(self, "content_sha256", digests)  # bypasses validate_assignment (no re-entry)
        return self
