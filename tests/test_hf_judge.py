"""The in-process LLM judge (annotation kind 'hf'): a real tiny causal LM built here, its next-token probabilities."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest
import torch
from procs import python_env

from farmflow.annotators import annotate, hf, unit_hash
from farmflow.annotators import hf_judge as hf_judge_module
from farmflow.annotators.cache import NAMESPACE, canonical
from farmflow.config import AnnotatorConfig, HFJudgeConfig
from farmflow.evaluation import evaluate_outputs
from farmflow.models import random_llama, train_tokenizer
from farmflow.storage import open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.core import key_config

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

PAIRS = [
    ("Add 2 and 3.", "", "5", "The sum of 2 and 3 is 6."),
    ("Name a primary color.", "", "Red.", "Purple, which is made by mixing red and blue."),
    ("Translate to French.", "Good morning", "Bonjour", "Bonsoir"),
    ("List three fruits.", "", "1. apple\n2. pear\n3. plum", "apple, carrot, bread"),
    ("What is the capital of France?", "", "Paris is the capital of France.", "Lyon"),
    ("Reverse the word.", "stressed", "desserts", "stressed"),
    (
        "Write a haiku about rain.",
        "",
        "Soft rain on the roof\nwhispers to the sleeping town\npuddles hold the sky",
        "Rain is wet.",
    ),
    ("Sort the numbers.", "3, 1, 2", "1, 2, 3", "3, 2, 1"),
    ("Give a synonym of happy.", "", "joyful", "sad"),
]


def save_tiny_judge(folder: Path, chat: bool = False, seed: int = 0) -> Path:
    """A random 1-layer Llama and a BPE tokenizer trained on the judging prompt's words, saved like any hub model.
    A wide initialization makes its answers lean clearly to (a) or (b), and differ by order."""
    specials = ["<|im_start|>", "<|im_end|>"] if chat else []
    texts = [
        hf.SYSTEM,
        hf.QUESTION,
        hf.ANSWER_LEAD + " (a) (b) ## Instruction ## Input ## Output",
        *[" ".join(p) for p in PAIRS],
    ]
    tok = train_tokenizer(texts * 3, vocab_size=400)
    if chat:
        tok.add_special_tokens({"additional_special_tokens": specials})
        tok.chat_template = CHATML
    random_llama(tok, seed=seed, init_range=0.3).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return save_tiny_judge(tmp_path_factory.mktemp("judge") / "tiny-judge")


@pytest.fixture(scope="module")
def judge(judge_dir):
    return hf.load_judge(HFJudgeConfig(model=str(judge_dir)))


def hf_config(judge_dir: Path, **kw) -> AnnotatorConfig:
    return AnnotatorConfig(kind="hf", hf=HFJudgeConfig(model=str(judge_dir), batch_size=kw.pop("batch_size", 4)), **kw)


def rows_of(pairs) -> list[dict]:
    return [
        {"id": f"r{i}", "split": "pref", "instruction": ins, "input": inp, "output_1": o1, "output_2": o2, "task": None}
        for i, (ins, inp, o1, o2) in enumerate(pairs)
    ]


def test_both_orders_are_judged_and_averaged(judge):
    ab = hf.judge_pairs(judge, PAIRS, batch_size=4)
    ba = hf.judge_pairs(judge, [(i, x, o2, o1) for i, x, o1, o2 in PAIRS], batch_size=4)
    for v, w in zip(ab, ba):
        assert v.preference + w.preference == pytest.approx(3.0, abs=1e-6)
        # the same two prompts, roles exchanged: output_1 shown first in (A,B) is output_2 shown second in (B,A)
        assert v.p_1_shown_first == pytest.approx(1 - w.p_1_shown_second, abs=1e-6)
        assert v.p_1_shown_second == pytest.approx(1 - w.p_1_shown_first, abs=1e-6)
        assert v.preference == pytest.approx(2 - (v.p_1_shown_first + v.p_1_shown_second) / 2, abs=1e-12)
    # the random judge has a position bias, so averaging the orders matters; and it is not indifferent
    assert max(abs(v.p_1_shown_first - v.p_1_shown_second) for v in ab) > 0.02
    assert max(abs(v.preference - 1.5) for v in ab) > 0.01


def test_batched_equals_unbatched(judge):
    one = hf.judge_pairs(judge, PAIRS, batch_size=1)
    for batch in (3, 8):
        many = hf.judge_pairs(judge, PAIRS, batch_size=batch)
        for v, w in zip(one, many):
            assert w.p_1_shown_first == pytest.approx(v.p_1_shown_first, abs=1e-5)
            assert w.p_1_shown_second == pytest.approx(v.p_1_shown_second, abs=1e-5)
            assert w.preference == pytest.approx(v.preference, abs=1e-5)
    assert len({len(p.ids) for pair in PAIRS for p in hf.fit(judge, *pair)[0]}) > 5  # the batches really were padded


def test_the_shared_guidance_is_read_once_and_changes_no_answer(judge, monkeypatch):
    """Every prompt opens with the same guidance; its key/value cache, read once and kept on the judge, gives the
    probabilities of reading every prompt whole (batched too)."""
    prompts = [p for pair in PAIRS for p in hf.fit(judge, *pair)[0]]
    judge.prefix = None
    cached = hf.answer_probs(judge, prompts, batch_size=4)
    head = judge.prefix[0]
    assert len(head) >= hf_judge_module.MIN_SHARED and all(p.ids[: len(head)] == list(head) for p in prompts)
    assert len({p.ids[len(head)] for p in prompts}) > 1  # the longest opening they share
    passes = judge.forward_passes
    hf.answer_probs(judge, prompts, batch_size=4)
    assert judge.forward_passes == passes + 5  # 18 prompts in batches of 4; the guidance is not read again
    monkeypatch.setattr(hf_judge_module, "MIN_SHARED", 10**6)  # every prompt read whole
    whole = hf.answer_probs(judge, prompts, batch_size=1)
    for (p, m), (q, n) in zip(cached, whole):
        assert p == pytest.approx(q, abs=1e-5) and m == pytest.approx(n, abs=1e-5)


def test_probabilities_and_preferences_in_range(judge):
    for v in hf.judge_pairs(judge, PAIRS, batch_size=8):
        assert 0 < v.p_1_shown_first < 1 and 0 < v.p_1_shown_second < 1
        assert 0 < v.mass_12 <= 1 and 0 < v.mass_21 <= 1
        assert 1 <= v.preference <= 2 and v.cut_tokens == 0


def test_the_answer_probability_by_hand(judge):
    """P(a) for one prompt from a plain unpadded forward pass over the whole vocabulary."""
    ins, inp, o1, o2 = PAIRS[1]
    text = hf.render(judge, ins, inp, o1, o2)
    assert text.endswith("## Question\n\n" + hf.QUESTION + "\n\n" + hf.ANSWER_LEAD)
    prompt = hf.encode(judge, text)
    full_a = judge.tokenizer(text + " (a)")["input_ids"]
    assert full_a[: len(prompt.ids)] == prompt.ids and full_a[len(prompt.ids)] == prompt.answer_ids[0]
    assert judge.tokenizer.decode(prompt.answer_ids[0]).strip(" (") == "a"
    assert judge.tokenizer.decode(prompt.answer_ids[1]).strip(" (") == "b"
    with torch.no_grad():
        probs = torch.softmax(judge.model(torch.tensor([prompt.ids])).logits[0, -1].double(), dim=-1)
    p_a, p_b = probs[prompt.answer_ids[0]].item(), probs[prompt.answer_ids[1]].item()
    got = hf.judge_pairs(judge, [PAIRS[0], PAIRS[1]], batch_size=2)[1]
    assert got.p_1_shown_first == pytest.approx(p_a / (p_a + p_b), abs=1e-6)
    assert got.mass_12 == pytest.approx(p_a + p_b, rel=1e-5)


def test_the_chat_template_is_used_when_the_tokenizer_has_one(tmp_path):
    judge = hf.load_judge(HFJudgeConfig(model=str(save_tiny_judge(tmp_path / "chat-judge", chat=True))))
    text = hf.render(judge, *PAIRS[0])
    assert judge.chat and text.startswith("<|im_start|>system\n" + hf.SYSTEM)
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n" + hf.ANSWER_LEAD)
    v = hf.judge_pairs(judge, PAIRS[:2], batch_size=2)
    assert all(1 <= x.preference <= 2 for x in v)
    # a template without a system role (it raises, as Gemma's does): the guidance opens the user turn
    judge.tokenizer.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system role') }}{% endif %}"
        "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )
    assert hf.render(judge, *PAIRS[0]).startswith("<|im_start|>user\n" + hf.SYSTEM + "\n\n## Instruction")


def test_long_pairs_are_cut_in_the_middle_to_fit(judge_dir):
    judge = hf.load_judge(HFJudgeConfig(model=str(judge_dir), max_prompt_tokens=400))
    assert judge.limit == 400
    long_1, long_2 = "apple " * 300 + "THE END", "pear " * 100 + "FINALE"
    (p12, p21), cut = hf.fit(judge, "List fruits.", "", long_1, long_2)
    assert cut > 300 and max(len(p12.ids), len(p21.ids)) <= 400
    text = judge.tokenizer.decode(p12.ids)
    assert "tokens cut ...]" in text and text.rstrip(" (").endswith(hf.ANSWER_LEAD)
    assert "THE END" in text and "FINALE" in text  # each output keeps its start and its end
    # an instruction longer than the whole limit: still judged, within the limit, ending with the question
    (q12, _), cut2 = hf.fit(judge, "Say why. " * 300, "", "yes", "no")
    assert len(q12.ids) == 400 and cut2 > 0 and judge.tokenizer.decode(q12.ids).rstrip(" (").endswith(hf.ANSWER_LEAD)
    table, metrics = annotate(
        rows_of([("List fruits.", "", long_1, long_2), PAIRS[0]]),
        AnnotatorConfig(kind="hf", hf=HFJudgeConfig(model=str(judge_dir), max_prompt_tokens=400)),
        str(judge_dir.parent / "store-cut"),
    )
    assert metrics["truncated"] == 1 and metrics["judged"] == 2
    assert 1 <= table.column("preference")[0].as_py() <= 2


def test_annotate_gives_the_preferences_table_and_caches_every_row(judge_dir, tmp_path):
    rows = rows_of(PAIRS) + rows_of([("Tie?", "", "same", "same"), PAIRS[0]])  # a tie, and a pair asked twice
    settled: list[int] = []
    hf.load_judge(HFJudgeConfig(model=str(judge_dir))).prefix = None  # the process's judge: its guidance not read yet
    table, metrics = annotate(rows, hf_config(judge_dir), str(tmp_path), progress=settled.append)
    assert table.schema == SCHEMAS["preferences"] and table.num_rows == len(rows) and sum(settled) == len(rows)
    assert metrics["judged"] == len(PAIRS) and metrics["ties"] == 1 and metrics["cached"] == 0
    assert table.column("preference")[-1].as_py() == table.column("preference")[0].as_py()
    assert metrics["forward_passes"] == 1 + 5  # the shared guidance once, 9 pairs x 2 orders in batches of 4
    got = table.to_pylist()
    assert got[-2]["preference"] == 1.5 and got[-2]["p_1_shown_first"] is None
    expected = hf.judge_pairs(hf.load_judge(HFJudgeConfig(model=str(judge_dir))), PAIRS, batch_size=1)
    for r, v in zip(got, expected):
        assert r["annotator"] == "hf:tiny-judge" and r["swapped"] is False and r["noised"] is False
        assert (r["preference"], r["p_1_shown_first"], r["p_1_shown_second"]) == pytest.approx(
            (v.preference, v.p_1_shown_first, v.p_1_shown_second), abs=1e-5
        )
    log = open_store(tmp_path).read_rows(NAMESPACE, NAMESPACE).to_pylist()
    assert len(log) == len(PAIRS) and all(r["status"] == "ok" and r["p_1_shown_first"] is not None for r in log)

    # a rerun computes nothing; the same pairs with their outputs exchanged come from the cache as 3 - p
    again, m2 = annotate(rows, hf_config(judge_dir, batch_size=2), str(tmp_path), progress=settled.append)
    assert m2["judged"] == 0 and m2["forward_passes"] == 0 and m2["cached"] == len(PAIRS) + 1
    assert sum(settled) == 2 * len(rows)
    assert again.column("preference").to_pylist() == table.column("preference").to_pylist()
    flipped, m3 = annotate(rows_of([(i, x, o2, o1) for i, x, o1, o2 in PAIRS]), hf_config(judge_dir), str(tmp_path))
    assert m3["forward_passes"] == 0
    for r, f in zip(got, flipped.to_pylist()):
        assert f["preference"] == pytest.approx(3 - r["preference"], abs=1e-12)
        assert (f["p_1_shown_first"], f["p_1_shown_second"]) == pytest.approx(
            (1 - r["p_1_shown_second"], 1 - r["p_1_shown_first"]), abs=1e-12
        )
    assert len(open_store(tmp_path).read_rows(NAMESPACE, NAMESPACE)) == len(PAIRS)


def test_the_cache_is_appended_in_chunks(judge_dir, tmp_path):
    annotate(rows_of(PAIRS), hf_config(judge_dir, chunk_size=4), str(tmp_path))
    assert len(open_store(tmp_path).row_chunks(NAMESPACE)) == 3  # 4 + 4 + 1 pairs


TWO_RUNS = """
import json, logging, os, sys, time
from farmflow.annotators import annotate
logging.basicConfig(level=logging.INFO)
from farmflow.config import AnnotatorConfig
open({ready!r}, "w").close()
while not all(os.path.exists(p) for p in {barrier!r}):  # start judging together
    time.sleep(0.01)
