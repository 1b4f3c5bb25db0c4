"""Simulated pairwise annotators.

An annotator looks at (instruction, input, output_a, output_b), shown in that order, and
returns 1 if it prefers the first output shown, 2 for the second, 1.5 for a tie.
A pool assigns each pair to one annotator, randomizes the order the two outputs are
shown in and un-swaps the answer, so the stored `preference` always refers to
``output_1``/``output_2`` of the table (1 = output_1 preferred, AlpacaFarm convention).

The offline `OracleAnnotator` is the synthetic farm's crowdworker: it judges with the
gold reward plus human-like biases (longer answers, list formatting, the first output
shown) and its own noise:

    P(second shown preferred) = sigmoid(sharpness·(gold_b − gold_a)
                                        + length_bias·tanh((len_b − len_a)/40)
                                        + list_bias·(is_list(b) − is_list(a))
                                        − position_bias)

Label noise (p_sim^ann): with probability `label_noise` the label is a fair coin and the
annotator is never asked (the paper uses 0.5, i.e. 25% of labels flipped).

All randomness comes from hashes of (seed, pair content), so a pair gets the same
annotator, order and label whatever batch or process it is annotated in.
"""

from __future__ import annotations

import hashlib
import math
import re
from typing import Protocol, Sequence

import pyarrow as pa

from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.data import gold_reward
from farmflow.storage.schemas import SCHEMAS

_LIST_LINE = re.compile(r"^\s*(?:\d+[.)]|[-*•])\s+\S", re.M)


def unit_hash(*parts: object) -> float:
    """A uniform number in [0, 1) determined by `parts`."""
    h = hashlib.blake2b("\x1f".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2**64


def sigmoid(x: float) -> float:
    """Logistic function that cannot overflow for any finite x."""
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    z = math.exp(x)
    return z / (1.0 + z)


def is_list(text: str) -> bool:
    """At least two lines that look like numbered or bulleted list items."""
    return len(_LIST_LINE.findall(text)) >= 2


class Annotator(Protocol):
    name: str

    def judge(self, row: dict, first: str, second: str, seed: int) -> float:
        """1.0: `first` preferred, 2.0: `second` preferred, 1.5: tie. `row` has instruction, input, task."""


class OracleAnnotator:
    """Judges with the synthetic farm's gold reward plus biases and noise (see module doc)."""

    def __init__(self, cfg: OracleAnnotatorConfig):
        self.cfg, self.name = cfg, cfg.name

    def logit_second(self, row: dict, first: str, second: str) -> float:
        g_a, g_b = gold_reward(row["task"], first), gold_reward(row["task"], second)
        if g_a is None or g_b is None:
            raise ValueError(
                f"oracle annotator {self.name!r} needs synthetic tasks with a gold reward; row "
                f"{row.get('id', '?')!r} has none (use an API annotator for real data)"
            )
        c = self.cfg
        return (
            c.sharpness * (g_b - g_a)
            + c.length_bias * math.tanh((len(second) - len(first)) / 40.0)
            + c.list_bias * (is_list(second) - is_list(first))
            - c.position_bias
        )

    def judge(self, row: dict, first: str, second: str, seed: int) -> float:
        if first == second:
            return 1.5
        p_second = sigmoid(self.logit_second(row, first, second))
        u = unit_hash(seed, "judge", self.name, row["instruction"], row["input"], first, second)
        return 2.0 if u < p_second else 1.0


def build_pool(cfg: AnnotatorConfig) -> list[Annotator]:
    if cfg.kind == "oracle":
        return [OracleAnnotator(a) for a in cfg.pool]
    raise ValueError(f"annotation.kind: unknown annotator kind {cfg.kind!r}")


def annotate_pairs(rows: Sequence[dict], cfg: AnnotatorConfig) -> pa.Table:
    """Label each pair (instruction, input, output_1, output_2, task) with the pool in `cfg`.

    Returns the ``preferences`` table: the input columns plus annotator, preference
    (1 = output_1, 2 = output_2, 1.5 = tie), noised (label replaced by a coin),
    swapped (order shown was output_2 first) and the gold reward of both outputs.
    """
    pool = build_pool(cfg)
    if cfg.kind == "oracle":
        untasked = next((r for r in rows if not r.get("task")), None)
        if untasked is not None:
            raise ValueError(
                f"oracle annotators need synthetic tasks with a gold reward; row {untasked.get('id', '?')!r} has none "
                "(use an API annotator for real data)"
            )
    out: list[dict] = []
    for row in rows:
        key = (row["instruction"], row["input"])
        annotator = pool[int(unit_hash(cfg.seed, "assign", *key) * len(pool))]
        swapped = unit_hash(cfg.seed, "order", *key, row["output_1"], row["output_2"]) < 0.5
        noised = cfg.label_noise > 0 and unit_hash(cfg.seed, "noise", *key, row["output_1"], row["output_2"]) < cfg.label_noise
        if row["output_1"] == row["output_2"]:  # a tie is a tie, noisy annotators or not
            preference, noised = 1.5, False
        elif noised:
            preference = 1.0 if unit_hash(cfg.seed, "coin", *key, row["output_1"], row["output_2"]) < 0.5 else 2.0
        else:
            first, second = (row["output_2"], row["output_1"]) if swapped else (row["output_1"], row["output_2"])
            shown = annotator.judge(row, first, second, cfg.seed)
            preference = 3.0 - shown if swapped else shown
        out.append({
            **{k: row.get(k, "") for k in ("id", "split", "instruction", "input", "output_1", "output_2", "task")},
            "annotator": annotator.name, "preference": preference, "noised": noised, "swapped": swapped,
            "gold_1": gold_reward(row.get("task"), row["output_1"]), "gold_2": gold_reward(row.get("task"), row["output_2"]),
        })
    return pa.Table.from_pylist(out, schema=SCHEMAS["preferences"])


__all__ = ["Annotator", "OracleAnnotator", "annotate_pairs", "build_pool", "is_list", "unit_hash"]
