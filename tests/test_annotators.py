"""Simulated pairwise annotators (oracle pool) on synthetic tasks."""

import math
import random

import pytest

from farmflow.annotators import OracleAnnotator, annotate_pairs, is_list, unit_hash
from farmflow.config import AnnotatorConfig, OracleAnnotatorConfig
from farmflow.data import gold_reward
from farmflow.data.synthetic import correct_output, demonstrate, sample_task, task_to_json
from farmflow.storage.schemas import SCHEMAS

FAMILIES = ("arithmetic", "sort", "reverse", "list_items", "max_number")


def make_tasks(n, seed=0, families=FAMILIES):
    rng = random.Random(seed)
    return [sample_task(families[i % len(families)], rng) for i in range(n)]


def row(i, task, out_1, out_2):
    return {
        "id": f"pref-{i:05d}",
        "split": "pref",
        "instruction": task.instruction,
        "input": task.input,
        "output_1": out_1,
        "output_2": out_2,
        "task": task_to_json(task),
    }


def one(name="solo", **kw):
    """A pool of one annotator, no label noise."""
    return AnnotatorConfig(pool=[OracleAnnotatorConfig(name=name, **kw)], label_noise=0.0, seed=0)


# sharpness 500 with gold differences >= 0.1 gives logits beyond ±50: decisions are certain.
SHARP = one("sharp", sharpness=500.0)


def good_and_bad(n, seed=0):
    """(task, better output, worse output) with a gold gap of at least 0.1."""
    rng = random.Random(seed + 1)
    out = []
    for t in make_tasks(n, seed):
        good = correct_output(t)
        bad = demonstrate(t, rng, error_rate=1.0) if len(out) % 2 else "no idea"
        g_good, g_bad = gold_reward(task_to_json(t), good), gold_reward(task_to_json(t), bad)
        if g_good - g_bad >= 0.1:
            out.append((t, good, bad))
    return out


# ----------------------------------------------------------------------------- helpers


def test_unit_hash_is_deterministic_uniform():
    assert unit_hash(0, "a", "b") == 0.9953506957432792  # a blake2b hash: the same in every process, unlike hash()
    assert unit_hash(0, "a", "b") != unit_hash(1, "a", "b")
    xs = [unit_hash(0, i) for i in range(2000)]
    assert all(0.0 <= x < 1.0 for x in xs)
    assert 0.45 < sum(xs) / len(xs) < 0.55


def test_is_list():
    assert is_list("1. cat\n2. dog")
    assert is_list("- cat\n- dog\n- cow")
    assert not is_list("1. cat")
    assert not is_list("cat, dog, cow")


# ----------------------------------------------------------------------------- preferences


def test_sharp_annotator_prefers_the_correct_output_in_either_order():
    triples = good_and_bad(60)
    assert len(triples) >= 40
    rows_a = [row(i, t, good, bad) for i, (t, good, bad) in enumerate(triples)]  # correct is output_1
    rows_b = [row(i, t, bad, good) for i, (t, good, bad) in enumerate(triples)]  # correct is output_2
    a, b = annotate_pairs(rows_a, SHARP), annotate_pairs(rows_b, SHARP)
    assert a.schema == SCHEMAS["preferences"]
    assert a.column("preference").to_pylist() == [1.0] * len(triples)
    assert b.column("preference").to_pylist() == [2.0] * len(triples)
    # both presentation orders actually happened, so the un-swapping is exercised
    assert set(a.column("swapped").to_pylist()) == {True, False}
    assert set(b.column("swapped").to_pylist()) == {True, False}
    assert not any(a.column("noised").to_pylist())
    assert a.column("annotator").to_pylist() == ["sharp"] * len(triples)
    for r, (t, good, bad) in zip(a.to_pylist(), triples):
        assert r["gold_1"] == gold_reward(task_to_json(t), good) == 1.0
        assert r["gold_2"] == gold_reward(task_to_json(t), bad)
        assert r["id"] and r["split"] == "pref" and r["task"] == task_to_json(t)


def test_sharpness_sets_the_probability_of_following_gold():
    # gold difference exactly 1 (correct vs garbage) and sharpness 1: P(correct) = sigmoid(1) = 0.731
    tasks = make_tasks(400, seed=3)
    rows = [row(i, t, correct_output(t), "no idea") for i, t in enumerate(tasks)]
    prefs = annotate_pairs(rows, one(sharpness=1.0)).column("preference").to_pylist()
    frac = prefs.count(1.0) / len(prefs)
    assert abs(frac - 1 / (1 + math.exp(-1))) < 0.07


def test_identical_outputs_are_a_tie():
    tasks = make_tasks(20)
    rows = [row(i, t, correct_output(t), correct_output(t)) for i, t in enumerate(tasks)]
    rows += [row(20 + i, t, "no idea", "no idea") for i, t in enumerate(tasks)]
    table = annotate_pairs(rows, AnnotatorConfig(label_noise=0.0))  # the default, biased pool
    assert table.column("preference").to_pylist() == [1.5] * 40