rows = [{{"instruction": f"Say the number {{i}}.", "input": "", "output_1": f"{{i}}", "output_2": f"It is {{i + 1}}."}}
        for i in range(120)]
cfg = AnnotatorConfig(kind="hf", hf={{"model": {model!r}, "batch_size": 4}}, chunk_size=5)
table, totals = annotate(rows, cfg, {store!r})
print(json.dumps({{"totals": totals, "prefs": table.column("preference").to_pylist()}}))
"""


def test_two_processes_judging_the_same_pairs_at_once_judge_each_once(judge_dir, tmp_path):
    """Two real processes run the hf judge over the same 120 pairs on one store at the same moment: the row cache
    ends with 120 judgments, not 240; the runs' judged counts add up to 120; both end with the same labels."""
    store, barrier = str(tmp_path / "store"), [str(tmp_path / "a"), str(tmp_path / "b")]
    procs = []
    for ready in barrier:
        code = TWO_RUNS.format(ready=ready, barrier=barrier, model=str(judge_dir), store=store)
        env = python_env(FARMFLOW_LEASE_TTL_S="3")
        procs.append(
            subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        )
    runs, logs = [], []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()[-3000:]
        runs.append(json.loads(out.decode().strip().splitlines()[-1]))
        logs.append(err.decode())
    a, b = runs
    assert a["totals"]["judged"] + b["totals"]["judged"] == 120
    assert any("are being asked by another run; waiting" in log for log in logs)  # they did overlap
    assert a["prefs"] == b["prefs"] and None not in a["prefs"]
    log = open_store(store).read_rows(NAMESPACE, NAMESPACE).to_pylist()
    assert len(log) == len({r["key"] for r in log}) == 120
    assert not list((tmp_path / "store" / "_leases").rglob("*.json"))  # every lease and heartbeat released


