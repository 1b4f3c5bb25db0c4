"""The synthetic farm's writers: the SFT demonstrator, the reference policy and a canonical correct answer.

`demonstrate` is the SFT demonstrator (varied style, mistakes with probability error_rate) and `reference_output` the
fixed reference policy (one consistent, slightly longer style). Their mistakes are realistic (carry errors, swapped or
dropped items, wrong-category items) and earn partial credit under the gold reward (`farmflow.data.synthetic`).
Everything random goes through the `random.Random` passed in.
"""

from __future__ import annotations

import random

from farmflow.data.synthetic_tasks import (
    ALL_WORDS,
    CATEGORIES,
    COUNT_WORDS,
    SINGULAR,
    Task,
    arithmetic_answer,
    article,
    check_family,
)


def _content(task: Task, rng: random.Random | None = None) -> int | list[str]:
    """The correct answer content: an int, or a list of items (numbers as strings, or words)."""
    p = task.params
    if task.family == "arithmetic":
        return arithmetic_answer(p)
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
        kinds = [f"{article(SINGULAR[c])} {SINGULAR[c]}" for c in content]
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


def _reference_text(task: Task, content: int | list[str]) -> str:
    p = task.params
    if task.family == "categorize":
        kinds = " or ".join(f"{article(SINGULAR[c])} {SINGULAR[c]}" for c in content)
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
    check_family(task.family)
    content = _content(task)
    if isinstance(content, int):
        return str(content)
    return _format_items(content, "space" if task.family == "reverse" else "comma")


def demonstrate(task: Task, rng: random.Random, error_rate: float) -> str:
    """SFT demonstrator: varied style; with probability error_rate a partial-credit mistake."""
    check_family(task.family)
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
    check_family(task.family)
    _check_rate(error_rate)
    content = _content(task, rng)
    for _ in range(MAX_REFERENCE_MISTAKES):
        if rng.random() >= error_rate or (task.family in ("sort", "reverse", "list_items") and len(content) <= 2):
            break
        content = _mistake(task, content, rng)
    return _reference_text(task, content)


WRITERS = {"reference": reference_output, "demonstrator": demonstrate}
"""The farm's fixed policies by name: what SFT imitates and what evaluation compares against. Outside the pipeline
they stand for the systems the paper ranks beside its methods without training them (Davinci003, ChatGPT, GPT-4)."""


def write(task: Task, writer: str, error_rate: float, seed: str) -> str:
    """`writer`'s answer to `task` at `error_rate`, deterministic in `seed` (a string: one draw per task and seed)."""
    if writer not in WRITERS:
        raise ValueError(f"unknown writer {writer!r}; known: {sorted(WRITERS)}")
    return WRITERS[writer](task, random.Random(seed), error_rate)
