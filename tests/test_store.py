"""LocalStore (commit protocol, schemas, atomicity under a real kill) and stage keys."""

import hashlib
import json
import subprocess
import sys
import textwrap
import threading
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pyarrow as pa
import pytest
from procs import python_env, run_and_kill_when

from farmflow.config import BestOfNConfig, ModelConfig, SFTConfig
from farmflow.storage import COMMIT_FILE, ArtifactRef, LocalStore, canonical_json, open_store, stage_key
from farmflow.storage.schemas import SCHEMAS


def pairs_table(n=3, tag="a"):
    return pa.table(
        {
            # columns in another order than the schema, plus one the schema does not have
            "task": [json.dumps({"i": i}) for i in range(n)],
            "id": [f"pref-{i:05d}" for i in range(n)],
            "split": ["pref"] * n,
            "instruction": [f"Sort {tag}{i}." for i in range(n)],
            "input": ["3, 1, 2"] * n,
            "output_1": [f"1, 2, 3 {tag}"] * n,
            "output_2": ["3, 2, 1"] * n,
            "extra": list(range(n)),
        }
    )


def staging_entries(store):
    staging = store.root / ".staging"
    return sorted(p.name for p in staging.iterdir()) if staging.exists() else []


def run_python(script: str, **extra_env: str) -> subprocess.CompletedProcess:
    env = python_env(**extra_env)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=60)


# ----------------------------------------------------------------------------- tables


def test_put_table_round_trip(tmp_path):
    store = LocalStore(tmp_path / "store")
    before = datetime.now(timezone.utc)
    ref = store.put_table(
        "pairs", "k1", pairs_table(), "pairs", config={"n": 2}, inputs={"data": "abc"}, metrics={"s": 1.5}
    )
    assert (ref.stage, ref.key, ref.kind, ref.format, ref.rows) == ("pairs", "k1", "table", "pairs", 3)
    assert ref.metrics == {"s": 1.5}
    assert ref.uri == str(tmp_path / "store" / "pairs" / "k1")
    created = datetime.fromisoformat(ref.created)
    assert created.tzinfo is not None and created.utcoffset() == timedelta(0)
    assert before - timedelta(seconds=1) <= created <= datetime.now(timezone.utc) + timedelta(seconds=1)

    table = store.read_table(ref)
    assert table.schema == SCHEMAS["pairs"]  # schema order, extra column dropped
    assert table.column_names == ["id", "split", "instruction", "input", "output_1", "output_2", "task"]
    assert table.to_pylist() == pairs_table().select(table.column_names).to_pylist()

    assert store.get("pairs", "k1") == ref
    assert store.exists(ref)
    record = store.record(ref)
    assert record["config"] == {"n": 2} and record["inputs"] == {"data": "abc"}
    assert record["ref"]["key"] == "k1"
    assert sorted(p.name for p in Path(ref.uri).iterdir()) == [COMMIT_FILE, "data.parquet"]
    assert staging_entries(store) == []


def test_extra_tables_are_validated_and_read_back(tmp_path):
    store = LocalStore(tmp_path)
    cands = pa.table(
        {"id": ["a", "a"], "sample": [0, 1], "output": ["x", "y"], "reward": ["0.5", "1.5"]}
    )  # strings are cast to the schema's float
    ref = store.put_table(
        "pairs", "k", pairs_table(), "pairs", extra_tables={"candidates.parquet": (cands, "candidates")}
    )
    back = store.read_table(ref, "candidates.parquet", "candidates")
    assert back.schema == SCHEMAS["candidates"] and back.column("reward").to_pylist() == [0.5, 1.5]
    assert store.read_table(ref).num_rows == pairs_table().num_rows
    with pytest.raises(ValueError, match=r"stage 'pairs' c.parquet table is missing column\(s\) \['reward'\]"):
        store.put_table(
            "pairs", "k2", pairs_table(), "pairs", extra_tables={"c.parquet": (cands.drop(["reward"]), "candidates")}
        )
    with pytest.raises(ValueError, match="must end in .parquet"):
        store.put_table("pairs", "k3", pairs_table(), "pairs", extra_tables={"c.csv": (cands, "candidates")})
    assert store.get("pairs", "k2") is None and store.get("pairs", "k3") is None  # nothing committed


