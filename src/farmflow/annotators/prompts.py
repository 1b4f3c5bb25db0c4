"""Prompt templates of the API annotators, and strict parsing of their answers.

One request judges 1..N numbered items. Each item is an instruction (with or without an
input) and two outputs shown as (a) and (b). Three answer formats:

* ``choice``: one line per item, ``[k] (a)`` or ``[k] (b)``;
* ``json``: a JSON array, one object per item, ``{"item": k, "explanation": "...",
  "a_is_better": true}``; the explanation comes first, so the judge reasons before it
  decides (chain of thought);
* ``logprobs``: a single item answered with one character, ``a`` or ``b``; the
  log-probabilities of those two tokens give a fractional preference
  ``1 + P(b) / (P(a) + P(b))`` in [1, 2].

Parsing is strict: every item 1..N must be answered exactly once, unambiguously; anything
else raises `ParseError` with the reason (the caller re-asks once, then marks the rows
failed and keeps the raw completion). Preferences are relative to the order shown:
1.0 = (a), 2.0 = (b).

The items are wrapped in tags (``<item number="k">``, ``<instruction>``, ``<input>``,
``<output_a>``, ``<output_b>``), so `parse_prompt` can read a prompt back: the loopback
judge server uses it to answer our own requests.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

# Bump when a template or parser changes what an annotator would answer: it is part of the
# annotator hash, so the row cache never mixes answers to different prompts.
PROMPT_VERSION = "1"

FORMATS = ("choice", "json", "logprobs")

_ROLE = (
    "You judge answers written by AI assistants. Each item shows an instruction, sometimes an input it refers to, "
    "and two candidate outputs labelled (a) and (b). Pick the output that carries out the instruction better."
)
_STYLES = {
    "neutral": "Weigh correctness first, then completeness and clarity. The order of the outputs means nothing, "
    "and a longer output is not better for being longer.",
    "strict": "Grade like a strict examiner: an output with a wrong fact, a wrong number or the wrong format loses, "
    "however confident or polished it sounds.",
    "user": "Grade like the busy person who asked: choose the output you would rather receive, the one that gets you "
    "what you asked for with the least fuss.",
}
_ASK = {
    "choice": "Judge the {n} item{s} below. Reply with one line per item, in item order, written exactly as "
    "[<item number>] (a) or [<item number>] (b), and nothing else.",
    "json": "Judge the {n} item{s} below. Reply with a JSON array holding one object per item, in item order, each "
    'shaped like {{"item": <item number>, "explanation": "<one short sentence>", "a_is_better": <true or false>}}. '
    "Write the explanation before you decide. Reply with the JSON array only.",
    "logprobs": (
        "Judge the item below. Reply with exactly one character: a if output (a) is better, b if output (b) is better."
    ),
}
_WITH_INPUT_NOTE = " Where an item has an input, the instruction refers to it."


class ParseError(ValueError):
    """A completion that does not answer every item exactly once (the message says why)."""


@dataclass(frozen=True)
class Item:
    """One pair as shown: `first` is output (a), `second` is output (b)."""

    instruction: str
    input: str
    first: str
    second: str


def default_max_tokens(fmt: str, n: int) -> int:
    return {"choice": 16 + 12 * n, "json": 120 * n, "logprobs": 1}[fmt]


def render_item(k: int, item: Item) -> str:
    parts = [f'<item number="{k}">', "<instruction>", item.instruction, "</instruction>"]
    if item.input:
        parts += ["<input>", item.input, "</input>"]
    parts += ["<output_a>", item.first, "</output_a>", "<output_b>", item.second, "</output_b>", "</item>"]
    return "\n".join(parts)


def render(items: list[Item], fmt: str, style: str = "neutral") -> list[dict]:
    """Chat messages asking for a judgement of `items` in format `fmt`."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown prompt format {fmt!r}; known: {', '.join(FORMATS)}")
    if fmt == "logprobs" and len(items) != 1:
        raise ValueError("the logprobs format judges exactly one item per request")
    n = len(items)
    ask = _ASK[fmt].format(n=n, s="" if n == 1 else "s")
    if any(it.input for it in items):
        ask += _WITH_INPUT_NOTE
    body = "\n\n".join(render_item(k, it) for k, it in enumerate(items, 1))
    return [{"role": "system", "content": f"{_ROLE} {_STYLES[style]}"}, {"role": "user", "content": f"{ask}\n\n{body}"}]


# ----------------------------------------------------------------------------- reading prompts back
_ITEM = re.compile(
    r'<item number="(\d+)">\n<instruction>\n(.*?)\n</instruction>\n(?:<input>\n(.*?)\n</input>\n)?'
    r"<output_a>\n(.*?)\n</output_a>\n<output_b>\n(.*?)\n</output_b>\n</item>",
    re.S,
)


def parse_prompt(messages: list[dict]) -> tuple[str, list[Item]]:
    """(format, items) of a prompt made by `render`; ValueError if it is not one of ours."""
    user = next((m.get("content") for m in messages if m.get("role") == "user"), None)
    if not isinstance(user, str):
        raise ValueError("no user message with text content")
    fmt = "json" if "JSON array" in user else "logprobs" if "exactly one character" in user else "choice"
    found = _ITEM.findall(user)
    if not found:
        raise ValueError("no judging items in the prompt")
    if [int(k) for k, *_ in found] != list(range(1, len(found) + 1)):
        raise ValueError("items are not numbered 1..n")
    return fmt, [Item(ins, inp or "", a, b) for _, ins, inp, a, b in found]


