"""Annotator prompt templates and strict parsing of messy completions (no network)."""

import json
import math
import random

import pytest

from farmflow.annotators import prompts
from farmflow.annotators.oracle import task_from_text
from farmflow.annotators.prompts import (
    Item,
    ParseError,
    parse,
    parse_choice,
    parse_json,
    parse_logprobs,
    parse_prompt,
    render,
)
from farmflow.config import ANNOTATOR_PRESETS, AnnotatorConfig, ApiAnnotatorConfig, ConfigError, load_config
from farmflow.data.synthetic import FAMILIES, sample_task

ITEMS = [
    Item("Sort 3, 1, 2.", "", "1, 2, 3", "3, 2, 1"),
    Item("Reverse the words below.", "red cat", "cat red", "red cat"),
]


# ----------------------------------------------------------------------------- templates
@pytest.mark.parametrize("fmt", ["choice", "json"])
def test_render_numbers_every_item_and_reads_back(fmt):
    messages = render(ITEMS, fmt, "strict")
    assert [m["role"] for m in messages] == ["system", "user"]
    user = messages[1]["content"]
    assert '<item number="1">' in user and '<item number="2">' in user
    assert "the instruction refers to it" in user  # one item has an input: the with-input variant
    assert parse_prompt(messages) == (fmt, ITEMS)


def test_without_input_variant_has_no_input_section():
    messages = render(ITEMS[:1], "choice")
    assert "<input>" not in messages[1]["content"] and "refers to it" not in messages[1]["content"]
    assert parse_prompt(messages) == ("choice", ITEMS[:1])


def test_styles_differ_and_logprobs_takes_one_item():
    systems = {render(ITEMS[:1], "choice", s)[0]["content"] for s in ("neutral", "strict", "user")}
    assert len(systems) == 3
    assert parse_prompt(render(ITEMS[:1], "logprobs"))[0] == "logprobs"
    with pytest.raises(ValueError, match="exactly one item"):
        render(ITEMS, "logprobs")


def test_multiline_outputs_survive_the_round_trip():
    item = Item("List 3 animals.", "", "1. cat\n2. dog\n3. cow", "")
    assert parse_prompt(render([item], "json"))[1] == [item]


# ----------------------------------------------------------------------------- choice
@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("[1] (a)\n[2] (b)", 2, [1.0, 2.0]),
        ("Sure, here are my verdicts:\n\n[1] (b)\n[2] (a)\n", 2, [2.0, 1.0]),
        ("1. (b) is correct\n2: a", 2, [2.0, 1.0]),
        ("**Item 2** - Output (b)\nItem 1 - A.", 2, [1.0, 2.0]),
        ("[1] (a)\n[1] (a)", 1, [1.0]),  # a repeated identical answer is fine
        ("Output (b)", 1, [2.0]),
        ("b", 1, [2.0]),
        ("(A)", 1, [1.0]),
        ("After careful thought, Output (b) is better.", 1, [2.0]),
    ],
)
def test_choice_parses_messy_completions(text, n, expected):
    assert parse_choice(text, n) == expected


@pytest.mark.parametrize(
    "text, n, reason",
    [
        ("[1] (a)", 2, "expected 2 answers, found 1"),
        ("[1] (a)\n[2] (b)\n[3] (a)", 2, "items \\[3\\]"),
        ("[1] (a)\n[1] (b)", 1, "answered twice"),
        ("(a) is better than (b)", 1, "ambiguous"),
        ("Both are equally good.", 1, "no choice found"),
        ("1 apple and 2 bananas", 2, "no choice found"),
        ("", 3, "no choice found"),
    ],
)
def test_choice_rejects_what_does_not_answer_every_item_once(text, n, reason):
    with pytest.raises(ParseError, match=reason):
        parse_choice(text, n)


