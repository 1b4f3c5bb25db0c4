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

`demonstrate` is the SFT demonstrator (varied style, mistakes with probability error_rate) and
`reference_output` the fixed reference policy (one consistent, slightly longer style). Their
mistakes are realistic (carry errors, swapped or dropped items, wrong-category items) and
earn partial credit. Everything random goes through the `random.Random` passed in.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
from collections import Counter
from dataclasses import asdict, dataclass

# Bump when task generation, the policies or the gold reward change: it is part of the data
# stage's key, and every other stage key chains from the data key.
VERSION = "3"

FAMILIES: tuple[str, ...] = ("arithmetic", "sort", "reverse", "list_items", "max_number", "categorize")

CATEGORIES: dict[str, tuple[str, ...]] = {
    "colors": ("red", "blue", "green", "yellow", "purple", "pink", "brown", "black", "white", "gray", "gold", "silver"),
    "animals": ("cat", "dog", "cow", "pig", "horse", "sheep", "goat", "lion", "tiger", "bear", "wolf", "fox"),
    "fruits": (
        "apple",
        "banana",
        "pear",
        "plum",
        "grape",
        "mango",
        "cherry",
        "peach",
        "lemon",
        "melon",
        "kiwi",
        "berry",
    ),
    "tools": (
        "hammer",
        "drill",
        "wrench",
        "shovel",
        "rake",
        "axe",
        "chisel",
        "pliers",
        "ladder",
        "spade",
        "trowel",
        "clamp",
    ),
    "vehicles": ("car", "bus", "truck", "bike", "train", "boat", "ship", "plane", "van", "taxi", "tram", "jeep"),
}
ALL_WORDS: tuple[str, ...] = tuple(w for ws in CATEGORIES.values() for w in ws)
VOCAB: frozenset[str] = frozenset(ALL_WORDS)
SINGULAR = {"colors": "color", "animals": "animal", "fruits": "fruit", "tools": "tool", "vehicles": "vehicle"}
CATEGORY_OF = {w: c for c, ws in CATEGORIES.items() for w in ws}
COUNT_WORDS = {2: "two", 3: "three", 4: "four", 5: "five", 6: "six", 7: "seven"}


@dataclass(frozen=True)
class Task:
    family: str
    instruction: str
    input: str
    params: dict


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; known families: {', '.join(FAMILIES)}")


# ----------------------------------------------------------------------------- sampling

ARITH_PROMPTS = (
    "What is {expr}?",
    "Calculate {expr}.",
    "Find the value of {expr}.",
    "Work out {expr}.",
    "Compute {expr}.",
)
SORT_PROMPTS = {
    False: (
        "Sort the following numbers in ascending order.",
        "Arrange these numbers from smallest to largest.",
        "Put the numbers below in increasing order.",
        "Order these numbers from lowest to highest.",
    ),
    True: (
        "Sort the following numbers in descending order.",
        "Arrange these numbers from largest to smallest.",
        "Put the numbers below in decreasing order.",
        "Order these numbers from highest to lowest.",
    ),
}
REVERSE_PROMPTS = (
    "Reverse the order of the words below.",
    "Write these words in reverse order.",
    "List the following words backwards, last word first.",
    "Reverse the following sequence of words.",
)
LIST_PROMPTS = (
    "List {k} {cat}.",
    "Name {k} {cat}.",
    "Give me {k} examples of {cat}.",
    "Write down {k} different {cat}.",
)
CATEGORIZE_PROMPTS = (
    "What kind of thing is mentioned below?",
    "Which category does the thing below belong to?",
    "Classify the object mentioned below.",
    "Name the category of the item below.",
)
# The word sits inside a short sentence, so it is tokenized as in answers (" pear", not "pear").
CATEGORIZE_INPUTS = ("I saw {a} {w}.", "There is {a} {w} here.", "Look at the {w}.", "My friend has {a} {w}.")
MAX_PROMPTS = (
    "Which number is the largest?",
    "Find the largest number in the list.",
    "What is the biggest of these numbers?",
    "Identify the maximum of the following numbers.",
)


def _number(rng: random.Random) -> int:
    return rng.randint(0, 10)


