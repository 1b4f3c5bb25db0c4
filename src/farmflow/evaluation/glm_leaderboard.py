"""An AlpacaEval 2 leaderboard from a table of per-instruction judgments: win rate, SE, LC win rate, LC SE.

Input: a Parquet file (or a folder of them) with one row per (evaluated model, instruction):
`generator`, `index` (the instruction's position; `instruction` text when there is no index),
`preference` (AlpacaEval's, in [1, 2]), `len_1` (characters of the baseline's output) and
`len_2` (of the model's). Exact duplicate rows are dropped (and counted); two different
judgments of the same model and instruction are an error.

The baseline is the generator judged against itself (len_1 = len_2 on every row), or the one
named. Its deliberately verbose/concise variants, `<baseline>_verbose` and `<baseline>_concise`,
are the gamed rows of every model's fit when both are in the table (`glm_lc` otherwise uses
its stand-in). One difficulty table is fitted over every run (`glm_difficulty`), then each model
is fitted alone (`glm_lc`); the baseline's LC is 50 by construction, as AlpacaEval sets it.

`by_position`: AlpacaEval looks a row's difficulty up by the row's position in the model's
annotations file rather than by its instruction, so a model with missing rows gets the
difficulties of the wrong instructions after the first gap. Its published LC values carry
this, so it is the default (the LC means what AlpacaEval 2 reports); turn it off to look
difficulty up by instruction. Both agree on a model without missing rows. The gamed rows
(judged or stand-in) always take the difficulty of their own instruction.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np

from farmflow.evaluation.glm_difficulty import joint_difficulty
from farmflow.evaluation.glm_lc import CS, gamed_rows, gamed_standin, glm_lc
from farmflow.evaluation.stats import win_rate_stats

REQUIRED = ("generator", "preference", "len_1", "len_2")


def read_judgments(path: str | Path) -> tuple[list[dict], int]:
    """Rows of a judgments Parquet file or folder of Parquet files; (rows without exact duplicates, duplicates)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path}: no .parquet files in this folder")
    tables = []
    for f in files:
        try:
            t = pq.read_table(f)
        except (OSError, pa.ArrowInvalid) as err:
            raise ValueError(f"cannot read {f}: {err}") from None
        missing = [c for c in REQUIRED if c not in t.column_names]
        if missing or not {"index", "instruction"} & set(t.column_names):
            need = missing or ["index or instruction"]
            raise ValueError(f"{f}: missing column {need[0]!r} (needs {', '.join(REQUIRED)} and index or instruction)")
        tables.append(t)
    rows = [r for t in tables for r in t.to_pylist()]
    exact_seen: set[tuple] = set()
    keys_seen: set[tuple] = set()
    unique, dups = [], 0
    for r in rows:
        exact = tuple(sorted((k, repr(v)) for k, v in r.items()))
        if exact in exact_seen:
            dups += 1
            continue
        key = (r["generator"], r.get("index", r.get("instruction")))
        if key in keys_seen:
            raise ValueError(f"{path}: two different judgments of generator {key[0]!r} on instruction {key[1]!r}")
        exact_seen.add(exact)
        keys_seen.add(key)
        unique.append(r)
    return unique, dups


def _find_baseline(by_model: dict[str, list[dict]], baseline: str | None) -> str | None:
    if baseline is not None:
        if baseline not in by_model:
            raise ValueError(f"baseline {baseline!r} is not a generator of the table")
        return baseline
    selfs = [g for g, rs in by_model.items() if all(r["len_1"] == r["len_2"] for r in rs)]
    return selfs[0] if len(selfs) == 1 else None


def _run(rows: list[dict], gamed: bool = False) -> dict:
    return {
        "keys": [r.get("index", r.get("instruction")) for r in rows],
        "preferences": [r["preference"] for r in rows],
        "len_1": [r["len_1"] for r in rows],
        "len_2": [r["len_2"] for r in rows],
        "gamed": gamed,
    }


def leaderboard(
    rows: list[dict],
    baseline: str | None = None,
    by_position: bool = True,
    difficulty: dict | None = None,
    difficulty_Cs: np.ndarray = CS,
    table_only: bool = False,
) -> tuple[list[dict], dict]:
    """Per-model statistics (module doc), best LC first, and facts about the fit (baseline, gamed rows, C, table).

    `difficulty`: a table (instruction key → difficulty) to use instead of fitting one;
    `difficulty_Cs`: the grid the difficulty fit's cross-validation chooses C from (one value: that C);
    `table_only`: fit the difficulty table and return no rows.
    """
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["generator"], []).append(r)
    for rs in by_model.values():
        rs.sort(key=lambda r: (str(type(r.get("index", r.get("instruction")))), r.get("index", r.get("instruction"))))
    base = _find_baseline(by_model, baseline)
    variants = [f"{base}_verbose", f"{base}_concise"] if base else []
    have_gamed = bool(variants) and all(v in by_model for v in variants)
    C = math.nan
    if difficulty is None:
        runs = [_run(rs, gamed=have_gamed and g in variants) for g, rs in by_model.items()]
        difficulty, C = joint_difficulty(runs, Cs=difficulty_Cs)
    info = {"baseline": base, "gamed_rows": "judged" if have_gamed else "stand-in", "difficulty_C": C}
    info["difficulty"] = difficulty
    if table_only:
        return [], info
    order = sorted(difficulty, key=lambda k: (str(type(k)), k))

    def diff_of(rs: list[dict], positional: bool = False) -> np.ndarray:
        if positional:
            return np.array([difficulty[order[i]] if i < len(order) else 0.0 for i in range(len(rs))])
        return np.array([difficulty.get(r.get("index", r.get("instruction")), 0.0) for r in rs])

    gamed = None
    if have_gamed:
        gamed = gamed_rows(
            [
                {k: [r[k] for r in by_model[v]] for k in ("len_1", "len_2")}
                | {"preferences": [r["preference"] for r in by_model[v]], "difficulty": diff_of(by_model[v])}
                for v in variants
            ]
        )
    out = []
    for g, rs in by_model.items():
        stats = win_rate_stats([r["preference"] for r in rs], [])
        row = {
            "model": g,
            "n_total": int(stats["n_total"]),
            "win_rate": stats["win_rate"],
            "standard_error": stats["standard_error"],
            "discrete_win_rate": stats["discrete_win_rate"],
            "avg_length": int(sum(r["len_2"] for r in rs) / len(rs)),
        }
        if g == base:
            row |= {"lc_win_rate": 50.0, "lc_standard_error": 0.0}
        else:
            prefs, ref = [r["preference"] for r in rs], [r["len_1"] for r in rs]
            fixed = gamed if gamed is not None else gamed_standin(ref, diff_of(rs))  # gamed rows: by instruction
            lc = glm_lc(prefs, ref, [r["len_2"] for r in rs], diff_of(rs, by_position), fixed)
            row |= {k: lc[k] for k in ("lc_win_rate", "lc_standard_error", "lc_length_coef", "lc_difficulty_coef")}
        out.append(row)
    out.sort(key=lambda r: -r["lc_win_rate"])
    return out, info