def test_determinism():
    triples = good_and_bad(40)
    rows = [row(i, t, *((good, bad) if i % 2 else (bad, good))) for i, (t, good, bad) in enumerate(triples)]
    cfg = AnnotatorConfig(label_noise=0.5, seed=7)
    first = annotate_pairs(rows, cfg)
    assert annotate_pairs(rows, AnnotatorConfig(label_noise=0.5, seed=7)).equals(first)
    # a pair gets the same judgement whatever batch it is in
    back = annotate_pairs(list(reversed(rows)), cfg).to_pylist()
    assert list(reversed(back)) == first.to_pylist()
    single = annotate_pairs(rows[5:6], cfg).to_pylist()
    assert single == first.to_pylist()[5:6]
    # another seed gives another draw
    other = annotate_pairs(rows, AnnotatorConfig(label_noise=0.5, seed=8))
    assert other.column("swapped").to_pylist() != first.column("swapped").to_pylist()


def test_assignment_depends_only_on_instruction_and_input():
    cfg = AnnotatorConfig(label_noise=0.0)
    tasks = make_tasks(200)
    by_task = annotate_pairs([row(i, t, "a", "b") for i, t in enumerate(tasks)], cfg).column("annotator").to_pylist()
    # the whole default pool is used
    assert set(by_task) == {a.name for a in cfg.pool}
    # same instruction + input, different outputs (and ids, tasks' outputs) -> same annotator
    for t, expected in list(zip(tasks, by_task))[:10]:
        outputs = ["no idea", correct_output(t), "1, 2, 3", "x" * 50, ""]
        rows = [row(j, t, o1, o2) for j, (o1, o2) in enumerate(zip(outputs, outputs[1:] + outputs[:1]))]
        assert set(annotate_pairs(rows, cfg).column("annotator").to_pylist()) == {expected}


# ----------------------------------------------------------------------------- label noise


def test_full_label_noise_is_a_fair_coin():
    triples = good_and_bad(500, seed=1)[:400]
    assert len(triples) == 400
    rows = [row(i, t, good, bad) for i, (t, good, bad) in enumerate(triples)]
    cfg = AnnotatorConfig(pool=[OracleAnnotatorConfig(name="sharp", sharpness=500.0)], label_noise=1.0, seed=0)
    table = annotate_pairs(rows, cfg)
    assert all(table.column("noised").to_pylist())
    prefs = table.column("preference").to_pylist()
    assert set(prefs) == {1.0, 2.0}
    assert 0.4 < prefs.count(2.0) / 400 < 0.6  # without noise this annotator would always say 1


def test_half_label_noise():
    triples = good_and_bad(500, seed=2)[:400]
    rows = [row(i, t, good, bad) for i, (t, good, bad) in enumerate(triples)]
    cfg = AnnotatorConfig(pool=[OracleAnnotatorConfig(name="sharp", sharpness=500.0)], label_noise=0.5, seed=0)
    table = annotate_pairs(rows, cfg).to_pylist()
    noised = [r for r in table if r["noised"]]
    assert 0.4 < len(noised) / len(table) < 0.6
    # un-noised rows are the annotator's (certain) judgement; noised ones a coin: ~25% flipped overall
    assert all(r["preference"] == 1.0 for r in table if not r["noised"])
    flipped = sum(r["preference"] == 2.0 for r in table) / len(table)
    assert 0.15 < flipped < 0.35


def test_no_label_noise_never_noised():
    tasks = make_tasks(100)
    rows = [row(i, t, correct_output(t), "no idea") for i, t in enumerate(tasks)]
    assert not any(annotate_pairs(rows, AnnotatorConfig(label_noise=0.0)).column("noised").to_pylist())


# ----------------------------------------------------------------------------- biases


def equal_gold_rows(n, make_second):
    """Sort tasks with two outputs of equal gold (1.0): the canonical answer and a variant."""
    tasks = make_tasks(n, seed=5, families=("sort",))
    return [row(i, t, correct_output(t), make_second(t)) for i, t in enumerate(tasks)]


def test_position_bias_prefers_the_first_shown_output():
    rows = equal_gold_rows(60, lambda t: correct_output(t).replace(", ", " "))
    table = annotate_pairs(rows, one(sharpness=1e-9, position_bias=60.0)).to_pylist()
    assert all(r["gold_1"] == r["gold_2"] == 1.0 for r in table)
    assert {r["swapped"] for r in table} == {True, False}
    # the output shown first wins: output_1 unless the pair was shown swapped
    assert [r["preference"] for r in table] == [2.0 if r["swapped"] else 1.0 for r in table]
    # a negative position bias prefers the second shown
    table = annotate_pairs(rows, one(sharpness=1e-9, position_bias=-60.0)).to_pylist()
    assert [r["preference"] for r in table] == [1.0 if r["swapped"] else 2.0 for r in table]


def test_length_bias_prefers_the_longer_output():
    def long(t):
        return "Sure! Here are the numbers in order: " + correct_output(t)

    rows = equal_gold_rows(40, long)
    rows = [r if i % 2 else r | {"output_1": r["output_2"], "output_2": r["output_1"]} for i, r in enumerate(rows)]
    table = annotate_pairs(rows, one(sharpness=1e-9, length_bias=200.0)).to_pylist()
    assert all(r["gold_1"] == r["gold_2"] == 1.0 for r in table)
    assert {r["swapped"] for r in table} == {True, False}
    for r in table:
        longer = 1.0 if len(r["output_1"]) > len(r["output_2"]) else 2.0
        assert r["preference"] == longer