def test_get_unknown_and_list(tmp_path):
    store = LocalStore(tmp_path)
    assert store.get("pairs", "nope") is None
    assert store.list() == []
    r1 = store.put_table("pairs", "k1", pairs_table(), "pairs")
    r2 = store.put_table(
        "instructions", "k2", pa.table({c: ["x"] for c in SCHEMAS["instructions"].names}), "instructions"
    )
    assert store.get("pairs", "k2") is None and store.get("instructions", "k1") is None
    assert store.list() == [r1, r2]  # sorted by creation time
    assert r2.rows == 1


def test_a_damaged_commit_record_is_one_clear_error_not_a_missing_artifact(tmp_path):
    """A truncated or unreadable commit record is one clear error naming it, never a bare JSONDecodeError or an artifact
    silently left out of `list`."""
    from farmflow.storage import StoreError

    store = LocalStore(tmp_path)
    ref = store.put_table("pairs", "k1", pairs_table(), "pairs")
    store.put_table("pairs", "k2", pairs_table(tag="b"), "pairs")
    record = tmp_path / "pairs" / "k1" / COMMIT_FILE
    record.write_text(record.read_text()[:40])  # truncated
    for call in (lambda: store.get("pairs", "k1"), store.list, lambda: store.read_table(ref)):
        with pytest.raises(
            StoreError, match=r"pairs/k1/_COMMIT\.json: unreadable commit record .*move that artifact folder away"
        ):
            call()
    record.unlink()
    record.mkdir()  # a record that cannot be read at all (here: a folder) is an error too, not an artifact left out
    with pytest.raises((StoreError, IsADirectoryError)):
        store.list()
    record.rmdir()
    assert [r.key for r in store.list()] == ["k2"]  # an uncommitted folder is simply not an artifact


def test_file_uri_and_open_store(tmp_path):
    store = open_store(f"file://{tmp_path}/s")
    assert store.root == tmp_path / "s" and store.root.is_dir()
    with pytest.raises(ValueError, match="only local folders"):
        open_store("gs://bucket/x")


def test_missing_column_names_it(tmp_path):
    store = LocalStore(tmp_path)
    table = pairs_table().drop_columns(["output_2"])
    with pytest.raises(ValueError, match=r"missing column\(s\) \['output_2'\]") as err:
        store.put_table("pairs", "k", table, "pairs")
    assert "'pairs'" in str(err.value)
    assert store.get("pairs", "k") is None and store.list() == []
    assert not (tmp_path / "pairs" / "k").exists()


def test_uncastable_column_names_it(tmp_path):
    store = LocalStore(tmp_path)
    cols = {f.name: ["x"] if f.type == pa.string() else [None] for f in SCHEMAS["preferences"]}
    cols |= {"preference": ["very much"], "noised": [False], "swapped": [True], "gold_1": [1.0], "gold_2": [0.0]}
    with pytest.raises(ValueError, match=r"column 'preference' cannot be read as double"):
        store.put_table("annotate", "k", pa.table(cols), "preferences")
    assert store.get("annotate", "k") is None
    # castable values are cast to the schema's types
    ref = store.put_table("annotate", "k", pa.table(cols | {"preference": ["2"], "gold_1": [1]}), "preferences")
    row = store.read_table(ref).to_pylist()[0]
    assert row["preference"] == 2.0 and isinstance(row["preference"], float) and row["gold_1"] == 1.0


def test_unknown_format(tmp_path):
    with pytest.raises(ValueError, match="unknown table kind 'pears'"):
        LocalStore(tmp_path).put_table("pairs", "k", pairs_table(), "pears")


def test_two_writers_same_key(tmp_path):
    store = LocalStore(tmp_path)
    first = store.put_table("pairs", "k", pairs_table(tag="first"), "pairs")
    assert first.rows == 3
    second = store.put_table("pairs", "k", pairs_table(n=5, tag="second"), "pairs")  # no exception
    committed = store.get("pairs", "k")
    assert committed is not None and second == committed
    assert store.list() == [committed]
    content = store.read_table(committed).to_pylist()
    expected = {
        "first": pairs_table(tag="first").select(SCHEMAS["pairs"].names).to_pylist(),
        "second": pairs_table(n=5, tag="second").select(SCHEMAS["pairs"].names).to_pylist(),
    }
    assert content in expected.values()
    assert committed.rows == len(content)
    assert staging_entries(store) == []


