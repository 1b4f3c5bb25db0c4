"""The human labeling page (`farmflow label serve`) in a real browser, and the labels' rows, export and import."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
from procs import python_env
from typer.testing import CliRunner

from farmflow.cli import app
from farmflow.labeling.files import export_rows, import_file
from farmflow.labeling.labels import (
    labels,
    load_pairs,
    pressed_row,
    shown,
    shown_swapped,
)
from farmflow.labeling.session import Session
from farmflow.loopback import free_port
from farmflow.storage import open_store
from farmflow.storage.sql import connect

CHROMIUM = "/usr/bin/chromium"
CLI = "from farmflow.cli import main; main()"
# each labeler's labels in force: the latest row of each pair, when it is a label (not an undo); docs/labeling.md
IN_FORCE = """
SELECT annotator, instruction, output_1, output_2, preference, swapped, raw_completion FROM annotations
WHERE annotator LIKE 'human:%'
QUALIFY row_number() OVER (PARTITION BY key ORDER BY created DESC) = 1 AND status = 'ok'
ORDER BY instruction
"""


def write_pairs(path, n: int) -> list[dict]:
    """`n` pairs; in even ones output_1 sorts after output_2, so the canonical order flips half of them."""
    pairs = [
        {
            "instruction": f"Task {i}: name a colour.",
            "input": "" if i % 3 else f"context {i}",
            "output_1": f"{'zeta' if i % 2 == 0 else 'alpha'} answer {i}",
            "output_2": f"{'alpha' if i % 2 == 0 else 'zeta'} answer {i}",
        }
        for i in range(n)
    ]
    path.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    return pairs


def own(pressed: str, first: str, pair: dict) -> float:
    """What a key pressed on the page means for the pair: 1 = the output shown first is better."""
    if pressed == "t":
        return 1.5
    better = first if pressed == "1" else (pair["output_2"] if first == pair["output_1"] else pair["output_1"])
    return 1.0 if better == pair["output_1"] else 2.0


@pytest.fixture
def store(tmp_path):
    return open_store(tmp_path / "store")


# ---------------------------------------------------------------- the page in a real browser
def test_label_five_pairs_by_keyboard_undo_reload_and_resume(tmp_path):
    if not os.path.exists(CHROMIUM):
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian package chromium)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    pairs = write_pairs(tmp_path / "pairs.jsonl", 6)
    store_dir, port = tmp_path / "store", free_port()
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                CLI,
                "label",
                "serve",
                "--pairs",
                str(tmp_path / "pairs.jsonl"),
                "--labeler",
                "ann",
                "--port",
                str(port),
                "--store",
                str(store_dir),
            ],
            env=python_env(),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}/"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(url + "api/state", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert proc.poll() is None, "the server exited: " + log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the server did not answer: " + log.read_text()[-3000:]
            time.sleep(0.1)

        typed: dict[int, tuple[str, str]] = {}  # pair index → (key pressed, output shown first)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=CHROMIUM, headless=True)
            page = browser.new_page()
            page.goto(url)
            page.wait_for_selector("body[data-ready='1']")

            def press(key: str, expect_done: int) -> None:
                index = int(page.get_attribute("body", "data-index"))
                assert page.text_content("#instruction") == pairs[index]["instruction"]
                if key != "u":
                    typed[index] = (key, page.text_content("#first"))
                page.keyboard.press(key)
                page.wait_for_function(f"document.getElementById('progress').textContent.startsWith('{expect_done} /')")

            for key, done in [("1", 1), ("t", 2), ("2", 3), ("1", 4), ("u", 3), ("2", 4), ("1", 5)]:
                press(key, done)
            assert page.text_content("#error") == ""

            # the labels are in the store already (read here, not by the server), then the page is reloaded
            assert len(labels(open_store(store_dir), "ann")) == 5
            page.reload()
            page.wait_for_selector("body[data-ready='1']")
            assert page.get_attribute("body", "data-index") == "5"
            assert page.text_content("#instruction") == pairs[5]["instruction"]
            assert page.text_content("#progress") == "5 / 6 labeled"
            typed[5] = ("2", page.text_content("#first"))  # the last one with the mouse
            page.click("#b2")
            page.wait_for_selector("#finished", state="visible")
            assert page.text_content("#progress") == "6 / 6 labeled" and page.is_disabled("#b1")
            browser.close()
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=30)
    assert "Traceback" not in log.read_text()

    # pair 3 was labeled 1, undone, then labeled 2: the log holds all three rows, the latest wins
    st = open_store(store_dir)
    rows = {r["instruction"]: r for r in connect(st).sql(IN_FORCE).to_arrow_table().to_pylist()}
    assert sorted(rows) == [pairs[i]["instruction"] for i in range(6)]
    for i, (key, first) in typed.items():
        pair = pairs[i]
        row = rows[pair["instruction"]]
        preference = row["preference"] if row["output_1"] == pair["output_1"] else 3.0 - row["preference"]
        assert preference == own(key, first, pair), i
        assert row["raw_completion"] == key and row["swapped"] == (first == row["output_2"])
    assert [typed[i][0] for i in range(6)] == ["1", "t", "2", "2", "1", "2"]
    assert {r["swapped"] for r in rows.values()} == {True, False}  # both display orders were mapped back
    statuses = connect(st).sql("SELECT status FROM annotations WHERE instruction LIKE 'Task 3:%' ORDER BY created")
    assert [s for (s,) in statuses.fetchall()] == ["ok", "undone", "ok"]


# ---------------------------------------------------------------- plain functions
def test_display_order_is_random_per_pair_and_labeler_recorded_and_mapped_back(tmp_path, store):
    write_pairs(tmp_path / "p.jsonl", 200)
    pairs = load_pairs(store, str(tmp_path / "p.jsonl"))
    ann = [shown_swapped("ann", p) for p in pairs]
    bob = [shown_swapped("bob", p) for p in pairs]
    assert 70 <= sum(ann) <= 130 and ann != bob  # a fair coin per pair (200 draws: 100 ± 3.5 sd)
    assert ann == [shown_swapped("ann", p) for p in pairs]  # the same on every reload
    for pair in pairs[:20]:
        first, second = shown("ann", pair)
        assert {first, second} == {pair["output_1"], pair["output_2"]}
        for key in ("1", "2", "t"):
            row = pressed_row("ann", pair, key)
            assert row["swapped"] == (first == row["output_2"]) and row["raw_completion"] == key
            preference = row["preference"] if row["output_1"] == pair["output_1"] else 3.0 - row["preference"]
            assert preference == own(key, first, pair)
    with pytest.raises(ValueError, match="use 1, 2 or t"):
        pressed_row("ann", pairs[0], "3")


def test_two_labelers_label_the_same_pairs_independently(tmp_path, store):
    write_pairs(tmp_path / "p.jsonl", 4)
    pairs = load_pairs(store, str(tmp_path / "p.jsonl"))
    ann, bob = Session(store, pairs, "ann"), Session(store, pairs, "bob")
    for key in ("1", "2", "t"):
        ann.label(ann.state()["pair"]["key"], key)
    bob.label(bob.state()["pair"]["key"], "2")
    assert ann.undo()["index"] == 2 and bob.state()["done"] == 1
    # a new session (a restarted server) reads the same progress from the store
    assert Session(store, pairs, "ann").state()["index"] == 2 and Session(store, pairs, "bob").state()["index"] == 1
    assert [len(labels(store, name)) for name in ("ann", "bob", "cid")] == [2, 1, 0]
    assert {r["annotator"] for r in labels(store, "ann")} == {"human:ann"}


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_export_then_import_round_trip(tmp_path, store, fmt):
    write_pairs(tmp_path / "p.jsonl", 5)
    pairs = load_pairs(store, str(tmp_path / "p.jsonl"))
    ann = Session(store, pairs, "ann")
    for key in ("1", "t", "2", "2"):
        ann.label(ann.state()["pair"]["key"], key)
    out = tmp_path / f"ann.{fmt}"
    runner = CliRunner()
    result = runner.invoke(
        app,
        [
            "label",
            "export",
            "--labeler",
            "ann",
            "--format",
            fmt,
            "-o",
            str(out),
            "--pairs",
            str(tmp_path / "p.jsonl"),
            "--store",
            str(store.root),
        ],
    )
    assert result.exit_code == 0, result.output
    exported = export_rows(store, "ann", pairs)
    assert [r["id"] for r in exported] == [f"p.jsonl:{i}" for i in range(4)]
    assert [r["preference"] for r in exported] == [own(k, shown("ann", p)[0], p) for k, p in zip("1t22", pairs)]
    if fmt == "csv":
        with out.open(newline="") as f:
            assert [float(r["preference"]) for r in csv.DictReader(f)] == [r["preference"] for r in exported]
    result = runner.invoke(app, ["label", "import", str(out), "--labeler", "dee", "--store", str(store.root)])
    assert result.exit_code == 0 and "imported 4 labels as human:dee" in result.stdout, result.output
    strip = [{k: v for k, v in r.items() if k != "annotator"} for r in exported]
    assert [{k: v for k, v in r.items() if k != "annotator"} for r in export_rows(store, "dee", pairs)] == strip
    assert all(r["swapped"] is None for r in labels(store, "dee"))


def test_import_alpacafarm_layout_reads_0_as_a_tie(tmp_path, store):
    rows = [
        {"instruction": "Say hi.", "input": "", "output_1": "hi", "output_2": "hello", "preference": p}
        for p in (1, 2, 0)
    ]
    rows[1]["instruction"], rows[2]["instruction"] = "Say hey.", "Say yo."
    (tmp_path / "human.json").write_text(json.dumps(rows))
    assert import_file(store, tmp_path / "human.json", "crowd") == 3
    assert [r["preference"] for r in export_rows(store, "crowd", [r | {"id": str(i)} for i, r in enumerate(rows)])] == [
        1.0,
        2.0,
        1.5,
    ]


@pytest.mark.parametrize(
    "content, line",
    [
        (
            '{"instruction": "a", "output_1": "x", "output_2": "y", "preference": 1}\n'
            + '{"instruction": "b", "output_1": "x", "output_2": "y", "preference": 3}\n',
            "line 2: column 'preference' is 3",
        ),
        ('{"instruction": "a", "output_1": "x", "preference": 1}\n', "line 1: missing column 'output_2'"),
    ],
)
def test_a_bad_file_is_one_error_line_naming_file_and_row_and_writes_nothing(tmp_path, store, content, line):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(content)
    result = CliRunner().invoke(app, ["label", "import", str(bad), "--labeler", "ann", "--store", str(store.root)])
    assert result.exit_code == 2 and result.stderr.startswith(f"error: {bad}: {line}"), result.output
    assert result.stderr.count("\n") == 1 and store.row_chunks("annotations") == []


def test_serve_refuses_a_bad_pairs_file_unknown_pairs_and_bad_labeler_names(tmp_path, store):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "output_1": "x", "output_2": "y"}\n{"instruction": "b", "output_1": "x"}\n')
    result = CliRunner().invoke(
        app, ["label", "serve", "--pairs", str(bad), "--port", str(free_port()), "--store", str(store.root)]
    )
    assert result.exit_code == 2 and result.stderr == f"error: {bad}: line 2: missing column 'output_2'\n"
    result = CliRunner().invoke(app, ["label", "serve", "--pairs", "nokey", "--store", str(store.root)])
    assert result.exit_code == 2
    assert result.stderr == "error: --pairs 'nokey': no such file, and no artifact key matches\n"
    result = CliRunner().invoke(app, ["label", "export", "--labeler", "a b", "-o", "x.csv", "--store", str(store.root)])
    assert result.exit_code == 2 and "labeler name 'a b'" in result.stderr
    out = tmp_path / "no" / "x.csv"
    result = CliRunner().invoke(
        app, ["label", "export", "--labeler", "ann", "-o", str(out), "--store", str(store.root)]
    )
    assert result.exit_code == 2 and result.stderr == f"error: {out}: cannot be written (No such file or directory)\n"
    result = CliRunner().invoke(
        app, ["label", "import", str(tmp_path / "none.csv"), "--labeler", "ann", "--store", str(store.root)]
    )
    assert result.exit_code == 2 and result.stderr == f"error: {tmp_path / 'none.csv'}: no such file\n"


def test_pairs_come_from_a_committed_artifact_by_key_prefix_or_stage_and_key(tmp_path, store):
    import pyarrow as pa

    rows = write_pairs(tmp_path / "p.jsonl", 3)
    table = pa.Table.from_pylist([r | {"id": f"pref-{i}", "split": "pref", "task": None} for i, r in enumerate(rows)])
    store.put_table("pairs", "ab12" + "0" * 60, table, "pairs")
    store.put_table(
        "outputs",
        "ab34" + "0" * 60,
        pa.Table.from_pylist(
            [{"id": "0", "instruction": "x", "input": "", "output": "y", "generator": "g", "task": None, "score": 0.0}]
        ),
        "outputs",
    )
    for key in ("ab12", "pairs/ab"):
        assert [(p["id"], p["output_1"]) for p in load_pairs(store, key)] == [
            (f"pref-{i}", r["output_1"]) for i, r in enumerate(rows)
        ]
    with pytest.raises(ValueError, match="'ab': 2 artifacts match"):
        load_pairs(store, "ab")
    with pytest.raises(ValueError, match="holds outputs, not pairs"):
        load_pairs(store, "ab34")


def test_the_api_answers_bad_requests_with_one_line_and_serves_labelers_by_name(tmp_path, store):
    from starlette.testclient import TestClient

    from farmflow.labeling.server import make_app

    write_pairs(tmp_path / "p.jsonl", 2)
    client = TestClient(make_app(store, load_pairs(store, str(tmp_path / "p.jsonl")), "ann"))
    assert "<title>farmflow labeling</title>" in client.get("/").text
    key = client.get("/api/state").json()["pair"]["key"]
    bad = [
        ({"key": key, "label": "x"}, "label 'x': use 1, 2 or t (a tie)"),
        ({"key": "nokey", "label": "1"}, "no pair with key 'nokey' in this list"),
        ({"key": key, "label": "1", "labeler": "a b"}, "labeler name 'a b'"),
    ]
    for body, error in bad:
        answer = client.post("/api/label", json=body)
        assert answer.status_code == 400 and answer.json()["error"].startswith(error)
    assert client.post("/api/label", json={"key": key, "label": "2"}).json()["done"] == 1
    bob = client.get("/api/state", params={"labeler": "bob"}).json()
    assert (bob["labeler"], bob["done"], bob["index"]) == ("bob", 0, 0) and bob["pair"]["key"] != key
    assert client.post("/api/undo", json={"labeler": "bob"}).json()["done"] == 0  # nothing to undo: no row
    assert [r["annotator"] for r in store.read_rows("annotations", "annotations").to_pylist()] == ["human:ann"]