def test_default_pool_decides_equal_gold_by_length_and_clear_differences_by_gold():
    """The calibration of the default pool (p_sim^eval, no flips): like AlpacaFarm's judges it
    prefers the longer of two equally good answers nearly always, yet a longer wrong answer
    does not beat a right one. A pool that preferred the longer answer only ~60% of the time would
    label these equal-gold pairs nearly at random, unlike AlpacaFarm's length-biased judges."""
    lead = "Sure! Here are the numbers in order: "
    rows = equal_gold_rows(200, lambda t: lead + correct_output(t))
    table = annotate_pairs(rows, AnnotatorConfig(label_noise=0.0)).to_pylist()
    assert all(r["gold_1"] == r["gold_2"] == 1.0 for r in table)
    assert {r["annotator"] for r in table} == {"careful", "verbose-lover", "list-lover", "first-glance", "hasty"}
    longer = sum(r["preference"] == 2.0 for r in table) / len(table)
    assert 0.85 <= longer < 1.0  # every annotator's P(longer) is 0.88-0.998 on these pairs
    wrong = [r | {"output_2": lead + "97, 98, 99"} for r in rows]  # longer, and gold 0 (not the input numbers)
    table = annotate_pairs(wrong, AnnotatorConfig(label_noise=0.0)).to_pylist()
    assert all(r["gold_2"] == 0.0 for r in table)
    assert sum(r["preference"] == 1.0 for r in table) / len(table) >= 0.95


def test_list_bias_prefers_the_list():
    def numbered(t):
        return "\n".join(f"{i}. {x}" for i, x in enumerate(correct_output(t).split(", "), 1))

    rows = equal_gold_rows(40, numbered)
    table = annotate_pairs(rows, one(sharpness=1e-9, list_bias=60.0)).to_pylist()
    assert all(r["gold_1"] == r["gold_2"] == 1.0 for r in table)
    assert all(is_list(r["output_2"]) and not is_list(r["output_1"]) for r in table)
    assert [r["preference"] for r in table] == [2.0] * 40


@pytest.mark.parametrize("scale", [None, 10.0])
def test_oracle_logit_formula(scale):
    t = make_tasks(1, families=("sort",))[0]
    extra = {} if scale is None else {"length_scale": scale}
    a = OracleAnnotator(
        OracleAnnotatorConfig(name="x", sharpness=2.0, length_bias=0.5, list_bias=0.3, position_bias=0.1, **extra)
    )
    r = {"task": task_to_json(t), "instruction": t.instruction, "input": t.input}
    first, second = "no idea", "\n".join(f"- {x}" for x in correct_output(t).split(", "))
    bias = 0.5 * math.tanh((len(second) - len(first)) / (scale or 40)) + 0.3 * 1 - 0.1  # default scale: 40 characters
    assert a.bias_logit(first, second) == pytest.approx(bias)
    assert a.logit_second(r, first, second) == pytest.approx(2.0 * (1.0 - 0.0) + bias)


# ----------------------------------------------------------------------------- errors


def test_row_without_task_raises_naming_the_row():
    t = make_tasks(2)
    rows = [row(0, t[0], "a", "b"), row(1, t[1], "a", "b") | {"id": "real-7", "task": None}]
    with pytest.raises(ValueError, match="'real-7'"):
        annotate_pairs(rows, AnnotatorConfig(label_noise=0.0))


def test_huge_sharpness_does_not_overflow():
    triples = good_and_bad(20)
    rows = [row(i, t, good, bad) for i, (t, good, bad) in enumerate(triples)]
    table = annotate_pairs(rows, one("huge", sharpness=1e4))
    assert table.column("preference").to_pylist() == [1.0] * len(triples)


def test_identical_outputs_are_ties_even_under_label_noise():
    tasks = [sample_task("sort", random.Random(i)) for i in range(50)]
    rows = [
        {
            "id": str(i),
            "split": "pref",
            "instruction": t.instruction,
            "input": t.input,
            "task": task_to_json(t),
            "output_1": correct_output(t),
            "output_2": correct_output(t),
        }
        for i, t in enumerate(tasks)
    ]
    table = annotate_pairs(rows, AnnotatorConfig(label_noise=1.0))
    assert set(table.column("preference").to_pylist()) == {1.5}
    assert not any(table.column("noised").to_pylist())


def test_missing_task_is_reported_even_when_the_row_would_be_noised():
    t = sample_task("sort", random.Random(0))
    rows = [
        {
            "id": "row-7",
            "split": "pref",
            "instruction": t.instruction,
            "input": t.input,
            "task": None,
            "output_1": "a",
            "output_2": "b",
        }
    ]
    with pytest.raises(ValueError, match="row-7"):
        annotate_pairs(rows, AnnotatorConfig(label_noise=1.0))