def test_label_noise_replaces_labels_by_a_seeded_coin_without_judging(judge_dir, tmp_path):
    pairs = [(f"Say the number {i}.", "", f"{i}", f"The number is {i + 1}.") for i in range(40)]
    table, metrics = annotate(rows_of(pairs), hf_config(judge_dir, label_noise=0.5, seed=3), str(tmp_path))
    rows = table.to_pylist()
    expected = [unit_hash(3, "noise", ins, inp, *canonical(o1, o2)[:2]) < 0.5 for ins, inp, o1, o2 in pairs]
    assert [r["noised"] for r in rows] == expected and 10 < sum(expected) < 30
    assert metrics["noised"] == sum(expected) and metrics["judged"] == 40 - sum(expected)
    assert all(r["preference"] in (1.0, 2.0) and r["p_1_shown_first"] is None for r in rows if r["noised"])
    assert all(r["p_1_shown_first"] is not None for r in rows if not r["noised"])
    assert 0 < sum(r["preference"] == 2.0 for r in rows if r["noised"]) < sum(expected)


def test_the_judge_identity_keys_the_stage(judge_dir, tmp_path):
    key = lambda cfg: key_config(cfg)  # noqa: E731
    base = hf_config(judge_dir)
    assert key(base) == key(hf_config(judge_dir, batch_size=1))  # batch size: not the judge's identity
    assert key(base) != key(base.model_copy(update={"hf": base.hf.model_copy(update={"dtype": "bfloat16"})}))
    assert key(base) != key(base.model_copy(update={"hf": base.hf.model_copy(update={"max_prompt_tokens": 512})}))
    other = save_tiny_judge(tmp_path / "tiny-judge", seed=1)  # same name, other weights
    assert hf.judge_hash(HFJudgeConfig(model=str(other))) != hf.judge_hash(base.hf)
    # the hf section stays out of the other kinds' keys
    assert key(AnnotatorConfig()) == key(AnnotatorConfig(hf=HFJudgeConfig(model="another-judge")))


