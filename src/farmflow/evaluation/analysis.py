"""Annotator analysis (AlpacaFarm §4.3 and App. C) and ranking correlations.

Input: labels of several annotators on the same pairs, one record per label:
``{"instruction", "input", "output_1", "output_2", "annotator", "preference"}`` plus,
when known, ``gold_1``/``gold_2`` (synthetic farm), ``price_usd`` and ``latency_s`` (the
annotation cache's columns). A pair is identified by its instruction, input and the set
of its two outputs; the order they came in does not matter (preferences are re-expressed
relative to a canonical order). Agreement between two labels a, b in [1, 2] is
1 − |a − b|: 1 for the same choice, 0 for opposite choices, 0.5 for a tie against a choice.

Per annotator:

* agreement: mean agreement of its labels with the reference label of the pair: the gold
  preference (the output with the higher gold reward), or the majority of the *other*
  annotators' labels on that pair (leave-one-out). Pairs where the reference is
  indifferent (equal gold, a split vote) are left out of agreement and bias;
* bias: 1 − agreement between the annotator's mode on a pair (over its draws) and the
  reference's mode, averaged over pairs: the systematic part of the disagreement;
* variance: how often a held-out draw disagrees with the majority of the annotator's
  other draws on the same pair (needs at least two draws per pair; NaN otherwise);
* length / list preference: among its decisive labels, the share that prefers the
  longer output (pairs of different lengths), and the list-formatted output (pairs
  where exactly one output is a list);
* price and time per 1000 annotations, from price_usd / latency_s when present.

`ranking_correlation` compares how two evaluators rank the same methods (Spearman on
average ranks, and Pearson on the scores).
"""

from __future__ import annotations

import hashlib
import math
import random
import time
from collections import Counter, defaultdict
from typing import Sequence

import numpy as np

from farmflow.annotators import OracleAnnotator, is_list, unit_hash
from farmflow.config import AnnotatorConfig
from farmflow.evaluation.stats import parse_preference

COLUMNS = (
    "annotator",
    "labels",
    "pairs",
    "agreement",
    "bias",
    "variance",
    "length_pref",
    "list_pref",
    "price_per_1000",
    "seconds_per_1000",
)


def agree(a: float, b: float) -> float:
    return 1.0 - abs(a - b)


def mode(labels: Sequence[float]) -> float:
    """Majority label of 1 / 2 / 1.5 values (fractions rounded); a tie between 1 and 2 is 1.5."""
    votes = Counter(1.0 if p < 1.5 else 2.0 if p > 1.5 else 1.5 for p in labels)
    ones, twos = votes[1.0], votes[2.0]
    return 1.0 if ones > twos else 2.0 if twos > ones else 1.5


def pair_key(row: dict) -> tuple[str, bool]:
    """(pair id, whether output_1/output_2 are in reversed canonical order)."""
    a, b = row.get("output_1") or "", row.get("output_2") or ""
    first, second = sorted((a, b))
    h = hashlib.blake2b(
        "\x1f".join((row.get("instruction") or "", row.get("input") or "", first, second)).encode(), digest_size=12
    )
    return h.hexdigest(), a != first


def normalize(rows: Sequence[dict]) -> list[dict]:
    """Labels re-expressed on canonical pairs; rows with an unusable preference are dropped."""
    out = []
    for r in rows:
        p = parse_preference(r.get("preference"))
        if p is None:
            continue
        key, flipped = pair_key(r)
        a, b = (
            (r.get("output_2") or "", r.get("output_1") or "")
            if flipped
            else (r.get("output_1") or "", r.get("output_2") or "")
        )
        g1, g2 = (r.get("gold_2"), r.get("gold_1")) if flipped else (r.get("gold_1"), r.get("gold_2"))
        gold = None if g1 is None or g2 is None else (1.5 if g1 == g2 else 2.0 if g2 > g1 else 1.0)
        out.append(
            {
                "pair": key,
                "annotator": str(r.get("annotator") or "?"),
                "preference": 3.0 - p if flipped else p,
                "gold": gold,
                "len": (len(a), len(b)),
                "list": (is_list(a), is_list(b)),
                "price_usd": r.get("price_usd"),
                "latency_s": r.get("latency_s"),
            }
        )
    return out


def _known(values: Sequence[object]) -> list[float]:
    out = []
    for v in values:
        try:
            x = float(v)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            continue
        if not math.isnan(x):
            out.append(x)
    return out