def test_concurrent_writers_same_key(tmp_path):
    store = LocalStore(tmp_path)
    errors, refs = [], []

    def write(tag):
        try:
            refs.append(LocalStore(tmp_path).put_table("pairs", "race", pairs_table(n=50, tag=tag), "pairs"))
        except Exception as e:  # noqa: BLE001 - collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(f"w{i}",)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    committed = store.get("pairs", "race")
    assert all(r == committed for r in refs) and len(refs) == 6
    rows = store.read_table(committed).to_pylist()
    tags = {r["output_1"] for r in rows}
    assert len(rows) == 50 and len(tags) == 1  # one writer's complete table, never a mix
    assert store.list() == [committed]
    assert staging_entries(store) == []


# ----------------------------------------------------------------------------- models


@pytest.fixture(scope="module")
def tiny_model():
    from farmflow.models import build_policy, train_tokenizer

    tok = train_tokenizer([f"What is {i} + {i + 1}? The answer is {2 * i + 1}." for i in range(200)], vocab_size=300)
    cfg = ModelConfig(hidden_size=16, num_layers=1, num_heads=2, intermediate_size=16, vocab_size=300, max_seq_len=32)
    return build_policy(cfg, tok), tok


def test_put_model_commits_safetensors(tmp_path, tiny_model):
    import torch

    from farmflow.models import load_policy, save

    model, tok = tiny_model
    store = LocalStore(tmp_path)
    with store.put_model("sft", "m1", "policy", config=SFTConfig(), inputs={"data": "d"}) as (folder, metrics):
        save(model, tok, folder)
        metrics["loss"] = 1.25
        assert store.get("sft", "m1") is None  # not visible before the block ends
    ref = store.get("sft", "m1")
    assert ref is not None
    assert (ref.kind, ref.format, ref.rows, ref.metrics) == ("model", "policy", None, {"loss": 1.25})
    folder = store.model_dir(ref)
    assert folder == tmp_path / "sft" / "m1" / "model"
    assert list(folder.glob("*.safetensors"))
    loaded, loaded_tok = load_policy(folder)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), loaded.state_dict().values()))
    assert loaded_tok.get_vocab() == tok.get_vocab()
    assert store.record(ref)["config"] == json.loads(canonical_json(SFTConfig()))
    assert store.list() == [ref]
    with pytest.raises(ValueError, match="not a table"):
        store.read_table(ref)
    table_ref = store.put_table("pairs", "t", pairs_table(), "pairs")
    with pytest.raises(ValueError, match="not a model"):
        store.model_dir(table_ref)
    assert staging_entries(store) == []


def test_put_model_block_that_raises_leaves_nothing(tmp_path, tiny_model):
    from farmflow.models import save

    model, tok = tiny_model
    store = LocalStore(tmp_path)
    with pytest.raises(RuntimeError, match="training diverged"):
        with store.put_model("sft", "m1", "policy") as (folder, metrics):
            save(model, tok, folder)
            raise RuntimeError("training diverged")
    assert store.get("sft", "m1") is None
    assert not (tmp_path / "sft" / "m1").exists()
    assert store.list() == []
    assert staging_entries(store) == []


