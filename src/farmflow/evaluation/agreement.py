"""Agreement of a judge's choices with reference preferences, with interval, and its position and length bias.

Plain numbers in and out (`farmflow.evaluation.judge_quality` runs judges and builds the report from these). A verdict
on a pair is ``(p_1_shown_first, p_1_shown_second)``: P(output_1 better) with output_1 shown as (a) and as (b), None
where that order got no usable answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from farmflow.annotators import unit_hash

Z95 = 1.959963984540054  # standard normal quantile at 0.975
INTERVAL = "Wilson score interval, 95%"


@dataclass(frozen=True)
class Pair:
    """One judged pair; `reference` is the file's decisive preference (1.0: output_1 better, 2.0: output_2)."""

    instruction: str
    input: str
    output_1: str
    output_2: str
    reference: float


Verdict = tuple[float | None, float | None]  # P(output_1 better) with output_1 shown first / second


def wilson(successes: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a proportion `successes / n` (half points allowed); NaNs when n is 0."""
    if n <= 0:
        return math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def choice(verdict: Verdict) -> float:
    """1.0 (output_1), 2.0 (output_2) or 1.5 (undecided): the mean of the orders answered against .5."""
    known = [p for p in verdict if p is not None]
    if not known:
        return 1.5
    mean = sum(known) / len(known)
    return 1.0 if mean > 0.5 else 2.0 if mean < 0.5 else 1.5


def agreement(choices: Sequence[float], references: Sequence[float]) -> dict:
    """Share of choices equal to the reference (undecided: half), its Wilson interval, n and the undecided count."""
    score = sum(1.0 if c == r else 0.5 if c == 1.5 else 0.0 for c, r in zip(choices, references, strict=True))
    n = len(choices)
    low, high = wilson(score, n)
    return {
        "agreement": score / n if n else math.nan,
        "ci_low": low,
        "ci_high": high,
        "n": n,
        "undecided": sum(c == 1.5 for c in choices),
    }


def position_bias(verdicts: Sequence[Verdict]) -> dict:
    """Among pairs answered in both orders: the share where the same slot won both times, (a) and (b) apart.

    With output_1 shown as (a), (a) wins when p_1_shown_first > .5; with output_1 shown as (b), (a) (now output_2)
    wins when p_1_shown_second < .5."""
    both = [(f, s) for f, s in verdicts if f is not None and s is not None]
    first = sum(f > 0.5 and s < 0.5 for f, s in both)
    second = sum(f < 0.5 and s > 0.5 for f, s in both)
    n = len(both)
    share = (lambda k: k / n) if n else (lambda k: math.nan)
    return {
        "position_bias": share(first + second),
        "first_slot": share(first),
        "second_slot": share(second),
        "position_pairs": n,
    }


def length_bias(choices: Sequence[float], pairs: Sequence[Pair]) -> dict:
    """Share of decided choices for the longer output, over pairs whose outputs differ in length."""
    decided = [
        (c, len(p.output_1), len(p.output_2))
        for c, p in zip(choices, pairs, strict=True)
        if c != 1.5 and len(p.output_1) != len(p.output_2)
    ]
    longer = sum((c == 2.0) == (l2 > l1) for c, l1, l2 in decided)
    return {"prefers_longer": longer / len(decided) if decided else math.nan, "length_pairs": len(decided)}


def longer_choices(pairs: Sequence[Pair]) -> list[float]:
    """The `longer` baseline: the output with more characters wins; equal lengths are undecided."""
    return [
        1.0 if len(p.output_1) > len(p.output_2) else 2.0 if len(p.output_2) > len(p.output_1) else 1.5 for p in pairs
    ]


def coin_choices(pairs: Sequence[Pair], seed: int) -> list[float]:
    """The `coin` baseline: a fair coin per pair, from a hash of `seed` and the pair (the same whatever the order)."""
    return [
        1.0 if unit_hash(seed, "coin", p.instruction, p.input, p.output_1, p.output_2) < 0.5 else 2.0 for p in pairs
    ]


def summary(
    name: str,
    kind: str,
    choices: Sequence[float],
    pairs: Sequence[Pair],
    verdicts: Sequence[Verdict] | None = None,
    **extra,
) -> dict:
    """One row of the report: agreement (with interval), position bias (judges only), length bias, `extra`."""
    out = {"judge": name, "kind": kind, **agreement(choices, [p.reference for p in pairs])}
    out |= (
        position_bias(verdicts)
        if verdicts is not None
        else {"position_bias": None, "first_slot": None, "second_slot": None, "position_pairs": 0}
    )
    return out | length_bias(choices, pairs) | extra
