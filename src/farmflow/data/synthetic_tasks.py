"""The synthetic farm's tasks: the closed vocabulary, the task families, sampling a task, tasks as JSON.

What each family asks and how its answers are scored is in `farmflow.data.synthetic` (the gold reward), the writers
that answer them in `farmflow.data.synthetic_writers`. Everything random goes through the `random.Random` passed in.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass

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


def check_family(family: str) -> None:
    """A ValueError naming the known families unless `family` is one."""
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
    check_family(family)
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
        text = rng.choice(CATEGORIZE_INPUTS).format(a=article(word), w=word)
        return Task(family, rng.choice(CATEGORIZE_PROMPTS), text, {"word": word, "category": CATEGORY_OF[word]})
    numbers = rng.sample(range(51), rng.randint(3, 4))  # max_number
    return Task(family, rng.choice(MAX_PROMPTS), ", ".join(map(str, numbers)), {"numbers": numbers})


def arithmetic_answer(params: dict) -> int:
    """The right answer of an arithmetic task."""
    a, b = params["a"], params["b"]
    return a + b if params["op"] == "+" else a - b


def article(word: str) -> str:
    """The indefinite article before `word` (a / an)."""
    return "an" if word[0] in "aeiou" else "a"


# ----------------------------------------------------------------------------- json


def task_to_json(task: Task) -> str:
    return json.dumps(asdict(task), sort_keys=True)


def task_from_json(s: str) -> Task:
    d = json.loads(s)
    check_family(d["family"])
    return Task(family=d["family"], instruction=d["instruction"], input=d["input"], params=d["params"])