def test_put_model_without_safetensors_is_refused(tmp_path):
    store = LocalStore(tmp_path)
    with pytest.raises(ValueError, match="saved no safetensors"):
        with store.put_model("sft", "m1", "policy") as (folder, metrics):
            (folder / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert store.get("sft", "m1") is None
    assert not (tmp_path / "sft" / "m1").exists()
    assert staging_entries(store) == []


def test_read_of_uncommitted_ref_raises(tmp_path):
    store = LocalStore(tmp_path)
    ref = ArtifactRef(uri="", stage="pairs", key="ghost", kind="table", format="pairs", created="now")
    assert not store.exists(ref)
    with pytest.raises(FileNotFoundError, match="pairs/ghost is not committed"):
        store.read_table(ref)


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from farmflow.storage import LocalStore
    root, ready = sys.argv[1], Path(sys.argv[2])
    store = LocalStore(root)
    with store.put_model("sft", "killme", "policy") as (folder, metrics):
        with open(folder / "model.safetensors", "wb") as f:
            for _ in range(32):
                f.write(b"\\1" * (1 << 20))  # 32 MiB
        ready.touch()
        time.sleep(120)
""")


def kill_writer_when_ready(script: str, root, ready) -> None:
    """Run `script` (argv: store root, ready file) in a real process; SIGKILL it once it signals."""
    run_and_kill_when([script, str(root), str(ready)], ready.exists, "the writer's readiness signal", timeout=60)


def test_put_model_is_atomic_under_sigkill(tmp_path, tiny_model):
    from farmflow.models import load_policy, save

    root = tmp_path / "store"
    kill_writer_when_ready(KILL_SCRIPT, root, tmp_path / "ready")

    store = LocalStore(root)
    assert store.get("sft", "killme") is None
    assert not (root / "sft" / "killme").exists()
    assert store.list() == []
    # the killed writer left its staging folder (with the big file) behind, which nobody reads
    [leftover] = staging_entries(store)
    assert leftover.startswith("sft-killme-")
    assert (root / ".staging" / leftover / "model" / "model.safetensors").stat().st_size == 32 << 20

    model, tok = tiny_model
    with store.put_model("sft", "killme", "policy") as (folder, metrics):
        save(model, tok, folder)
    ref = store.get("sft", "killme")
    assert ref is not None and store.list() == [ref]
    loaded, _ = load_policy(store.model_dir(ref))
    assert loaded.config.hidden_size == 16


COMMIT_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    import pyarrow as pa
    from farmflow.storage import LocalStore
    from farmflow.storage.schemas import SCHEMAS
    root, ready = sys.argv[1], Path(sys.argv[2])

    def stalled_rename(src, dst):  # the process dies after fsyncing the record, before the rename
        ready.touch()
        time.sleep(120)

    os.rename = stalled_rename
    LocalStore(root).put_table("pairs", "k", pa.table({c: ["x"] for c in SCHEMAS["pairs"].names}), "pairs")
""")


def test_kill_between_commit_record_and_rename_lists_nothing(tmp_path):
    root = tmp_path / "store"
    kill_writer_when_ready(COMMIT_KILL_SCRIPT, root, tmp_path / "ready")
    store = LocalStore(root)
    assert store.get("pairs", "k") is None
    assert store.list() == []


# ----------------------------------------------------------------------------- stage keys

KEY_ARGS_SCRIPT = (
    "from farmflow.config import BestOfNConfig\n"
    "from farmflow.storage import stage_key\n"
    "print(stage_key('best_of_n', '1', BestOfNConfig(n=8, temperature=0.7), {'policy': 'aaa', 'reward': 'bbb'}))\n"
)
# Computed once; a change means every cached artifact anywhere is silently invalidated.
EXPECTED_KEY = "f71e882eb6a86febcf2e3ff1a5c7b5d1"
# The documented scheme: sha256 over sorted, compact canonical JSON, first 32 hex digits.
EXPECTED_PAYLOAD = (
    '{"config":{"n":8,"seed":0,"temperature":0.7,"top_p":1.0},'
    '"inputs":{"policy":"aaa","reward":"bbb"},"stage":"best_of_n","version":"1"}'
)


def reference_key():
    return stage_key("best_of_n", "1", BestOfNConfig(n=8, temperature=0.7), {"policy": "aaa", "reward": "bbb"})


def test_stage_key_is_pinned():
    key = reference_key()
    assert len(key) == 32 and all(c in "0123456789abcdef" for c in key)
    assert key == EXPECTED_KEY
    assert hashlib.sha256(EXPECTED_PAYLOAD.encode()).hexdigest()[:32] == EXPECTED_KEY


def test_stage_key_same_in_another_process():
    for hashseed in ("0", "12345"):
        out = run_python(KEY_ARGS_SCRIPT, PYTHONHASHSEED=hashseed)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == reference_key()


def test_stage_key_ignores_dict_order():
    a = {"lr": 0.1, "nested": {"x": 1, "y": [1, 2]}, "batch": 4}
    b = {"batch": 4, "nested": {"y": [1, 2], "x": 1}, "lr": 0.1}
    assert list(a) != list(b)
    assert stage_key("s", "1", a, {"i": "k", "j": "l"}) == stage_key("s", "1", b, {"j": "l", "i": "k"})
    # a pydantic config and its dump give the same key
    assert stage_key("s", "1", BestOfNConfig(n=3)) == stage_key("s", "1", BestOfNConfig(n=3).model_dump())