def sample_task(family: str, rng: random.Random) -> Task:
    _check_family(family)
    if family == "arithmetic":
        a, b, op = _number(rng), _number(rng), rng.choice("+-")
        if op == "-" and b > a:
            a, b = b, a
        instruction = rng.choice(ARITH_PROMPTS).format(expr=f"{a} {op} {b}")
        return Task(family, instruction, "", {"a": a, "b": b, "op": op})
    if family == "sort":
        numbers = rng.sample(range(31), 3)
        descending = rng.random() < 0.3
        instruction = rng.choice(SORT_PROMPTS[descending])
        return Task(family, instruction, ", ".join(map(str, numbers)), {"numbers": numbers, "descending": descending})
    if family == "reverse":
        words = rng.sample(ALL_WORDS, 3)
        return Task(family, rng.choice(REVERSE_PROMPTS), " ".join(words), {"words": words})
    if family == "list_items":
        category, count = rng.choice(tuple(CATEGORIES)), rng.randint(2, 6)
        k = str(count) if rng.random() < 0.5 else COUNT_WORDS[count]
        instruction = rng.choice(LIST_PROMPTS).format(k=k, cat=category)
        return Task(family, instruction, "", {"category": category, "count": count})
    if family == "categorize":
        word = rng.choice(ALL_WORDS)
        text = rng.choice(CATEGORIZE_INPUTS).format(a=_article(word), w=word)
        return Task(family, rng.choice(CATEGORIZE_PROMPTS), text, {"word": word, "category": CATEGORY_OF[word]})
    numbers = rng.sample(range(51), rng.randint(3, 4))  # max_number
    return Task(family, rng.choice(MAX_PROMPTS), ", ".join(map(str, numbers)), {"numbers": numbers})


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


def _arithmetic_answer(params: dict) -> int:
    a, b = params["a"], params["b"]
    return a + b if params["op"] == "+" else a - b


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
        ans = _arithmetic_answer(params)
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
    _check_family(family)
    if not isinstance(output, str) or not output.strip():
        return 0.0
    r = float(_gold(family, params, output)) * FLUENCY_PENALTY ** garbled_tokens(output)
    return min(1.0, max(0.0, r)) if math.isfinite(r) else 0.0


# ----------------------------------------------------------------------------- policies


def _content(task: Task, rng: random.Random | None = None) -> int | list[str]:
    """The correct answer content: an int, or a list of items (numbers as strings, or words)."""
    p = task.params
    if task.family == "arithmetic":
        return _arithmetic_answer(p)
    if task.family == "max_number":
        return max(p["numbers"])
    if task.family == "sort":
        return [str(x) for x in sorted(p["numbers"], reverse=p["descending"])]
    if task.family == "reverse":
        return list(reversed(p["words"]))
    if task.family == "categorize":
        return [p["category"]]
    words = CATEGORIES[p["category"]]  # list_items: canonical = first k, policies sample
    return list(words[: p["count"]]) if rng is None else rng.sample(words, p["count"])


def _mistake(task: Task, content: int | list[str], rng: random.Random) -> int | list[str]:
    """A realistic, partially correct version of `content`."""
    p = task.params
    if task.family == "arithmetic":  # off-by-one or carry error in one digit
        steps = (1, 10, 100)[: len(str(content))]
        step = rng.choices(steps, weights=(4, 4, 2)[: len(steps)])[0]
        wrong = content + rng.choice((-1, 1)) * step
        return wrong if wrong >= 0 else content + step
    if task.family == "categorize":  # a wrong category, or hedging between the right one and another
        wrong = rng.choice([c for c in CATEGORIES if c not in content and c != p["category"]])
        return [wrong] if rng.random() < 0.3 or len(content) > 1 else rng.sample([content[0], wrong], 2)
    if task.family == "max_number":  # a smaller number: usually the next one down, never the min
        lower = sorted(x for x in p["numbers"] if x < content)
        if len(lower) <= 1:
            return content
        return lower[-1] if rng.random() < 0.7 else rng.choice(lower[1:])
    items = list(content)
    kind = rng.choices(("swap", "drop", "extra"), weights=(5, 3, 2))[0]
    if task.family == "reverse" and kind == "extra":  # forgot to reverse at all
        return list(p["words"])
    if kind == "swap" and task.family == "list_items":  # duplicate or wrong-category item
        i = rng.randrange(len(items))
        if rng.random() < 0.5:
            items[i] = items[i - 1] if i else items[1]
        else:
            items[i] = rng.choice([w for w in ALL_WORDS if w not in CATEGORIES[p["category"]]])
    elif kind == "swap" or (kind == "extra" and task.family == "sort"):
        i = rng.randrange(len(items) - 1)
        items[i], items[i + 1] = items[i + 1], items[i]
    elif kind == "drop":
        items.pop(rng.randrange(len(items)))
    else:  # list_items: one item too many
        items.append(rng.choice([w for w in CATEGORIES[p["category"]] if w not in items]))
    return items


def _format_items(items: list[str], style: str) -> str:
    if style == "numbered":
        return "\n".join(f"{i}. {x}" for i, x in enumerate(items, 1))
    if style == "bullet":
        return "\n".join(f"- {x}" for x in items)
    return (" " if style == "space" else ", ").join(items)


def _with_lead(lead: str, body: str, style: str) -> str:
    if not lead:
        return body
    return f"{lead}\n{body}" if style in ("numbered", "bullet") else f"{lead} {body}"