def _mean(xs: Sequence[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else math.nan


def annotator_table(rows: Sequence[dict], reference: str = "auto") -> list[dict]:
    """One row per annotator (module doc). reference: "gold", "others" or "auto" (gold when every pair has it).

    Adds a row "gold" (the reference itself: its length and list preferences) when gold is known.
    """
    labels = normalize(rows)
    if not labels:
        raise ValueError("no usable labels (every preference missing or malformed)")
    has_gold = all(lab["gold"] is not None for lab in labels)
    if reference == "auto":
        reference = "gold" if has_gold else "others"
    if reference == "gold" and not has_gold:
        raise ValueError("reference 'gold' needs gold_1 and gold_2 on every label (synthetic farm only)")
    if reference not in ("gold", "others"):
        raise ValueError(f"unknown reference {reference!r}; use 'gold', 'others' or 'auto'")
    by_pair: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    info: dict[str, dict] = {}
    for lab in labels:
        by_pair[lab["pair"]][lab["annotator"]].append(lab["preference"])
        info[lab["pair"]] = lab

    def ref_of(pair: str, annotator: str) -> float | None:
        if reference == "gold":
            return info[pair]["gold"]
        others = [p for a, ps in by_pair[pair].items() if a != annotator for p in ps]
        return mode(others) if others else None

    table = []
    for annotator in sorted({lab["annotator"] for lab in labels}):
        mine = [lab for lab in labels if lab["annotator"] == annotator]
        agreement, bias, variance = [], [], []
        for pair, per in by_pair.items():
            draws = per.get(annotator)
            if not draws:
                continue
            ref = ref_of(pair, annotator)
            if ref is not None and ref != 1.5:  # an indifferent reference (equal gold, split vote) says nothing
                agreement += [agree(p, ref) for p in draws]
                bias.append(1.0 - agree(mode(draws), ref))
            if len(draws) >= 2:
                variance += [1.0 - agree(p, mode(draws[:i] + draws[i + 1 :])) for i, p in enumerate(draws)]
        table.append(
            {
                "annotator": annotator,
                "labels": len(mine),
                "pairs": len({lab["pair"] for lab in mine}),
                "agreement": _mean(agreement),
                "bias": _mean(bias),
                "variance": _mean(variance),
                **preference_rates([(lab["preference"], lab) for lab in mine]),
                "price_per_1000": 1000 * _mean(_known([lab["price_usd"] for lab in mine])),
                "seconds_per_1000": 1000 * _mean(_known([lab["latency_s"] for lab in mine])),
            }
        )
    if has_gold:
        gold = [(info[pair]["gold"], info[pair]) for pair in by_pair]
        table.append(
            {
                "annotator": "gold",
                "labels": len(gold),
                "pairs": len(gold),
                "agreement": math.nan,
                "bias": math.nan,
                "variance": 0.0,
                **preference_rates(gold),
                "price_per_1000": math.nan,
                "seconds_per_1000": math.nan,
            }
        )
    return table


def preference_rates(labelled: Sequence[tuple[float, dict]]) -> dict[str, float]:
    """Among decisive (preference, label) pairs: the share for the longer output and for the list-formatted one."""
    longer, lists = [], []
    for p, lab in labelled:
        if p == 1.5:
            continue
        chose_b = p > 1.5
        (la, lb), (sa, sb) = lab["len"], lab["list"]
        if la != lb:
            longer.append(float(chose_b == (lb > la)))
        if sa != sb:
            lists.append(float(chose_b == sb))
    return {"length_pref": _mean(longer), "list_pref": _mean(lists)}


def ranking_correlation(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    """Spearman (Pearson on average ranks) and Pearson correlation of two evaluators' scores of the same methods.

    Methods without a finite score on both sides are left out (`n` counts the rest): a NaN would otherwise be ranked."""
    common = sorted(k for k in set(a) & set(b) if math.isfinite(float(a[k])) and math.isfinite(float(b[k])))
    x, y = np.array([a[k] for k in common], float), np.array([b[k] for k in common], float)

    def pearson(u: np.ndarray, v: np.ndarray) -> float:
        if len(u) < 2 or u.std() == 0 or v.std() == 0:
            return math.nan
        return float(np.corrcoef(u, v)[0, 1])

    return {"n": len(common), "spearman": pearson(_ranks(x), _ranks(y)), "pearson": pearson(x, y)}


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 1..n, ties get the average of the ranks they span."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(1, len(x) + 1)
    for v in np.unique(x):
        tied = x == v
        ranks[tied] = ranks[tied].mean()
    return ranks


# ------------------------------------------------------------------ the synthetic farm
def oracle_labels(pairs: Sequence[dict], cfg: AnnotatorConfig, draws: int = 3) -> list[dict]:
    """Every oracle annotator of the pool labels every pair `draws` times (independent draws).

    Each draw shows the outputs in a random order (seeded) and un-swaps the answer, as a
    pool does; latency_s is the measured judging time, price_usd 0 (offline and free).
    No label noise: this measures the annotators themselves.
    """
    if cfg.kind != "oracle":
        raise ValueError("oracle_labels needs an oracle annotator pool (annotation kind 'oracle')")
    from farmflow.data import gold_reward

    out = []
    for a in cfg.pool:
        judge = OracleAnnotator(a)
        for row in pairs:
            g1, g2 = gold_reward(row.get("task"), row["output_1"]), gold_reward(row.get("task"), row["output_2"])
            for d in range(draws):
                seed = cfg.seed * 1000 + d
                swapped = (
                    unit_hash(seed, "order", a.name, row["instruction"], row["input"], row["output_1"], row["output_2"])
                    < 0.5
                )
                first, second = (row["output_2"], row["output_1"]) if swapped else (row["output_1"], row["output_2"])
                start = time.perf_counter()
                shown = judge.judge(row, first, second, seed)
                seconds = time.perf_counter() - start
                out.append(
                    {k: row.get(k, "") for k in ("instruction", "input", "output_1", "output_2")}
                    | {
                        "annotator": a.name,
                        "preference": 3.0 - shown if swapped else shown,
                        "draw": d,
                        "gold_1": g1,
                        "gold_2": g2,
                        "price_usd": 0.0,
                        "latency_s": seconds,
                    }
                )
    return out


def synthetic_pairs(instructions: Sequence[dict], seed: int = 0, error_rate: float = 0.5) -> list[dict]:
    """Offline pairs for annotator analysis: a demonstration vs a reference-style answer per instruction.

    `instructions`: rows of the ``instructions`` table (with `task`). The two outputs differ
    in correctness (mistakes at `error_rate`), length and list formatting.
    """
    from farmflow.data import synthetic

    out = []
    for r in instructions:
        task = synthetic.task_from_json(r["task"])
        rng = random.Random(f"{seed}/{r['id']}")
        out.append(
            {
                "id": r["id"],
                "instruction": r["instruction"],
                "input": r["input"],
                "task": r["task"],
                "output_1": synthetic.demonstrate(task, rng, error_rate),
                "output_2": synthetic.reference_output(task, rng, error_rate),
            }
        )
    return out


# ------------------------------------------------------------------ plot
def plot_agreement(table: Sequence[dict], path: str, title: str = "Annotators: agreement vs cost") -> None:
    """Agreement with the reference against price per 1000 annotations (or seconds per 1000 when nothing has a
    price)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in table if not math.isnan(r["agreement"])]
    if not rows:
        raise ValueError("no annotator has an agreement to plot")
    priced = any(not math.isnan(r["price_per_1000"]) and r["price_per_1000"] > 0 for r in rows)
    col, label = (
        ("price_per_1000", "price per 1000 annotations (USD)")
        if priced
        else ("seconds_per_1000", "seconds per 1000 annotations")
    )
    fig, ax = plt.subplots(figsize=(6, 4.2), dpi=120)
    xs = [0.0 if math.isnan(r[col]) else r[col] for r in rows]
    ys = [100 * r["agreement"] for r in rows]
    dots = ax.scatter(xs, ys, s=40, c=[100 * (0 if math.isnan(r["bias"]) else r["bias"]) for r in rows], cmap="viridis")
    fig.colorbar(dots, ax=ax, label="bias (%)")
    for x, y, r in zip(xs, ys, rows):
        ax.annotate(r["annotator"], (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.set_xlabel(label)
    ax.set_ylabel("agreement with reference (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# ------------------------------------------------------------------ files
def load_labels(path: str) -> list[dict]:
    """Label records from a JSON list (AlpacaEval annotations: price_per_example / time_per_example
    become price_usd / latency_s) or a Parquet table (the annotations cache, preferences or evaluation tables)."""
    import json
    from pathlib import Path

    p = Path(path)
    if p.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(p).to_pylist()
        except Exception as err:  # pyarrow raises several types for unreadable files
            raise ValueError(f"cannot read {p}: {err}") from None
    else:
        try:
            rows = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"cannot read {p}: {err}") from None
        if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
            raise ValueError(f"{p}: expected a JSON list of annotation objects")
        rows = [
            r
            | {
                "price_usd": r.get("price_usd", r.get("price_per_example")),
                "latency_s": r.get("latency_s", r.get("time_per_example")),
            }
            for r in rows
        ]
    for i, r in enumerate(rows):
        missing = [k for k in ("instruction", "output_1", "output_2", "annotator", "preference") if k not in r]
        if missing:
            raise ValueError(
                f"{p}: row {i} has no {missing} (needed: instruction, output_1, output_2, annotator, preference)"
            )
    return rows
