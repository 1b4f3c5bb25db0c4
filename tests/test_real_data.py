"""The real farm's data: AlpacaFarm/AlpacaEval files from ../shared (never copied here), splits, schema errors."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from farmflow.config import ConfigError, DataConfig, load_config, validate_config
from farmflow.data import prompts_of, split_rows
from farmflow.data.alpaca import DataError, build_real_farm, load_eval, load_hub, load_instructions, split_sizes
from farmflow.storage import open_store
from farmflow.storage.schemas import SCHEMAS

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
ALPACA, EVAL = DATA / "alpaca_en_demo.json", DATA / "alpaca_eval_davinci003_outputs.json"
needs_data = pytest.mark.skipif(not (ALPACA.is_file() and EVAL.is_file()), reason=f"shared data not found in {DATA}")


def local(**kw) -> DataConfig:
    return DataConfig(source="local", instructions_path=str(ALPACA), eval_path=str(EVAL), **kw)


def keyset(rows):
    return {(r["instruction"], r["input"]) for r in rows}


# ------------------------------------------------------------------ shared files
@needs_data
def test_load_alpaca_and_eval_files():
    rows = load_instructions(ALPACA)
    assert len(rows) == 999 and sum(bool(r["input"]) for r in rows) == 412
    ev = load_eval(EVAL)
    assert len(ev) == 805 and {r["generator"] for r in ev} == {"text_davinci_003"}
    assert Counter(r["dataset"] for r in ev).keys() == {"helpful_base", "selfinstruct", "oasst", "koala", "vicuna"}
    assert all(r["input"] == "" for r in ev) and [i for i, r in enumerate(ev) if not r["output"]] == [
        247,
        504,
    ]  # Davinci003 said nothing twice


@needs_data
def test_paper_proportions_sizes_determinism_disjointness():
    table, counts = build_real_farm(local())  # paper sizes 10k/10k/20k/2k > the file: shared 10 : 10 : 20 : 2
    assert table.schema.equals(SCHEMAS["instructions"])
    sizes = Counter(table.column("split").to_pylist())
    # 999 rows, 14 repeated -> 985 distinct; 985 * (10, 10, 20, 2) / 42 = 234.5, 234.5, 469.0, 46.9
    # -> largest remainders
    assert counts == {"duplicates_dropped": 14.0, "rows_unused": 0.0}
    assert dict(sizes) == {"eval": 805, "sft": 235, "pref": 234, "unlabeled": 469, "val": 47}
    splits = {s: split_rows(table, s) for s in ("sft", "pref", "unlabeled", "val", "eval")}
    seen = [keyset(rows) for rows in splits.values()]
    assert sum(map(len, seen)) == len(set().union(*seen)) == 985 + 805  # disjoint, nothing repeated
    assert all(r["output"] for r in splits["sft"]) and not any(
        r["output"] for r in splits["pref"] + splits["unlabeled"] + splits["val"]
    )
    assert all(r["task"] is None for r in table.to_pylist())  # no gold reward in the real farm
    assert {r["family"] for r in splits["sft"]} == {"alpaca"} and splits["eval"][0]["family"] == "helpful_base"
    again, _ = build_real_farm(local())
    assert again.equals(table)  # deterministic
    other, _ = build_real_farm(local(seed=1))
    assert keyset(split_rows(other, "sft")) != keyset(splits["sft"])  # the seed decides the assignment
    assert keyset(split_rows(other, "eval")) == keyset(splits["eval"])  # the evaluation set does not move


@needs_data
def test_configured_sizes_and_eval_size():
    table, counts = build_real_farm(local(sft_size=64, pref_size=64, unlabeled_size=0, val_size=16, eval_size=32))
    assert dict(Counter(table.column("split").to_pylist())) == {"eval": 32, "sft": 64, "pref": 64, "val": 16}
    assert counts["rows_unused"] == 985 - 144
    ev = split_rows(table, "eval")
    assert [r["instruction"] for r in ev] == [r["instruction"] for r in load_eval(EVAL)[:32]]  # the file's first rows


@pytest.mark.parametrize("total", [4, 5, 42, 43, 100, 985, 12345])
def test_split_sizes_any_total(total):
    sizes = split_sizes(total, {"sft": 10, "pref": 10, "unlabeled": 20, "val": 2})
    assert sum(sizes.values()) == total
    for k, w in {"sft": 10, "pref": 10, "unlabeled": 20, "val": 2}.items():
        assert abs(sizes[k] - total * w / 42) < 1
    assert split_sizes(42, {"sft": 10, "pref": 10, "unlabeled": 20, "val": 2}) == {
        "sft": 10,
        "pref": 10,
        "unlabeled": 20,
        "val": 2,
    }


@needs_data
def test_prompt_template_with_and_without_input():
    rows = load_instructions(ALPACA)
    with_input = next(r for r in rows if r["input"])
    without = next(r for r in rows if not r["input"])
    p1, p2 = prompts_of([with_input, without])
    assert p1 == (
        "Below is an instruction that describes a task, paired with an input that provides further context. "
        "Write a response that appropriately completes the request.\n\n"
        f"### Instruction:\n{with_input['instruction']}\n\n### Input:\n{with_input['input']}\n\n### Response:\n"
    )
    assert p2 == (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
        f"### Instruction:\n{without['instruction']}\n\n### Response:\n"
    )


# ---------------------------------------------------------------- formats, keys
ROWS = [{"instruction": f"Say {i}.", "input": "" if i % 2 else f"ctx {i}", "output": f"{i}"} for i in range(12)]
EVAL_ROWS = [{"instruction": f"Eval {i}?", "output": f"ref {i}", "generator": "ref", "dataset": "d"} for i in range(4)]


def write(path: Path, rows) -> str:
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text(json.dumps(rows))
    return str(path)


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_formats_read_the_same(tmp_path, suffix):
    assert load_instructions(write(tmp_path / f"a{suffix}", ROWS)) == ROWS
    assert load_eval(write(tmp_path / f"e{suffix}", EVAL_ROWS)) == [{**r, "input": ""} for r in EVAL_ROWS]


def test_split_files_and_edited_file_is_a_new_stage_key(tmp_path):
    from farmflow.tasks import data_task

    files = {
        s: write(tmp_path / f"{s}.jsonl", ROWS[i * 3 : i * 3 + 3])
        for i, s in enumerate(("sft", "pref", "unlabeled", "val"))
    }
    ev = write(tmp_path / "eval.json", EVAL_ROWS)
    cfg = DataConfig(source="local", split_paths=files, eval_path=ev)
    store = str(tmp_path / "store")
    ref = data_task.fn(store, cfg)
    table = open_store(store).read_table(ref)
    assert [r["instruction"] for r in split_rows(table, "pref")] == ["Say 3.", "Say 4.", "Say 5."]
    assert ref.metrics["rows_eval"] == 4 and ref.metrics["rows_sft"] == 3
    assert not any(k.endswith("_rows_unused") for k in ref.metrics)
    smaller = data_task.fn(
        store, cfg.model_copy(update={"sft_size": 2})
    )  # rows a split leaves out are counted, not lost silently
    assert smaller.metrics["rows_sft"] == 2 and smaller.metrics["sft_rows_unused"] == 1
    assert (
        data_task.fn(store, DataConfig(source="local", split_paths=files, eval_path=ev)).key == ref.key
    )  # same bytes: reused
    write(tmp_path / "eval.json", EVAL_ROWS[:3])  # edit the file
    ref2 = data_task.fn(store, cfg)  # the same config object: stage keys re-validate it, so the file is hashed again
    assert ref2.key != ref.key and ref2.metrics["rows_eval"] == 3
    assert data_task.fn(store, DataConfig(source="local", split_paths=files, eval_path=ev)).key == ref2.key


# ----------------------------------------------------------------- schema errors
@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"instruction": "a", "input": ""}], r"a\.json: row 0: missing column 'output'"),
        (
            [{"instruction": "a", "input": "", "output": "x"}, {"instruction": "b", "input": 3, "output": "y"}],
            r"a\.json: row 1: column 'input' must be str, got int",
        ),
        ([{"instruction": "a", "input": "", "output": None}], r"a\.json: row 0: column 'output' is null"),
        (
            [{"instruction": "a", "input": "", "output": "x", "preference": "1"}],
            r"row 0: column 'preference' must be int or float",
        ),
        ([], r"a\.json: the file has no rows"),
        ([["a", "b"]], r"a\.json: row 0 is a list"),
        ({"instruction": "a"}, r"a\.json: expected a JSON list of objects"),
    ],
)
def test_schema_errors_name_file_column_row(tmp_path, rows, message):
    with pytest.raises(DataError, match=message):
        load_instructions(write(tmp_path / "a.json", rows))


ROW_JSON = '{"instruction": "a", "input": "", "output": "x"}'
EVAL_JSON = '{"instruction": "q", "output": "r", "generator": "g", "dataset": "d"}'


@pytest.mark.parametrize(
    "name, content, loader, message",
    [
        ("e.json", b"", load_instructions, r"e\.json: the file has no rows"),
        ("b.jsonl", f"{ROW_JSON}\n{{oops\n".encode(), load_instructions, r"b\.jsonl: line 2 is not valid JSON"),
        (
            "cut.json",
            b'[{"instruction": "a", "input": "", "output": "unterminated',
            load_instructions,
            r"cut\.json: not valid JSON \(Unterminated string starting at; line 1, column 46\)$",
        ),
        (
            "ev.json",
            json.dumps([EVAL_ROWS[0], {"instruction": "q", "output": "r", "dataset": "d"}]).encode(),
            load_eval,
            r"row 1: missing column 'generator'",
        ),
        ("a.csv", json.dumps(ROWS).encode(), load_instructions, "unknown file type '.csv'"),
        (None, None, load_instructions, "no such file"),
        # a JSONL row error names the file's 1-based line, counting blank lines (not the row index)
        (
            "a.jsonl",
            f'{ROW_JSON}\n\n{{"instruction": "b", "input": ""}}\n'.encode(),
            load_instructions,
            r"a\.jsonl: line 3: missing column 'output'",
        ),
        (
            "e.jsonl",
            f'{EVAL_JSON}\n{{"instruction": "q2", "output": 5}}\n'.encode(),
            load_eval,
            r"e\.jsonl: line 2: column 'output' must be str",
        ),
        (
            "latin1.json",
            '[{"instruction": "caf\u00e9", "input": "", "output": "x"}]'.encode("latin-1"),
            load_instructions,
            r"latin1\.json: .*utf-8",
        ),
    ],
)
def test_file_errors_name_the_file_and_line(tmp_path, name, content, loader, message):
    path = tmp_path / (name or "missing.json")
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        loader(path)


def test_duplicate_instructions_across_splits(tmp_path):
    files = {
        "sft": write(tmp_path / "sft.json", ROWS[:3]),
        "pref": write(tmp_path / "pref.json", ROWS[3:6]),
        "unlabeled": write(tmp_path / "unlabeled.json", [ROWS[6]]),
        "val": write(tmp_path / "val.json", [ROWS[7], ROWS[1]]),
    }
    cfg = DataConfig(source="local", split_paths=files, eval_path=write(tmp_path / "eval.json", EVAL_ROWS))
    with pytest.raises(
        DataError, match=r"val\.json: row 1: column 'instruction' duplicates .*sft\.json row 1 \(splits 'sft' and 'val'"
    ):
        build_real_farm(cfg)
    files["val"] = write(tmp_path / "val.json", [ROWS[7]])
    cfg = DataConfig(
        source="local",
        split_paths=files,
        eval_path=write(tmp_path / "eval.json", EVAL_ROWS + [{**ROWS[4], "generator": "g", "dataset": "d"}]),
    )
    with pytest.raises(DataError, match=r"pref\.json: row 1: .*duplicates .*eval\.json row 4"):
        build_real_farm(cfg)


def test_config_errors():
    with pytest.raises(ConfigError, match="source 'local' needs eval_path"):
        load_config("synthetic-micro", ["data.source=local"])
    with pytest.raises(ConfigError, match="unknown split"):
        validate_config({"data": {"split_paths": {"train": "x.json"}}})
    four = {s: f"{s}.json" for s in ("sft", "pref", "unlabeled", "val")}
    cfg = load_config(
        "synthetic-micro", [f"data.split_paths={json.dumps(four)}"]
    )  # a dict field set from the command line
    assert cfg.data.split_paths == four
    # with only some splits given, the missing ones are an error (never silently empty)
    with pytest.raises(ConfigError, match=r"split_paths: no file for split\(s\) \['pref', 'unlabeled', 'val'\]"):
        load_config("synthetic-micro", ['data.split_paths={"sft": "x.json"}'])


def test_hub_without_datasets_is_one_clear_error():
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(DataError, match="needs the optional 'datasets' package"):
            load_hub(DataConfig(source="hub"))
    else:
        pytest.skip("datasets is installed; the hub route needs a network")


def test_the_other_json_readers_report_a_bad_encoding_by_file(tmp_path):
    """A file that is not UTF-8 is one error naming the file, not a bare UnicodeDecodeError."""
    from farmflow.cli.annotators import read_alpaca_eval
    from farmflow.evaluation.analysis import load_labels

    bad = tmp_path / "latin1.json"
    bad.write_bytes('[{"instruction": "caf\u00e9", "output_1": "a", "output_2": "b"}]'.encode("latin-1"))
    for reader in (load_labels, lambda p: read_alpaca_eval(Path(p))):
        with pytest.raises(ValueError, match=r"cannot read .*latin1\.json: .*utf-8") as err:
            reader(str(bad))
        assert not isinstance(err.value, UnicodeDecodeError)


@pytest.mark.parametrize("eval_inside", [False, True])
def test_alpaca_farm_repository_layout(tmp_path, eval_inside):
    """A folder laid out as the tatsu-lab/alpaca_farm dataset repository: alpaca_instructions/{sft,preference,
    unlabeled,val}.json with the hub's extra columns, and alpaca_farm_evaluation.json (at the top, or inside
    alpaca_instructions/ as some copies have it) with AlpacaFarm's evaluation columns."""
    farm = tmp_path / "alpaca_farm"
    (farm / "alpaca_instructions").mkdir(parents=True)
    for i, theirs in enumerate(("sft", "preference", "unlabeled", "val")):
        write(
            farm / "alpaca_instructions" / f"{theirs}.json",
            [r | {"datasplit": theirs} for r in ROWS[i * 3 : i * 3 + 3]],
        )
    evals = [r | {"input": "", "datasplit": "eval", "sample_mode": "temperature=0.0"} for r in EVAL_ROWS]
    write((farm / "alpaca_instructions" if eval_inside else farm) / "alpaca_farm_evaluation.json", evals)
    cfg = load_config("synthetic-micro", ["data.source=local", f"data.farm_dir={farm}", "data.eval_size=4"]).data
    assert cfg.split_paths["pref"].endswith("alpaca_instructions/preference.json") and cfg.eval_path.endswith(
        "evaluation.json"
    )
    table, _ = build_real_farm(cfg)
    assert [r["instruction"] for r in split_rows(table, "pref")] == ["Say 3.", "Say 4.", "Say 5."]
    assert [r["instruction"] for r in split_rows(table, "unlabeled")] == ["Say 6.", "Say 7.", "Say 8."]
    assert [r["output"] for r in split_rows(table, "eval")] == ["ref 0", "ref 1", "ref 2", "ref 3"]
    assert set(cfg.content_sha256) == {"eval", "split.sft", "split.pref", "split.unlabeled", "split.val"}
    (farm / "alpaca_instructions" / "val.json").unlink()
    with pytest.raises(ConfigError, match=r"farm_dir: no val.json, .jsonl or .parquet in .*alpaca_instructions"):
        load_config("synthetic-micro", ["data.source=local", f"data.farm_dir={farm}"])
    with pytest.raises(ConfigError, match="farm_dir: .*nowhere is not a folder"):
        load_config("synthetic-micro", ["data.source=local", f"data.farm_dir={tmp_path / 'nowhere'}"])