def test_the_annotate_and_evaluate_stages_run_with_the_hf_judge(judge_dir, tmp_path):
    from farmflow.tasks import annotate_task

    store = open_store(tmp_path)
    pairs = store.put_table(
        "sample_pairs", "k1", pa.Table.from_pylist(rows_of(PAIRS), schema=SCHEMAS["pairs"]), "pairs"
    )
    ref = annotate_task.fn(str(tmp_path), hf_config(judge_dir), pairs)
    assert ref.rows == len(PAIRS) and ref.metrics["judged"] == len(PAIRS)
    ref2 = annotate_task.fn(str(tmp_path), hf_config(judge_dir, seed=1), pairs)  # another key, the same judged pairs
    assert ref2.key != ref.key and ref2.metrics["cached"] == len(PAIRS) and ref2.metrics["forward_passes"] == 0
    prefs = store.read_table(ref).column("preference").to_pylist()

    outputs = [
        {"id": f"r{i}", "instruction": ins, "input": inp, "output": o2, "generator": "m", "task": None}
        for i, (ins, inp, _, o2) in enumerate(PAIRS)
    ]
    references = [{"id": f"r{i}", "output": o1} for i, (_, _, o1, _) in enumerate(PAIRS)]
    table, stats = evaluate_outputs(outputs, references, hf_config(judge_dir), str(tmp_path))
    assert table.column("preference").to_pylist() == pytest.approx(prefs, abs=1e-12)  # the same pairs, from the cache
    assert stats["win_rate"] == pytest.approx(100 * sum(p - 1 for p in prefs) / len(prefs), abs=1e-6)


def test_a_judge_that_cannot_load_is_one_clear_error(tmp_path):
    from farmflow.annotators import AnnotationError

    (tmp_path / "empty").mkdir()
    with pytest.raises(AnnotationError, match=r"^annotation.hf.model: cannot load the judge .*empty") as err:
        annotate(
            rows_of(PAIRS[:1]),
            AnnotatorConfig(kind="hf", hf=HFJudgeConfig(model=str(tmp_path / "empty"))),
            str(tmp_path),
        )
    assert "\n" not in str(err.value)
    if not torch.cuda.is_available():
        with pytest.raises(AnnotationError, match=r"^annotation.hf.device: 'cuda' asked for"):
            hf.load_judge(HFJudgeConfig(model=str(tmp_path / "empty"), device="cuda"))