def _demo_text(task: Task, content: int | list[str], rng: random.Random) -> str:
    p = task.params
    if task.family == "arithmetic":
        expr = f"{p['a']} {p['op']} {p['b']}"
        template = rng.choice(
            (
                "{ans}",
                "{ans}.",
                "The answer is {ans}.",
                "{expr} = {ans}",
                "Sure! {expr} = {ans}.",
                "The result is {ans}.",
            )
        )
        return template.format(expr=expr, ans=content)
    if task.family == "max_number":
        template = rng.choice(
            ("{ans}", "The largest number is {ans}.", "{ans} is the largest number.", "Sure! The biggest one is {ans}.")
        )
        return template.format(ans=content)
    if task.family == "categorize":
        kinds = [f"{_article(SINGULAR[c])} {SINGULAR[c]}" for c in content]
        if len(kinds) > 1:
            return rng.choice(("It is {0} or {1}.", "Maybe {0}, or {1}.")).format(*kinds)
        template = rng.choice(
            ("{plural}", "It is {kind}.", "{word} is {kind}.", "Sure! That is {kind}.", "The category is {plural}.")
        )
        return template.format(plural=content[0], kind=kinds[0], word=p["word"].capitalize())
    if task.family == "sort":
        style = rng.choices(("comma", "numbered", "bullet"), weights=(5, 3, 2))[0]
        leads = ("Here is the sorted list:", "Sure! Here they are:", "The numbers in order are:")
    elif task.family == "reverse":
        style = rng.choices(("space", "comma", "numbered"), weights=(6, 2, 2))[0]
        leads = ("Here are the words reversed:", "Sure! Here you go:", "Reversed:")
    else:
        style = rng.choices(("comma", "numbered", "bullet"), weights=(4, 3, 3))[0]
        cat = p["category"]
        leads = (f"Here are {COUNT_WORDS[p['count']]} {cat}:", "Sure! Here you go:", f"Some {cat} are:")
    lead = rng.choice(leads) if rng.random() < 0.5 else ""
    return _with_lead(lead, _format_items(content, style), style)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _reference_text(task: Task, content: int | list[str]) -> str:
    p = task.params
    if task.family == "categorize":
        kinds = " or ".join(f"{_article(SINGULAR[c])} {SINGULAR[c]}" for c in content)
        return f"The word {p['word']} names {kinds}, so it belongs to the {' or '.join(content)}."
    if task.family == "arithmetic":
        return f"The answer is {p['a']} {p['op']} {p['b']} = {content}."
    if task.family == "max_number":
        return f"The largest number in the list is {content}."
    if task.family == "sort":
        order = "descending" if p["descending"] else "ascending"
        return f"Here are the numbers sorted in {order} order: {', '.join(content)}."
    if task.family == "reverse":
        return f"Here are the words in reverse order: {' '.join(content)}."
    return f"Here are {COUNT_WORDS[p['count']]} {p['category']}: {', '.join(content)}."


def _check_rate(error_rate: float) -> None:
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be in [0, 1], got {error_rate}")


def correct_output(task: Task) -> str:
    """A canonical perfect answer (gold 1.0): the bare answer, lists comma-separated."""
    _check_family(task.family)
    content = _content(task)
    if isinstance(content, int):
        return str(content)
    return _format_items(content, "space" if task.family == "reverse" else "comma")


def demonstrate(task: Task, rng: random.Random, error_rate: float) -> str:
    """SFT demonstrator: varied style; with probability error_rate a partial-credit mistake."""
    _check_family(task.family)
    _check_rate(error_rate)
    content = _content(task, rng)
    if rng.random() < error_rate:
        content = _mistake(task, content, rng)
    return _demo_text(task, content, rng)


MAX_REFERENCE_MISTAKES = 4


def reference_output(task: Task, rng: random.Random, error_rate: float) -> str:
    """Fixed reference policy: always a brief lead-in sentence plus the answer on one line.

    Its mistakes compound: with probability error_rate it makes a mistake, and after each
    mistake another one with probability error_rate again (at most 4). So error_rate
    spans references from perfect (0) to clearly flawed (1), which lets the farm calibrate
    the reference to what a tiny model can reach.
    """
    _check_family(task.family)
    _check_rate(error_rate)
    content = _content(task, rng)
    for _ in range(MAX_REFERENCE_MISTAKES):
        if rng.random() >= error_rate or (task.family in ("sort", "reverse", "list_items") and len(content) <= 2):
            break
        content = _mistake(task, content, rng)
    return _reference_text(task, content)


# ----------------------------------------------------------------------------- json


def task_to_json(task: Task) -> str:
    return json.dumps(asdict(task), sort_keys=True)


def task_from_json(s: str) -> Task:
    d = json.loads(s)
    _check_family(d["family"])
    return Task(family=d["family"], instruction=d["instruction"], input=d["input"], params=d["params"])
