import random

import pytest

from farmflow.data.synthetic import (
    ALL_WORDS,
    FAMILIES,
    VOCAB,
    Task,
    correct_output,
    demonstrate,
    gold_reward,
    reference_output,
    sample_task,
    task_from_json,
    task_to_json,
    write,
)

ARITH = {"a": 37, "b": 48, "op": "+"}
SORT = {"numbers": [12, 85, 3], "descending": False}
REVERSE = {"words": ["red", "cat", "hammer", "plum"]}
LIST = {"category": "animals", "count": 4}
MAX = {"numbers": [12, 85, 3, 40]}


def tasks(family, n=200, seed=0):
    rng = random.Random(seed)
    return [sample_task(family, rng) for _ in range(n)]


# ----------------------------------------------------------------------------- per family gold


def test_arithmetic_gold():
    assert gold_reward("arithmetic", ARITH, "85") == 1.0
    assert gold_reward("arithmetic", {"a": 90, "b": 5, "op": "-"}, "85") == 1.0
    # carry error: 75 vs 85 -> digit match 1/2, closeness 1 - 10/85
    assert gold_reward("arithmetic", ARITH, "75") == pytest.approx(0.8 * (0.25 + 0.5 * 75 / 85))
    # 1-digit answer off by one: no digit matches, closeness 1 - 1/10
    assert gold_reward("arithmetic", {"a": 3, "b": 4, "op": "+"}, "8") == pytest.approx(0.36)
    # two digits right but far off: closeness clamps at 0
    assert gold_reward("arithmetic", ARITH, "185") == pytest.approx(0.8 * 0.5 * 2 / 3)
    assert gold_reward("arithmetic", ARITH, "37 + 48 = 86") == pytest.approx(0.8 * (0.25 + 0.5 * 84 / 85))


def test_sort_gold():
    assert gold_reward("sort", SORT, "3, 12, 85") == 1.0
    assert gold_reward("sort", {**SORT, "descending": True}, "85, 12, 3") == 1.0
    assert gold_reward("sort", SORT, "12, 3, 85") == pytest.approx(0.5)  # one of two pairs in order
    assert gold_reward("sort", SORT, "3, 12") == pytest.approx(2 / 3)  # dropped item
    assert gold_reward("sort", SORT, "3, 12, 85, 85") == pytest.approx(3 / 4)  # extra item
    assert gold_reward("sort", SORT, "85, 12, 3") == 0.0  # wrong direction


def test_reverse_gold():
    assert gold_reward("reverse", REVERSE, "plum hammer cat red") == 1.0
    # swapped middle pair: 2 positions right, LCS 3 -> (2 + 3) / 2 / 4
    assert gold_reward("reverse", REVERSE, "plum cat hammer red") == pytest.approx(0.625)
    # dropped first word: no position right, LCS 3 -> 3 / 2 / 4
    assert gold_reward("reverse", REVERSE, "hammer cat red") == pytest.approx(0.375)
    assert gold_reward("reverse", REVERSE, "plum hammer cat red red") == pytest.approx(0.8)


def test_list_items_gold():
    assert gold_reward("list_items", LIST, "cat, dog, cow, pig") == 1.0
    assert gold_reward("list_items", LIST, "cat, dog, cow, cow") == pytest.approx(0.75)  # duplicate
    assert gold_reward("list_items", LIST, "cat, dog, red, cow") == pytest.approx(0.75)  # category
    assert gold_reward("list_items", LIST, "cat, dog") == pytest.approx(0.5)  # too few
    assert gold_reward("list_items", LIST, "cat, dog, cow, pig, fox") == pytest.approx(0.8)
    assert gold_reward("list_items", LIST, "red, blue, green, gold") == 0.0


def test_max_number_gold():
    assert gold_reward("max_number", MAX, "85") == 1.0
    assert gold_reward("max_number", MAX, "40") == pytest.approx(0.5 * 2 / 3)  # beats 12 and 3
    assert gold_reward("max_number", MAX, "3") == 0.0
    assert gold_reward("max_number", MAX, "86") == 0.0


CASES = [
    ("arithmetic", ARITH, "85"),
    ("sort", SORT, "3, 12, 85"),
    ("reverse", REVERSE, "plum hammer cat red"),
    ("list_items", LIST, "cat, dog, cow, pig"),
    ("max_number", MAX, "85"),
]


@pytest.mark.parametrize("family,params,answer", CASES)
def test_formatting_does_not_change_gold(family, params, answer):
    items = answer.replace(",", "").split()
    variants = [
        f"Sure! Here is the answer: {answer}",
        f"The answer is {answer}.",
        f"Sure!\n{answer}",
        f"  {answer}  \n",
        "\n".join(f"- {x}" for x in items),
        "Here they are:\n" + "\n".join(f"{i}. {x}" for i, x in enumerate(items, 1)),
        "1. " + "\n2. ".join(items) if len(items) > 1 else answer,
        ", ".join(items),
    ]
    for text in variants:
        assert gold_reward(family, params, text) == 1.0, text


@pytest.mark.parametrize("family,params,answer", CASES)
def test_garbage_scores_zero(family, params, answer):
    for text in ("", "   ", "\n", "asdf qwerty zzz", "!!! ??? ...", "I don't know."):
        assert gold_reward(family, params, text) == 0.0, text