# ----------------------------------------------------------------------------- json
def test_json_parses_fenced_chatty_and_string_booleans():
    text = (
        'Here you go:\n```json\n[{"item": 2, "explanation": "b sorts", "a_is_better": false},\n '
        '{"item": 1, "explanation": "x", "a_is_better": "TRUE"}]\n```'
    )
    assert parse_json(text, 2) == [1.0, 2.0]
    assert parse_json('{"explanation": "(a) is right", "a_is_better": true}', 1) == [1.0]  # a lone object
    assert parse_json('[{"explanation": "", "a_is_better": false}, {"explanation": "", "a_is_better": true}]', 2) == [
        2.0,
        1.0,
    ]


@pytest.mark.parametrize(
    "text, n, reason",
    [
        ('[{"item": 1, "explanation": "ok", "a_is_b', 1, "truncated JSON"),
        ('[{"item": 1, "explanation": "ok", "a_is_better": true}, {"item": 2, "expl', 2, "truncated JSON"),
        ('[{"item": 1, "explanation": "ok" "a_is_better": true}]', 1, "invalid JSON"),
        ('[{"item": 1, "explanation": "ok", "a_is_better": "maybe"}]', 1, "no boolean"),
        ('[{"item": 1, "explanation": "ok", "a_is_better": true}]', 2, "expected 2 answers"),
        ('[{"item": "one", "explanation": "", "a_is_better": true}]', 1, "non-integer"),
        ("I think (a).", 1, "no JSON array"),
    ],
)
def test_json_rejects_broken_answers(text, n, reason):
    with pytest.raises(ParseError, match=reason):
        parse_json(text, n)


# ----------------------------------------------------------------------------- logprobs
def test_logprobs_give_a_fractional_preference():
    # P(a) = 0.8, P(b) = 0.2 -> 1 + 0.2 / 1.0
    assert parse_logprobs("a", [("a", math.log(0.8)), (" b", math.log(0.2)), ("The", math.log(0.001))]) == [
        pytest.approx(1.2)
    ]
    # tokens are normalized and summed: "(b" and "B" both count for b; only the ratio matters
    assert parse_logprobs("b", [("(b", math.log(0.3)), ("B", math.log(0.3)), ("a", math.log(0.2))]) == [
        pytest.approx(1 + 0.6 / 0.8)
    ]
    # no usable log-probabilities: the text decides
    assert parse_logprobs("b", None) == [2.0]
    with pytest.raises(ParseError):
        parse_logprobs("", [("The", -0.1)])


def test_raw_completion_round_trip_for_reparse():
    top = [("a", math.log(0.25)), ("b", math.log(0.75))]
    raw = prompts.raw_completion("logprobs", "b", top)
    assert json.loads(raw)["text"] == "b"
    assert prompts.parse_raw("logprobs", 1, raw) == [pytest.approx(1.75)]
    assert prompts.parse_raw("choice", 2, "[1] (b)\n[2] (a)") == [2.0, 1.0]
    assert parse("json", 1, '[{"item": 1, "explanation": "", "a_is_better": true}]') == [1.0]


# ----------------------------------------------------------------------------- tasks from text
def test_task_from_text_recovers_every_synthetic_task():
    rng = random.Random(0)
    tasks = [sample_task(FAMILIES[i % len(FAMILIES)], rng) for i in range(1200)]
    assert all(task_from_text(t.instruction, t.input) == t for t in tasks)
    assert task_from_text("Write a haiku about autumn.", "") is None
    assert task_from_text("Which number is the largest?", "no numbers here") is None


