"""The synthetic farm: procedurally generated instruction tasks with a known gold reward.

Every task belongs to a family. The vocabulary is small and closed (digits plus ~60 short
English words in five categories) so that a ~1M-parameter model can learn it in minutes.

Families and their gold reward (always a float in [0, 1], partial credit for near misses):

* arithmetic  "What is 7 + 8?" (no input). Add or subtract two numbers from 0 to 10.
  The predicted number is the first integer after the last "=" or ":" (or in the whole text).
  Exact -> 1.0; otherwise 0.8 * mean(right-aligned digit match fraction,
  max(0, 1 - |pred - ans| / max(ans, 10))); no number -> 0.0.
* sort        "Sort the following numbers in ascending order." input "12, 25, 3" (3 numbers
  0-30, ascending or descending). gold = kept * ordered, where kept = |input & output as
  multisets| / max(n_in, n_out) and ordered = fraction of adjacent output pairs in order.
* reverse     "Reverse the order of the words below." input "red cat hammer" (3 words).
  gold = mean(position matches, longest common subsequence), both / max(n_want, n_got).
* list_items  "List 4 animals." (no input; 2-6 items of one category).
  gold = min(distinct in-category items, k) / max(k, n_items): duplicates, items from the wrong
  category, missing items and extra items all cost credit.
* max_number  "Which number is the largest?" input "12, 45, 3" (3-4 numbers 0-50).
  Exact -> 1.0; another number of the input -> 0.5 * (fraction of the other numbers it beats);
  anything else -> 0.0.
* categorize  "What kind of thing is mentioned below?" input "I saw a tiger." (one vocabulary word).
  gold = 1 / (number of categories named) if the right category is among them, else 0, so a
  hedge ("an animal or a fruit") earns half.

Fluency: the task score is multiplied by 0.8 for every garbled token (a chunk that is neither
a number nor a word the farm's writers use, e.g. "4truck" or mojibake), as human judges mark
down garbled text even when the answer can be dug out of it.

Parsing is tolerant of human-like formatting: a lead-in sentence ("Sure! Here they are:"),
numbered lists, bullets, commas or spaces all give the same gold for the same content. Words
outside the closed vocabulary are ignored, so garbage or empty output scores 0.0.

The farm is three modules: this one (the gold reward, and every public name of the other two),
`farmflow.data.synthetic_tasks` (vocabulary, families, sampling a task, tasks as JSON) and
`farmflow.data.synthetic_writers` (the SFT demonstrator `demonstrate`, the reference policy
`reference_output`, `correct_output`).
"""

from __future__ import annotations

import functools
import math
import random
import re
from collections import Counter

from farmflow.data.synthetic_tasks import (
    ALL_WORDS,
    ARITH_PROMPTS,
    CATEGORIES,
    CATEGORIZE_INPUTS,
    CATEGORIZE_PROMPTS,
    CATEGORY_OF,
    COUNT_WORDS,
    FAMILIES,
    LIST_PROMPTS,
    MAX_PROMPTS,
    REVERSE_PROMPTS,
    SINGULAR,
    SORT_PROMPTS,
    VOCAB,
    Task,
    arithmetic_answer,
    check_family,
    sample_task,
    task_from_json,
    task_to_json,
)
from farmflow.data.synthetic_writers import (
    MAX_REFERENCE_MISTAKES,
    WRITERS,
    correct_output,
    demonstrate,
    reference_output,
    write,
)

# Bump when task generation, the policies or the gold reward change: it is part of the data
# stage's key, and every other stage key chains from the data key.
VERSION = "3"

# ----------------------------------------------------------------------------- parsing

_MARKER = re.compile(r"^(?:\d+[.)]|[-*\u2022])\s+")


def _int(digits: str) -> int:
    return int(digits[:18])  # cap absurdly long digit runs in garbage output


def _answer_number(text: str) -> int | None:
    """First integer after the last '=' or ':' that is followed by one (lead-ins, equations)."""
    lines = (
        _MARKER.sub("", line.strip()) if re.search(r"\d\D+\d", line.strip()) else line for line in text.splitlines()
    )  # "1. 85" -> "85", but "85. Done" stays
    for piece in reversed(re.split(r"[=:]", "\n".join(lines))):
        m = re.search(r"\d+", piece)
        if m:
            return _int(m.group())
    return None


def _number_list(text: str) -> list[int]:
    """Numbers of a list answer: drop a lead-in ending in ':' and numbered-list markers."""
    if ":" in text:
        tail = text.rsplit(":", 1)[1]
        if re.search(r"\d", tail):
            text = tail
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if len(lines) > 1:
        lines = [_MARKER.sub("", line) for line in lines]
    return [_int(d) for d in re.findall(r"\d+", "\n".join(lines))]


def _vocab_words(text: str) -> list[str]:
    """Words of the closed vocabulary, in order; everything else is formatting."""
    return [w for w in re.findall(r"[a-z]+", text.lower()) if w in VOCAB]