# ----------------------------------------------------------------------------- policies


@pytest.mark.parametrize("family", FAMILIES)
def test_correct_output_is_perfect(family):
    for task in tasks(family):
        assert gold_reward(family, task.params, correct_output(task)) == 1.0


@pytest.mark.parametrize("policy", [demonstrate, reference_output])
@pytest.mark.parametrize("family", FAMILIES)
def test_policies(family, policy):
    rng = random.Random(1)
    perfect = [gold_reward(family, t.params, policy(t, rng, 0.0)) for t in tasks(family)]
    assert all(g == 1.0 for g in perfect)
    flawed = [gold_reward(family, t.params, policy(t, rng, 1.0)) for t in tasks(family)]
    if family == "categorize":  # a hedge earns half, a wrong category nothing
        assert set(flawed) <= {0.0, 0.5}
        assert policy is reference_output or 0.5 in flawed  # compounded mistakes end on a wrong category
    elif policy is demonstrate:  # exactly one partial-credit mistake
        assert all(0.0 < g < 1.0 for g in flawed)
    else:  # compounding mistakes can cancel (+1 then -1) or wipe out the answer, rarely
        assert sum(0.0 < g < 1.0 for g in flawed) >= 0.5 * len(flawed)
    if family != "categorize":
        assert 0.1 < sum(flawed) / len(flawed) < 0.9
    outputs = [policy(t, rng, 0.5) for t in tasks(family)]
    assert all(0 < len(o) < 120 for o in outputs)


def test_a_writer_by_name_is_that_policy_drawn_from_its_seed():
    task = tasks("sort")[0]
    assert write(task, "reference", 0.5, "s/1") == reference_output(task, random.Random("s/1"), 0.5)
    assert write(task, "demonstrator", 0.5, "s/1") == demonstrate(task, random.Random("s/1"), 0.5)
    draws = {write(task, "demonstrator", 1.0, f"s/{i}") for i in range(20)}
    assert len(draws) > 1  # seeds draw different answers
    with pytest.raises(ValueError, match=r"unknown writer 'gpt4'; known: \['demonstrator', 'reference'\]"):
        write(task, "gpt4", 0.0, "s")


def test_reference_gets_steadily_worse_with_error_rate():
    means = []
    for rate in (0.0, 0.3, 0.6, 0.9):
        rng = random.Random(3)
        golds = [gold_reward(t.family, t.params, reference_output(t, rng, rate)) for f in FAMILIES for t in tasks(f)]
        means.append(sum(golds) / len(golds))
    assert means[0] == 1.0
    assert means == sorted(means, reverse=True) and means[-1] < 0.7


def test_demonstrations_vary_in_style():
    rng = random.Random(2)
    task = sample_task("sort", rng)
    outputs = {demonstrate(task, rng, 0.0) for _ in range(50)}
    assert any("\n1. " in o or o.startswith("1. ") for o in outputs)
    assert any(o.startswith("- ") or "\n- " in o for o in outputs)
    assert any(":" in o for o in outputs) and any(":" not in o for o in outputs)


def test_bad_error_rate():
    task = sample_task("sort", random.Random(0))
    with pytest.raises(ValueError):
        demonstrate(task, random.Random(0), 1.5)


# ----------------------------------------------------------------------------- misc


def test_determinism():
    for family in FAMILIES:
        assert tasks(family, 20, seed=3) == tasks(family, 20, seed=3)
        assert tasks(family, 20, seed=3) != tasks(family, 20, seed=4)
        t = tasks(family, 1)[0]
        for policy in (demonstrate, reference_output):
            a = [policy(t, random.Random(7), 0.5) for _ in range(5)]
            assert a == [policy(t, random.Random(7), 0.5) for _ in range(5)]


def test_json_round_trip():
    for family in FAMILIES:
        for task in tasks(family, 20):
            s = task_to_json(task)
            assert task_from_json(s) == task
            assert task_to_json(task_from_json(s)) == s
    assert task_to_json(Task("sort", "x", "1", {"b": 1, "a": 2})).index('"a"') < 20 * 10


def test_inputs():
    for family in FAMILIES:
        has_input = [t.input != "" for t in tasks(family, 50)]
        assert all(has_input) or not any(has_input)
        assert all(has_input) == (family in ("sort", "reverse", "max_number", "categorize"))


def test_vocabulary_is_closed_and_disjoint():
    assert len(ALL_WORDS) == len(VOCAB)
    assert all(w.isalpha() and w.islower() for w in VOCAB)


def test_unknown_family():
    for call in (lambda: sample_task("poetry", random.Random(0)), lambda: gold_reward("poetry", {}, "x")):
        with pytest.raises(ValueError, match="poetry") as err:
            call()
        assert all(f in str(err.value) for f in FAMILIES)


def test_gold_always_in_unit_interval():
    rng = random.Random(0)
    alphabet = list("0123456789 ,.:=-\n") + list(ALL_WORDS[:10]) + ["9" * 50]
    for family in FAMILIES:
        for task in tasks(family, 50):
            for _ in range(10):
                text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40)))
                assert 0.0 <= gold_reward(family, task.params, text) <= 1.0