# ----------------------------------------------------------------------------- config
def test_presets_by_name():
    ann = load_config("synthetic-micro", ["annotation=p_sim_ann"]).annotation
    assert ann.kind == "api" and len(ann.api_pool) == 13 and ann.label_noise == 0.5
    assert {a.model for a in ann.api_pool} == {"gpt-4o", "gpt-4o-mini", "gpt-4.1-mini"}
    assert {a.prompt_format for a in ann.api_pool} == {"choice", "json", "logprobs"}
    assert {a.batch_size for a in ann.api_pool} == {1, 4, 5}
    assert all(a.temperature == 1.0 and a.paper_name for a in ann.api_pool)
    ev = load_config(
        "synthetic-micro", ['evaluation.annotator={"preset": "p_sim_eval", "base_url": "http://127.0.0.1:9/v1"}']
    ).evaluation.annotator
    assert ev.label_noise == 0.0 and ev.base_url == "http://127.0.0.1:9/v1" and len(ev.api_pool) == 13
    gpt4 = AnnotatorConfig(preset="p_sim_gpt4")
    assert len(gpt4.api_pool) == 1 and gpt4.api_pool[0].temperature == 0.0
    # a preset survives a dump / validate round trip (Prefect parameters, stage keys)
    assert AnnotatorConfig.model_validate(gpt4.model_dump()) == gpt4
    assert ANNOTATOR_PRESETS["alpacafarm-pool"]["api_pool"] == ANNOTATOR_PRESETS["p_sim_eval"]["api_pool"]


def test_a_preset_by_name_keeps_the_other_fields_in_any_order():
    """`annotation=p_sim_ann` sets the preset and keeps the section's other fields, whichever comes first: replacing
    the whole section would make a later `annotation.max_cost_usd` unknown and silently drop an earlier one."""
    for overrides in (
        ["annotation=p_sim_ann", "annotation.max_cost_usd=20"],
        ["annotation.max_cost_usd=20", "annotation=p_sim_ann"],
        ["annotation.max_cost_usd=20", "annotation.preset=p_sim_ann"],
    ):
        ann = load_config("synthetic-micro", overrides).annotation
        assert (ann.preset, ann.kind, ann.label_noise, ann.max_cost_usd, len(ann.api_pool)) == (
            "p_sim_ann",
            "api",
            0.5,
            20.0,
            13,
        ), overrides
    # switching presets: the fields the old preset fixed make way for the new one's
    ann = load_config("alpaca-small", ["annotation.base_url=http://127.0.0.1:9/v1", "annotation=p_sim_gpt4"]).annotation
    assert (ann.preset, len(ann.api_pool), ann.label_noise, ann.base_url) == (
        "p_sim_gpt4",
        1,
        0.0,
        "http://127.0.0.1:9/v1",
    )
    assert load_config("alpaca-small", ["annotation.preset=p_sim_eval"]).annotation.label_noise == 0.0


def test_a_field_the_preset_fixes_is_never_silently_replaced():
    """Another kind or label noise beside an annotator preset is an error naming the field (the preset would win
    silently otherwise); with the preset set to null the field applies."""
    with pytest.raises(ConfigError, match=r"kind is fixed by preset 'p_sim_ann' \(kind='api'\); set preset to null"):
        load_config("alpaca-small", ['annotation={"kind": "hf"}'])
    with pytest.raises(ConfigError, match=r"label_noise is fixed by preset 'p_sim_eval'"):
        load_config("alpaca-small", ["evaluation.annotator.label_noise=0.25"])
    ann = load_config("alpaca-small", ['annotation={"preset": null, "kind": "hf", "label_noise": 0.5}']).annotation
    assert (ann.preset, ann.kind, ann.label_noise) == (None, "hf", 0.5)


def test_config_errors_name_the_problem():
    with pytest.raises(ConfigError, match="unknown annotator preset 'nope'") as err:
        load_config("synthetic-micro", ["annotation.preset=nope"])
    assert "got {" not in str(err.value)  # the whole section is not dumped into the message
    with pytest.raises(ConfigError, match="non-empty api_pool"):
        load_config("synthetic-micro", ["annotation.kind=api"])
    with pytest.raises(ValueError, match="fixed by preset"):
        AnnotatorConfig.model_validate({"preset": "p_sim_ann", "api_pool": [{"name": "x", "model": "m"}]})
    with pytest.raises(ValueError, match="batch_size must be 1"):
        ApiAnnotatorConfig(name="x", model="m", prompt_format="logprobs", batch_size=2)
    with pytest.raises(ValueError, match="needs a price"):
        AnnotatorConfig(kind="api", api_pool=[{"name": "x", "model": "my-llama"}], max_cost_usd=1.0)
    assert AnnotatorConfig().kind == "oracle"  # the default stays offline