# ----------------------------------------------------------------------------- parsing answers
_LINE = re.compile(
    r"^[\s*#>`'\"-]*(?:item\s*)?\[?\s*(\d{1,3})\s*\]?[\s:.)*\-]*(?:(?:output|response)\s*)?"
    r"(?:\(\s*([ab])\s*\)|([ab])[\s.!]*$)",  # "(b)" with anything after it, or a bare letter ending the line
    re.I,
)
_LONE = re.compile(r"^[\s*#>`'\"]*(?:output|response)?\s*\(?\s*([ab])\s*\)?[\s.!]*$", re.I)
_TOKEN = re.compile(r"\(([ab])\)", re.I)


def _check_count(found: dict[int, float], n: int) -> list[float]:
    extra = sorted(k for k in found if not 1 <= k <= n)
    if extra:
        raise ParseError(f"answers for items {extra} that were not asked (expected items 1..{n})")
    if len(found) != n:
        missing = [k for k in range(1, n + 1) if k not in found]
        raise ParseError(f"expected {n} answers, found {len(found)} (missing items {missing})")
    return [found[k] for k in range(1, n + 1)]


def _put(found: dict[int, float], k: int, value: float) -> None:
    if k in found and found[k] != value:
        raise ParseError(f"item {k} answered twice with different choices")
    found[k] = value


def parse_choice(text: str, n: int) -> list[float]:
    found: dict[int, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line.strip())
        if m:
            _put(found, int(m.group(1)), 1.0 if (m.group(2) or m.group(3)).lower() == "a" else 2.0)
    if not found and n == 1:  # a single item may be answered without its number
        lone = [m.group(1).lower() for line in text.splitlines() if (m := _LONE.match(line.strip()))]
        tokens = lone or [t.lower() for t in _TOKEN.findall(text)]
        if len(set(tokens)) > 1:
            raise ParseError("ambiguous answer: both (a) and (b) are named")
        if tokens:
            found[1] = 1.0 if tokens[0] == "a" else 2.0
    if not found:
        raise ParseError(f"no choice found (expected lines like '[1] (a)'); got {text[:80]!r}")
    return _check_count(found, n)


_FENCE = re.compile(r"```(?:json)?\s*(.*?)```", re.S | re.I)


def _as_bool(v: object) -> bool | None:
    if isinstance(v, bool):
        return v
    if isinstance(v, str) and v.strip().lower() in ("true", "false"):
        return v.strip().lower() == "true"
    return None


def parse_json(text: str, n: int) -> list[float]:
    fenced = _FENCE.search(text)
    body = fenced.group(1) if fenced else text
    start, end = body.find("["), body.rfind("]")
    if start != -1 and end < start:
        raise ParseError("truncated JSON array (no closing ']')")
    if start == -1:
        start, end = body.find("{"), body.rfind("}")  # a lone object for one item
        if start == -1 or end < start:
            raise ParseError(f"no JSON array in the answer; got {text[:80]!r}")
    try:
        data = json.loads(body[start : end + 1])
    except json.JSONDecodeError as err:
        raise ParseError(f"invalid JSON ({err.msg} at char {err.pos})") from None
    if isinstance(data, dict):
        data = [data]
    if not isinstance(data, list) or not all(isinstance(d, dict) for d in data):
        raise ParseError("the JSON answer is not a list of objects")
    numbered = all("item" in d for d in data)
    found: dict[int, float] = {}
    for pos, d in enumerate(data, 1):
        verdict = _as_bool(d.get("a_is_better"))
        if verdict is None:
            raise ParseError(f"entry {pos} has no boolean 'a_is_better'")
        try:
            k = int(d["item"]) if numbered else pos
        except (TypeError, ValueError):
            raise ParseError(f"entry {pos} has a non-integer 'item'") from None
        _put(found, k, 1.0 if verdict else 2.0)
    return _check_count(found, n)


def parse_logprobs(text: str, top_logprobs: list[tuple[str, float]] | None) -> list[float]:
    """Fractional preference from the first token's top log-probabilities; the text if there are none."""
    p = {"a": 0.0, "b": 0.0}
    for token, logprob in top_logprobs or []:
        t = token.strip().strip("()").lower()
        if t in p and logprob is not None and math.isfinite(logprob):
            p[t] += math.exp(logprob)
    if p["a"] + p["b"] > 0:
        return [1.0 + p["b"] / (p["a"] + p["b"])]
    return parse_choice(text, 1)


def parse(fmt: str, n: int, text: str, top_logprobs: list[tuple[str, float]] | None = None) -> list[float]:
    """Preferences (relative to the order shown) for the n items of one request."""
    if fmt == "logprobs":
        return parse_logprobs(text, top_logprobs)
    return parse_json(text, n) if fmt == "json" else parse_choice(text, n)


def raw_completion(fmt: str, text: str, top_logprobs: list[tuple[str, float]] | None = None) -> str:
    """What the row cache keeps to re-parse later: the text, plus the log-probabilities for `logprobs`."""
    if fmt == "logprobs":
        return json.dumps({"text": text, "top_logprobs": [list(t) for t in top_logprobs or []]})
    return text


def parse_raw(fmt: str, n: int, raw: str) -> list[float]:
    """`parse` applied to a stored raw completion (see `raw_completion`)."""
    if fmt == "logprobs":
        try:
            d = json.loads(raw)
            return parse_logprobs(d["text"], [tuple(t) for t in d["top_logprobs"]])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ParseError("stored logprobs completion is not the expected JSON") from None
    return parse(fmt, n, raw)
