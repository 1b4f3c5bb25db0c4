"""Verified artifacts: a truncated or damaged artifact or row-log chunk is found, quarantined (kept) and computed
again; `farmflow artifacts verify` lists it; `farmflow sql` leaves it out with a warning. Local folder and moto S3."""

from __future__ import annotations

import logging
from pathlib import Path

import pyarrow as pa
import pytest
from test_api_annotators import KEY, judge, make_rows, pool
from test_s3_store import pairs_table
from typer.testing import CliRunner

from farmflow.annotators import annotate
from farmflow.annotators.server import JudgeConfig, JudgeServer
from farmflow.cli import app
from farmflow.storage import COMMIT_FILE, CorruptArtifact, open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.registry import Stage
from farmflow.tasks.stage import Table, run_stage

runner = CliRunner()
MICRO = Stage(name="micro", version="1")


def micro(store_uri: str, calls: list) -> object:
    def fn(run, config):
        calls.append(run.key)
        return Table(pairs_table(50), "pairs")

    return run_stage(MICRO, fn, store_uri, {"n": 50}, {})


def damage(path: Path, truncate: bool) -> None:
    data = path.read_bytes()
    path.write_bytes(
        data[: len(data) // 2] if truncate else data[:100] + bytes(b ^ 0xFF for b in data[100:110]) + data[110:]
    )


def test_a_truncated_artifact_is_quarantined_and_computed_again_in_the_same_run(tmp_path, caplog):
    uri, calls = str(tmp_path / "store"), []
    ref = micro(uri, calls)
    data = Path(ref.uri) / "data.parquet"
    record = open_store(uri).record(ref)
    assert (
        record["files"]["data.parquet"]["size"] == data.stat().st_size
        and len(record["files"]["data.parquet"]["sha256"]) == 64
    )
    half = data.stat().st_size // 2
    damage(data, truncate=True)
    with caplog.at_level(logging.INFO):
        again = micro(uri, calls)  # the lookup sees the size mismatch: computed again, not a cache hit
    assert len(calls) == 2 and again.key == ref.key
    assert open_store(uri).read_table(again).num_rows == 50
    lines = [r.getMessage() for r in caplog.records if "is corrupt" in r.getMessage()]
    assert len(lines) == 1 and f"micro/{ref.key}" in lines[0] and "data.parquet is" in lines[0]
    kept = list((tmp_path / "store" / "_quarantine" / "micro").glob(f"{ref.key}-*/data.parquet"))
    assert len(kept) == 1 and kept[0].stat().st_size == half  # kept, not deleted
    assert micro(uri, calls).key == ref.key and len(calls) == 2  # the recomputed artifact is a hit


def test_damaged_bytes_of_the_right_size_fail_the_read_in_one_line_and_are_recomputed_next_run(tmp_path):
    uri, calls = str(tmp_path / "store"), []
    ref = micro(uri, calls)
    damage(Path(ref.uri) / "data.parquet", truncate=False)
    store = open_store(uri)
    assert store.get("micro", ref.key) == ref  # sizes match: the lookup alone cannot tell
    with pytest.raises(CorruptArtifact) as err:
        store.read_table(ref)
    message = str(err.value)
    assert "\n" not in message and f"micro/{ref.key}" in message and "sha256" in message and "_quarantine" in message
    assert store.get("micro", ref.key) is None  # quarantined: the next run computes it again
    assert micro(uri, calls).key == ref.key and len(calls) == 2


def test_a_truncated_row_chunk_does_not_block_annotation_and_its_pairs_are_asked_again(monkeypatch, tmp_path):
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    store, rows = str(tmp_path / "store"), make_rows(40, seed=3)
    srv = JudgeServer(JudgeConfig())
    with srv as url:
        cfg = pool(judge(base_url=url), chunk_size=10, max_in_flight=1)
        first, _ = annotate(rows, cfg, store)
        chunks = sorted((tmp_path / "store" / "_rows" / "annotations").glob("*.parquet"))
        assert len(chunks) == 4
        damage(chunks[1], truncate=True)
        before = srv.state.stats["items_answered"]
        table, totals = annotate(rows, cfg, store)
        assert srv.state.stats["items_answered"] - before == 10 == totals["judged"] and totals["cached"] == 30
    assert table.column("preference").to_pylist() == first.column("preference").to_pylist()
    assert (tmp_path / "store" / "_quarantine" / "_rows" / "annotations" / chunks[1].name).is_file()


def test_verify_lists_what_is_corrupt_and_repair_quarantines_it(tmp_path):
    uri = str(tmp_path / "store")
    store = open_store(uri)
    good = store.put_table("pairs", "good", pairs_table(5), "pairs")
    bad = store.put_table("pairs", "bad", pairs_table(5, tag="b"), "pairs")
    row = {"id": "a", "instruction": "i", "input": "", "output": "o", "generator": "g", "task": None, "score": 1.0}
    chunk = store.append_rows("outputs/x", pa.Table.from_pylist([row] * 20, schema=SCHEMAS["outputs"]), "outputs")
    damage(tmp_path / "store" / "_rows" / "outputs" / "x" / chunk, truncate=True)
    damage(Path(bad.uri) / "data.parquet", truncate=False)  # same size: only the hash tells

    quick = runner.invoke(app, ["artifacts", "verify", "--store", uri, "--quick"])  # sizes: the chunk only
    assert quick.exit_code == 1 and chunk in quick.stdout and "bad" not in quick.stdout
    result = runner.invoke(app, ["artifacts", "verify", "--store", uri, "--format", "json"])
    assert result.exit_code == 1 and "pairs" in result.output and "bad" in result.output and "good" not in result.stdout
    assert "sha256" in result.output and chunk in result.output and "row chunk" in result.output
    repaired = runner.invoke(app, ["artifacts", "verify", "--store", uri, "--repair"])
    assert repaired.exit_code == 0, repaired.output
    assert open_store(uri).get("pairs", "bad") is None and open_store(uri).get("pairs", "good") == good
    assert list((tmp_path / "store" / "_quarantine" / "pairs").glob("bad-*/" + COMMIT_FILE))
    assert (tmp_path / "store" / "_quarantine" / "_rows" / "outputs" / "x" / chunk).is_file()
    assert runner.invoke(app, ["artifacts", "verify", "--store", uri]).exit_code == 0


def test_sql_leaves_out_a_truncated_table_with_a_warning(tmp_path):
    uri = str(tmp_path / "store")
    store = open_store(uri)
    store.put_table("pairs", "good", pairs_table(5), "pairs")
    bad = store.put_table("pairs", "bad", pairs_table(7, tag="b"), "pairs")
    damage(Path(bad.uri) / "data.parquet", truncate=True)
    result = runner.invoke(app, ["sql", "SELECT count(*) AS n FROM pairs", "--store", uri, "--format", "csv"])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().splitlines()[-1] == "5"
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "pairs/bad" in warnings[0]


def test_on_s3_a_truncated_artifact_is_quarantined_and_verify_finds_damaged_bytes(s3_server, s3_uri):
    store = open_store(s3_uri)
    bucket = s3_uri.split("/")[2]
    client = s3_server.client()
    for key in ("cut", "flipped"):
        store.put_table("pairs", key, pairs_table(20), "pairs")
    objects = s3_server.objects(bucket)
    cut = next(k for k in objects if k.startswith("farm/pairs/cut/") and k.endswith("data.parquet"))
    client.put_object(Bucket=bucket, Key=cut, Body=objects[cut][: len(objects[cut]) // 2])
    flipped = next(k for k in objects if k.startswith("farm/pairs/flipped/") and k.endswith("data.parquet"))
    data = objects[flipped]
    client.put_object(Bucket=bucket, Key=flipped, Body=data[:100] + bytes(b ^ 0xFF for b in data[100:110]) + data[110:])

    assert store.get("pairs", "cut") is None  # the lookup: moved to _quarantine/, kept
    after = s3_server.objects(bucket)
    assert cut not in after and any(
        k.startswith("farm/_quarantine/pairs/cut-") and k.endswith("data.parquet") for k in after
    )
    assert any(k.startswith("farm/_quarantine/pairs/cut-") and k.endswith(COMMIT_FILE) for k in after)
    found = store.verify()
    assert [(f["stage"], f["key"]) for f in found] == [("pairs", "flipped")] and "sha256" in found[0]["problem"]
    store.verify(repair=True)
    assert store.get("pairs", "flipped") is None and store.verify() == []