def test_stage_key_sensitivity():
    base = dict(stage="best_of_n", version="1", config=BestOfNConfig(), inputs={"policy": "aaa", "reward": "bbb"})
    key = stage_key(**base)
    variants = [
        base | {"stage": "best_of_m"},
        base | {"version": "2"},
        base | {"config": BestOfNConfig(n=8)},
        base | {"config": BestOfNConfig(temperature=0.9)},
        base | {"config": BestOfNConfig(top_p=0.95)},
        base | {"config": BestOfNConfig(seed=1)},
        base | {"inputs": {"policy": "aab", "reward": "bbb"}},
        base | {"inputs": {"policy": "aaa", "reward": "bbc"}},
        base | {"inputs": {"policy": "aaa"}},
        base | {"inputs": {"policy2": "aaa", "reward": "bbb"}},
        base | {"inputs": None},
    ]
    keys = [stage_key(**v) for v in variants]
    assert key not in keys
    assert len(set(keys)) == len(keys)
    # every field of the config matters
    for field in BestOfNConfig.model_fields:
        changed = BestOfNConfig(**{field: getattr(BestOfNConfig(), field) + 1 if field != "top_p" else 0.5})
        assert stage_key(**base | {"config": changed}) != key, field


def test_stage_key_version_int_or_str():
    assert stage_key("s", 1, {"a": 1}) == stage_key("s", "1", {"a": 1})


def test_stage_key_accepts_refs_or_keys(tmp_path):
    store = LocalStore(tmp_path)
    ref = store.put_table("pairs", "deadbeef", pairs_table(), "pairs")
    other = ArtifactRef(uri="/elsewhere", stage="x", key="cafe", kind="model", format="policy", created="t")
    as_refs = stage_key("annotate", "1", {"seed": 0}, {"pairs": ref, "model": other})
    as_keys = stage_key("annotate", "1", {"seed": 0}, {"pairs": "deadbeef", "model": "cafe"})
    mixed = stage_key("annotate", "1", {"seed": 0}, {"pairs": ref, "model": "cafe"})
    assert as_refs == as_keys == mixed
    # only the key of a ref counts, not where it lives or when it was made
    moved = ref.model_copy(update={"uri": "/other", "created": "later", "metrics": {"x": 1.0}})
    assert stage_key("annotate", "1", {"seed": 0}, {"pairs": moved, "model": other}) == as_refs


def test_row_log_appends_chunks_and_reads_them_back_in_order(tmp_path):
    import pyarrow as pa

    from farmflow.storage import LocalStore
    from farmflow.storage.schemas import SCHEMAS

    store = LocalStore(tmp_path)
    assert store.read_rows("annotations/x", "outputs").num_rows == 0
    row = {"id": "a", "instruction": "i", "input": "", "output": "o", "generator": "g", "task": None, "score": 1.0}
    for i in range(3):
        store.append_rows(
            "annotations/x",
            pa.Table.from_pylist([{**row, "id": str(i)}] * (i + 1), schema=SCHEMAS["outputs"]),
            "outputs",
        )
    (tmp_path / "_rows" / "annotations" / "x" / ".half-written.parquet.tmp").write_bytes(b"PAR1 garbage")
    table = store.read_rows("annotations/x", "outputs")
    assert table.column("id").to_pylist() == ["0", "1", "1", "2", "2", "2"]
    with pytest.raises(ValueError, match="missing column"):
        store.append_rows("annotations/x", pa.table({"id": ["z"]}), "outputs")
    with pytest.raises(ValueError, match="namespace"):
        store.read_rows("../escape", "outputs")


def test_local_checkpoint_saved_again_replaces_the_old_one_without_a_half_deleted_window(tmp_path):
    store = LocalStore(tmp_path / "store")
    for content in ("first", "second"):
        folder = tmp_path / content
        folder.mkdir()
        (folder / "state.json").write_text(json.dumps({"v": content}))
        store.save_checkpoint("sft", "k", 10, folder)
    step, local = store.latest_checkpoint("sft", "k")
    assert step == 10 and json.loads((local / "state.json").read_text()) == {"v": "second"}
    assert [p.name for p in local.parent.iterdir()] == ["step-000000010"]  # no temporary or old copies left
