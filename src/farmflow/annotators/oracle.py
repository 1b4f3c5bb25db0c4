"""The offline oracle annotator: the synthetic farm's crowdworker.

It judges with the gold reward plus human-like biases (longer answers, list formatting,
the first output shown) and its own noise:

    P(second shown preferred) = sigmoid(sharpness·(gold_b − gold_a)
                                        + length_bias·tanh((len_b − len_a)/length_scale)
                                        + list_bias·(is_list(b) − is_list(a))
                                        − position_bias)

All randomness comes from hashes of (seed, pair content), so a pair gets the same
judgement whatever batch or process it is annotated in.
"""

from __future__ import annotations

import functools
import hashlib
import math
import re
from typing import Protocol

from farmflow.config import OracleAnnotatorConfig
from farmflow.data import gold_reward, synthetic

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
        return self.cfg.sharpness * (g_b - g_a) + self.bias_logit(first, second)

    def bias_logit(self, first: str, second: str) -> float:
        """The part of the logit that ignores quality: length, lists and position."""
        c = self.cfg
        return (
            c.length_bias * math.tanh((len(second) - len(first)) / c.length_scale)
            + c.list_bias * (is_list(second) - is_list(first))
            - c.position_bias
        )

    def judge(self, row: dict, first: str, second: str, seed: int) -> float:
        if first == second:
            return 1.5
        p_second = sigmoid(self.logit_second(row, first, second))
        u = unit_hash(seed, "judge", self.name, row["instruction"], row["input"], first, second)
        return 2.0 if u < p_second else 1.0


def pool_preference(pool: list[OracleAnnotator], row: dict) -> float:
    """P(output_2 preferred) by an annotator judging the pair, averaged over the pool and both shown orders.

    The best any model can do without knowing which annotator was drawn or which order the
    outputs were shown in is to prefer output_2 when this is above 0.5 (the Bayes-optimal
    guess; label noise only pulls it toward 0.5). Annotators are drawn uniformly and the
    order is a fair coin, as in `farmflow.annotators.annotate`.
    """
    o1, o2 = row["output_1"], row["output_2"]
    if o1 == o2:
        return 0.5
    p = [sigmoid(a.logit_second(row, o1, o2)) + 1.0 - sigmoid(a.logit_second(row, o2, o1)) for a in pool]
    return sum(p) / (2 * len(p))


# ----------------------------------------------------------------------------- tasks from text
def _template_regex(template: str, **groups: str) -> re.Pattern:
    pattern = re.escape(template)
    for name, group in groups.items():
        pattern = pattern.replace(re.escape("{" + name + "}"), group)
    return re.compile(f"^{pattern}$")


@functools.cache
def _task_patterns() -> list[tuple[str, re.Pattern, object]]:
    counts = "|".join([r"\d+", *synthetic.COUNT_WORDS.values()])
    cats = "|".join(synthetic.CATEGORIES)
    out: list[tuple[str, re.Pattern, object]] = []
    out += [("arithmetic", _template_regex(t, expr=r"(\d+) ([+-]) (\d+)"), None) for t in synthetic.ARITH_PROMPTS]
    out += [("sort", _template_regex(t), desc) for desc, ts in synthetic.SORT_PROMPTS.items() for t in ts]
    out += [("reverse", _template_regex(t), None) for t in synthetic.REVERSE_PROMPTS]
    out += [("list_items", _template_regex(t, k=f"({counts})", cat=f"({cats})"), None) for t in synthetic.LIST_PROMPTS]
    out += [("categorize", _template_regex(t), None) for t in synthetic.CATEGORIZE_PROMPTS]
    out += [("max_number", _template_regex(t), None) for t in synthetic.MAX_PROMPTS]
    return out


def task_from_text(instruction: str, input: str) -> synthetic.Task | None:
    """The synthetic task behind an (instruction, input) pair, or None if it is not one.

    Lets the oracle judge synthetic-farm pairs that arrive as plain text (a judge-server
    request, an AlpacaEval-format file) by recomputing the gold reward.
    """
    numbers = [int(x) for x in re.findall(r"\d+", input)]
    for family, pattern, extra in _task_patterns():
        m = pattern.match(instruction.strip())
        if not m:
            continue
        if family == "arithmetic" and not input:
            params: dict = {"a": int(m.group(1)), "op": m.group(2), "b": int(m.group(3))}
        elif family in ("sort", "max_number") and len(numbers) >= 2:
            params = {"numbers": numbers} | ({"descending": extra} if family == "sort" else {})
        elif family == "reverse" and input.split() and all(w in synthetic.VOCAB for w in input.split()):
            params = {"words": input.split()}
        elif family == "list_items" and not input:
            k = m.group(1)
            count = int(k) if k.isdigit() else {v: c for c, v in synthetic.COUNT_WORDS.items()}[k]
            params = {"category": m.group(2), "count": count}
        elif family == "categorize" and (
            words := [w for w in re.findall(r"[a-z]+", input.lower()) if w in synthetic.VOCAB]
        ):
            params = {"word": words[0], "category": synthetic.CATEGORY_OF[words[0]]}
        else:
            continue
        return synthetic.Task(family, instruction, input, params)
    return None