def _lcs(a: list, b: list) -> int:
    prev = [0] * (len(b) + 1)
    for x in a:
        cur = [0]
        for j, y in enumerate(b):
            cur.append(prev[j] + 1 if x == y else max(prev[j + 1], cur[j]))
        prev = cur
    return prev[-1]


# ----------------------------------------------------------------------------- gold reward


def _categories_named(text: str) -> set[str]:
    """Categories mentioned by name, singular or plural ("animal", "fruits")."""
    names = {**{c: c for c in CATEGORIES}, **{v: c for c, v in SINGULAR.items()}}
    return {names[w] for w in re.findall(r"[a-z]+", text.lower()) if w in names}


def _gold(family: str, params: dict, output: str) -> float:
    if family == "arithmetic" or family == "max_number":
        pred = _answer_number(output)
        if pred is None:
            return 0.0
        if family == "max_number":
            nums = params["numbers"]
            if pred == max(nums):
                return 1.0
            if pred in nums:
                return 0.5 * sum(x < pred for x in nums) / (len(nums) - 1)
            return 0.0
        ans = arithmetic_answer(params)
        if pred == ans:
            return 1.0
        s, p = str(ans), str(pred)
        digits = sum(x == y for x, y in zip(s[::-1], p[::-1])) / max(len(s), len(p))
        close = max(0.0, 1.0 - abs(pred - ans) / max(abs(ans), 10))
        return 0.8 * (0.5 * digits + 0.5 * close)
    if family == "sort":
        want, got = params["numbers"], _number_list(output)
        if not got:
            return 0.0
        kept = sum((Counter(want) & Counter(got)).values()) / max(len(want), len(got))
        if len(got) < 2:
            return kept
        pairs = list(zip(got, got[1:]))
        ok = sum(x >= y if params["descending"] else x <= y for x, y in pairs)
        return kept * ok / len(pairs)
    if family == "categorize":  # 1 / (categories named) when the right one is among them
        named = _categories_named(output)
        return (params["category"] in named) / len(named) if named else 0.0
    got = _vocab_words(output)
    if not got:
        return 0.0
    if family == "reverse":
        want = list(reversed(params["words"]))
        denom = max(len(want), len(got))
        pos = sum(x == y for x, y in zip(want, got))
        return 0.5 * (pos + _lcs(want, got)) / denom
    # list_items
    k, category = params["count"], CATEGORIES[params["category"]]
    distinct = len({w for w in got if w in category})
    return min(distinct, k) / max(k, len(got))


FLUENCY_PENALTY = 0.8  # gold is multiplied by this for every garbled token
_CHUNK = re.compile(r"[^\s,.;:!?()\[\]=+*/-]+")


@functools.cache
def _known_words() -> frozenset[str]:
    """Every word the farm's own writers use: the vocabulary, count words, categories, and the
    words of every instruction, lead-in and reference template (collected by running them)."""
    words = set(VOCAB) | set(COUNT_WORDS.values()) | set(CATEGORIES)
    rng = random.Random(0)
    for family in FAMILIES:
        for _ in range(300):
            task = sample_task(family, rng)
            for text in (task.instruction, demonstrate(task, rng, 0.5), reference_output(task, rng, 0.5)):
                words.update(c.lower() for c in _CHUNK.findall(text) if c.isalpha())
    return frozenset(words)


def garbled_tokens(output: str) -> int:
    """Chunks that are neither numbers nor words the farm's writers use ("4truck", "ghest", "\ufffd")."""
    known = _known_words()
    return sum(
        1
        for c in _CHUNK.findall(output)
        if not c.isascii() or not c.isprintable() or not (c.isdigit() or c.lower() in known)
    )


def gold_reward(family: str, params: dict, output: str) -> float:
    """Gold reward of `output` for a task of `family` with `params`; in [0, 1].

    The task score (partial credit, see the module doc) times FLUENCY_PENALTY per garbled
    token: human judges mark down garbled text even when the answer can be dug out of it.
    """
    check_family(family)
    if not isinstance(output, str) or not output.strip():
        return 0.0
    r = float(_gold(family, params, output)) * FLUENCY_PENALTY ** garbled_tokens(output)
    return min(1.0, max(0.0, r)) if math.isfinite(r) else 0.0


__all__ = [
    "ALL_WORDS",
    "ARITH_PROMPTS",
    "CATEGORIES",
    "CATEGORIZE_INPUTS",
    "CATEGORIZE_PROMPTS",
    "CATEGORY_OF",
    "COUNT_WORDS",
    "FAMILIES",
    "FLUENCY_PENALTY",
    "LIST_PROMPTS",
    "MAX_PROMPTS",
    "MAX_REFERENCE_MISTAKES",
    "REVERSE_PROMPTS",
    "SINGULAR",
    "SORT_PROMPTS",
    "VERSION",
    "VOCAB",
    "WRITERS",
    "Task",
    "correct_output",
    "demonstrate",
    "garbled_tokens",
    "gold_reward",
    "reference_output",
    "sample_task",
    "task_from_json",
    "task_to_json",
    "write",
]