def held_out(
    rows: list[dict],
    models: list[str],
    folds: int = 4,
    baseline: str | None = None,
    by_position: bool = True,
    difficulty_Cs: np.ndarray = CS,
) -> tuple[list[dict], dict]:
    """`leaderboard` rows of `models`, each scored with a difficulty table fitted without its own judgments.

    The models (the baseline left out) are sorted by name and split into `folds` folds, fold k = names[k::folds];
    per fold one difficulty table is fitted over every other run of `rows` (its cross-validation included), then the
    fold's models are fitted with it. So no LC of the result rests on its own model's outcomes in the table: what a
    newly evaluated model gets from a table fitted before it. Returns the rows (best LC first) and the fits' facts
    (baseline, gamed rows, the C of each fold)."""
    by_model: dict[str, list[dict]] = {}
    for r in rows:
        by_model.setdefault(r["generator"], []).append(r)
    base = _find_baseline(by_model, baseline)
    gamed = {f"{base}_verbose", f"{base}_concise"} if base else set()
    names = sorted(m for m in models if m in by_model and m != base and m not in gamed)
    out, Cs, info = [], [], {}
    for k in range(min(folds, len(names))):
        fold = set(names[k::folds])
        others = [r for r in rows if r["generator"] not in fold]
        _, fit = leaderboard(
            others, baseline=base, by_position=by_position, difficulty_Cs=difficulty_Cs, table_only=True
        )
        scored = [r for r in rows if r["generator"] in fold or r["generator"] == base or r["generator"] in gamed]
        board, info = leaderboard(scored, baseline=base, by_position=by_position, difficulty=fit["difficulty"])
        out += [r for r in board if r["model"] in fold]
        Cs.append(fit["difficulty_C"])
    out.sort(key=lambda r: -r["lc_win_rate"])
    return out, {k: info.get(k) for k in ("baseline", "gamed_rows")} | {"difficulty_C": Cs, "folds": len(Cs)}


def read_published(path: str | Path) -> dict[str, dict[str, float]]:
    """An AlpacaEval leaderboard CSV (first column the model): model → {win_rate, lc_win_rate}."""
    try:
        with open(path, newline="") as f:
            rows = list(csv.reader(f))
    except OSError as err:
        raise ValueError(f"cannot read {path}: {err}") from None
    if not rows or "length_controlled_winrate" not in rows[0]:
        raise ValueError(f"{path}: expected a leaderboard CSV with a 'length_controlled_winrate' column")
    head = rows[0]
    out = {}
    for i, r in enumerate(rows[1:], start=2):
        rec = dict(zip(head, r))
        try:
            out[r[0]] = {
                "win_rate": float(rec["win_rate"]) if rec.get("win_rate") else math.nan,
                "lc_win_rate": float(rec["length_controlled_winrate"]),
            }
        except ValueError:
            raise ValueError(f"{path}: line {i}: length_controlled_winrate is not a number") from None
    return out


def compare(board: list[dict], published: dict[str, dict[str, float]]) -> dict[str, float]:
    """Add published_lc and lc_delta (ours − published) to the rows that have one; the agreement summary.

    Summary over the models in both: n, median and max |Δ|, share within 1 point, Spearman of the LC
    values, and the largest |Δ| between the raw win rates.
    """
    from scipy.stats import spearmanr

    ours, theirs, raw = [], [], []
    for row in board:
        pub = published.get(row["model"])
        if pub is None:
            continue
        row["published_lc"] = pub["lc_win_rate"]
        row["lc_delta"] = row["lc_win_rate"] - pub["lc_win_rate"]
        ours.append(row["lc_win_rate"])
        theirs.append(pub["lc_win_rate"])
        raw.append(abs(row["win_rate"] - pub["win_rate"]))
    if not ours:
        return {"n": 0}
    err = np.abs(np.array(ours) - np.array(theirs))
    return {
        "n": len(ours),
        "median_abs_delta": float(np.median(err)),
        "max_abs_delta": float(err.max()),
        "within_1": float(np.mean(err <= 1.0)),
        "spearman": float(spearmanr(ours, theirs).statistic) if len(ours) > 2 else math.nan,
        "max_abs_win_rate_delta": float(np.nanmax(raw)),
    }
