"""The real farm's data: AlpacaFarm instruction files, AlpacaEval evaluation files, the hub.

* `read_records(path)`: rows of a local JSON (a list of objects), JSONL or Parquet file.
* `load_instructions` / `load_eval`: those rows checked against the AlpacaFarm schema
  (instruction, input, output[, output_1, output_2, preference]) or the AlpacaEval one
  (instruction, output, generator, dataset; `input` optional). Any problem is one
  `DataError` naming the file, the column and the row.
* `split_sizes` / `split_instructions`: one instruction file split deterministically into
  AlpacaFarm's four splits in the proportions of the configured sizes (paper: SFT 10k :
  PREF 10k : unlabeled 20k : val 2k), for any number of rows.
* `build_real_farm(cfg)`: the same ``instructions`` table as the synthetic farm, from
  local files (`source="local"`) or the Hugging Face hub (`source="hub"`, needs the
  optional `datasets` package and a network). `task` is null: the real farm has no gold
  reward.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from farmflow.config import FARM_SPLIT_FILES, DataConfig
from farmflow.storage.schemas import SCHEMAS

TRAIN_SPLITS = ("sft", "pref", "unlabeled", "val")
INSTRUCTION_COLUMNS = {"instruction": str, "input": str, "output": str}
OPTIONAL_INSTRUCTION_COLUMNS = {"output_1": str, "output_2": str, "preference": (int, float)}
EVAL_COLUMNS = {"instruction": str, "output": str, "generator": str, "dataset": str}
HUB_SPLITS = FARM_SPLIT_FILES  # ours -> tatsu-lab/alpaca_farm's


class DataError(ValueError):
    """A data file that does not fit its schema; the message names file, column and row."""


def read_records(path: str | Path) -> list[dict]:
    """Rows of a .json (a list of objects), .jsonl or .parquet file."""
    return _read_records(path)[0]


def _read_records(path: str | Path) -> tuple[list, list[str] | None]:
    """(rows, how error messages name them): JSONL rows by their line in the file (blank lines skipped),
    None: "row i"."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".parquet":
            return pq.read_table(path).to_pylist(), None
        text = path.read_text(encoding="utf-8")
        if suffix == ".jsonl":
            rows, lines = [], []
            for i, line in enumerate(text.splitlines()):
                if line.strip():
                    try:
                        rows.append(json.loads(line))
                    except json.JSONDecodeError as e:
                        raise DataError(f"{path}: line {i + 1} is not valid JSON ({e.msg})") from None
                    lines.append(f"line {i + 1}")
            return rows, lines
        if suffix == ".json":
            if not text.strip():
                return [], None
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}: not valid JSON ({e.msg}; line {e.lineno}, column {e.colno})") from None
            if not isinstance(data, list):
                raise DataError(f"{path}: expected a JSON list of objects, got a {type(data).__name__}")
            return data, None
    except (OSError, UnicodeDecodeError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    raise DataError(f"{path}: unknown file type {suffix!r}; use .json, .jsonl or .parquet")


def check_records(
    rows: list,
    path: str | Path,
    required: dict[str, Any],
    optional: dict[str, Any] | None = None,
    names: list[str] | None = None,
) -> list[dict]:
    """Rows with every required column of the right type; `input` may be missing or null (then "").

    Errors name the row as "row i" (from 0), or as `names[i]` (a JSONL file's "line n")."""
    if not rows:
        raise DataError(f"{path}: the file has no rows")
    optional = optional or {}
    out = []
    for i, row in enumerate(rows):
        where = names[i] if names else f"row {i}"
        if not isinstance(row, dict):
            raise DataError(f"{path}: {where} is a {type(row).__name__}, not an object with columns {sorted(required)}")
        clean = dict(row)
        for col, kind in {**required, **optional}.items():
            value = row.get(col)
            if col == "input" and value is None:
                clean[col] = ""
                continue
            if col not in row or value is None:
                if col in required:
                    raise DataError(
                        f"{path}: {where}: missing column {col!r}"
                        if col not in row
                        else f"{path}: {where}: column {col!r} is null"
                    )
                continue
            if isinstance(value, bool) or not isinstance(value, kind):
                want = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
                raise DataError(
                    f"{path}: {where}: column {col!r} must be {want}, got {type(value).__name__} {str(value)[:40]!r}"
                )
        if not clean["instruction"].strip():
            raise DataError(f"{path}: {where}: column 'instruction' is empty")
        out.append(clean)
    return out


def load_instructions(path: str | Path) -> list[dict]:
    """AlpacaFarm-format rows: instruction, input, output (optionally output_1, output_2, preference)."""
    rows, names = _read_records(path)
    return check_records(rows, path, INSTRUCTION_COLUMNS, OPTIONAL_INSTRUCTION_COLUMNS, names)


def load_eval(path: str | Path) -> list[dict]:
    """AlpacaEval-format rows: instruction, output (the reference), generator, dataset; `input` optional."""
    rows, names = _read_records(path)
    return check_records(rows, path, EVAL_COLUMNS, {"input": str}, names)


def split_sizes(total: int, weights: dict[str, int]) -> dict[str, int]:
    """`total` rows shared in proportion to `weights` (largest remainder; ties to the earlier split)."""
    wsum = sum(weights.values())
    exact = {k: total * w / wsum for k, w in weights.items()}
    sizes = {k: int(v) for k, v in exact.items()}
    order = sorted(weights, key=lambda k: (-(exact[k] - sizes[k]), list(weights).index(k)))
    for k in order[: total - sum(sizes.values())]:
        sizes[k] += 1
    return sizes


def _dedupe(rows: list[dict]) -> tuple[list[dict], int]:
    seen, out = set(), []
    for r in rows:
        k = (r["instruction"], r["input"])
        if k not in seen:
            seen.add(k)
            out.append(r)
    return out, len(rows) - len(out)


def split_instructions(
    rows: list[dict], cfg: DataConfig, source: str = "instructions"
) -> tuple[dict[str, list[dict]], dict[str, int]]:
    """One instruction file as AlpacaFarm's four splits, deterministic in cfg.seed.

    Repeated (instruction, input) pairs are kept once, so the splits are disjoint. The
    splits get the configured sizes when the file has enough rows; a smaller file is
    shared in their proportions (paper sizes: 10 : 10 : 20 : 2). Returns the splits and
    counts of rows left out (`duplicates_dropped`, `rows_unused`).
    """
    rows, dropped = _dedupe(rows)
    want = {"sft": cfg.sft_size, "pref": cfg.pref_size, "unlabeled": cfg.unlabeled_size, "val": cfg.val_size}
    total = min(len(rows), sum(want.values()))
    if total < sum(1 for v in want.values() if v):
        raise DataError(
            f"{source}: {len(rows)} distinct instructions cannot fill the splits {[k for k, v in want.items() if v]}"
        )
    sizes = want if total == sum(want.values()) else split_sizes(total, want)
    order = list(range(len(rows)))
    random.Random(f"{cfg.seed}/alpaca-split").shuffle(order)
    splits, at = {}, 0
    for name in TRAIN_SPLITS:
        splits[name] = [rows[i] for i in sorted(order[at : at + sizes[name]])]  # file order within a split
        at += sizes[name]
    return splits, {"duplicates_dropped": dropped, "rows_unused": len(rows) - total}


def check_disjoint(named: dict[str, list[dict]], sources: dict[str, str]) -> None:
    """Error when an (instruction, input) appears in two splits, naming both files and rows."""
    seen: dict[tuple[str, str], tuple[str, int]] = {}
    for split, rows in named.items():
        for i, r in enumerate(rows):
            k = (r["instruction"], r.get("input") or "")
            if k in seen and seen[k][0] != split:
                s0, i0 = seen[k]
                raise DataError(
                    f"{sources[split]}: row {i}: column 'instruction' duplicates {sources[s0]} row {i0} "
                    f"(splits {s0!r} and {split!r} must be disjoint): {r['instruction'][:60]!r}"
                )
            seen.setdefault(k, (split, i))


def load_hub(cfg: DataConfig) -> tuple[dict[str, list[dict]], list[dict]]:
    """AlpacaFarm's splits and evaluation set from the Hugging Face hub (needs `datasets` and a network)."""
    try:
        import datasets  # optional: pip install datasets
    except ImportError:
        raise DataError(
            "data.source='hub' needs the optional 'datasets' package (pip install datasets) and network access; "
            "offline, export the splits to JSON/JSONL/Parquet and use data.source='local'"
        ) from None
    try:
        train = datasets.load_dataset(cfg.hub_name, "alpaca_instructions", revision=cfg.hub_revision)
        evals = datasets.load_dataset(cfg.hub_name, "alpaca_farm_evaluation", revision=cfg.hub_revision)
    except Exception as e:  # offline, unknown dataset, ...: one clear line
        raise DataError(
            f"cannot load {cfg.hub_name!r} from the Hugging Face hub ({type(e).__name__}: {str(e)[:200]})"
        ) from None
    splits = {
        ours: check_records(list(train[theirs]), f"{cfg.hub_name}:{theirs}", INSTRUCTION_COLUMNS)
        for ours, theirs in HUB_SPLITS.items()
    }
    eval_split = next(iter(evals.values()))
    rows = check_records(
        list(eval_split), f"{cfg.hub_name}:alpaca_farm_evaluation", {"instruction": str, "output": str}, {"input": str}
    )
    return splits, rows


def build_real_farm(cfg: DataConfig) -> tuple[pa.Table, dict[str, float]]:
    """The ``instructions`` table of the real farm and counts of what was left out."""
    counts: dict[str, int] = {}
    if cfg.source == "hub":
        splits, eval_rows = load_hub(cfg)
        sources = {s: f"{cfg.hub_name}:{HUB_SPLITS[s]}" for s in TRAIN_SPLITS}
    else:
        if cfg.eval_path is None:
            raise DataError(
                "data.eval_path: the real farm needs an evaluation file (AlpacaEval format: instruction, output, "
                "generator, dataset)"
            )
        if cfg.split_paths:
            sources = dict(cfg.split_paths)
            loaded = {s: load_instructions(p) for s, p in cfg.split_paths.items()}
            sizes = {"sft": cfg.sft_size, "pref": cfg.pref_size, "unlabeled": cfg.unlabeled_size, "val": cfg.val_size}
            splits = {s: loaded[s][: sizes[s]] for s in TRAIN_SPLITS}
            counts = {
                f"{s}_rows_unused": len(loaded[s]) - len(splits[s])
                for s in TRAIN_SPLITS
                if len(loaded[s]) > len(splits[s])
            }
        else:
            if cfg.instructions_path is None:
                raise DataError(
                    "data.instructions_path (one file to split) or data.split_paths (one file per split) is needed for "
                    "data.source='local'"
                )
            sources = {s: str(cfg.instructions_path) for s in TRAIN_SPLITS}
            splits, counts = split_instructions(
                load_instructions(cfg.instructions_path), cfg, str(cfg.instructions_path)
            )
        eval_rows = load_eval(cfg.eval_path)
        sources["eval"] = str(cfg.eval_path)
    eval_rows = eval_rows[: cfg.eval_size]
    sources.setdefault("eval", f"{cfg.hub_name}:alpaca_farm_evaluation")
    check_disjoint({"eval": eval_rows, **splits}, sources)
    columns: dict[str, list] = {k: [] for k in ("id", "split", "family", "instruction", "input", "output", "task")}

    def add(split: str, i: int, family: str, r: dict, output: str) -> None:
        for name, value in (
            ("id", f"{split}-{i:05d}"),
            ("split", split),
            ("family", family),
            ("instruction", r["instruction"]),
            ("input", r.get("input") or ""),
            ("output", output),
            ("task", None),
        ):
            columns[name].append(value)

    for i, r in enumerate(eval_rows):
        add("eval", i, r.get("dataset") or "eval", r, r["output"])
    for split in TRAIN_SPLITS:
        for i, r in enumerate(splits[split]):
            add(split, i, "alpaca", r, r["output"] if split == "sft" else "")
    return pa.table(columns, schema=SCHEMAS["instructions"]), {k: float(v) for k, v in counts.items()}
