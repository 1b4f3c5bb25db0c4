"""The S3 store against a real S3 server (moto on 127.0.0.1): commits, races, models, errors, flows."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
import pytest
from prefect_server import migrated_home
from procs import python_env, run_and_kill_when

from farmflow.loopback import free_port
from farmflow.storage import COMMIT_FILE, ArtifactRef, StoreError, open_store
from farmflow.storage.s3 import S3Store
from farmflow.storage.schemas import SCHEMAS


def pairs_table(n=3, tag="a"):
    return pa.table(
        {
            "id": [f"pref-{i:05d}" for i in range(n)],
            "split": ["pref"] * n,
            "instruction": [f"Sort {tag}{i}." for i in range(n)],
            "input": ["3, 1, 2"] * n,
            "output_1": [f"1, 2, 3 {tag}"] * n,
            "output_2": ["3, 2, 1"] * n,
            "task": [None] * n,
        }
    )


def bucket_of(uri: str) -> str:
    return urlsplit(uri).netloc


def keys_under(s3_server, uri: str, prefix: str) -> list[str]:
    return sorted(k for k in s3_server.objects(bucket_of(uri)) if k.startswith(prefix))


def with_cache(uri: str, cache: Path) -> str:
    return uri.split("&cache_dir=")[0] + f"&cache_dir={cache}"


# ----------------------------------------------------------------------------- tables


def test_s3_table_round_trip_and_layout(s3_server, s3_uri):
    store = open_store(s3_uri)
    assert isinstance(store, S3Store) and store.root == f"s3://{bucket_of(s3_uri)}/farm"
    assert store.get("pairs", "k1") is None and store.list() == []
    ref = store.put_table(
        "pairs",
        "k1",
        pairs_table(),
        "pairs",
        config={"n": 2},
        inputs={"data": "abc"},
        metrics={"s": 1.5},
        extra_files={"note.md": b"# hi"},
    )
    assert (ref.stage, ref.key, ref.kind, ref.format, ref.rows, ref.metrics) == (
        "pairs",
        "k1",
        "table",
        "pairs",
        3,
        {"s": 1.5},
    )
    assert store.get("pairs", "k1") == ref and store.exists(ref) and store.list() == [ref]
    assert store.read_table(ref).to_pylist() == pairs_table().to_pylist()
    assert store.read_file(ref, "note.md") == b"# hi"
    record = store.record(ref)
    assert record["config"] == {"n": 2} and record["inputs"] == {"data": "abc"}

    # one commit record at <stage>/<key>/, the data in the attempt folder it names
    keys = keys_under(s3_server, s3_uri, "farm/pairs/k1/")
    attempt = record["data"]
    assert keys == sorted(
        [f"farm/pairs/k1/{COMMIT_FILE}", f"farm/pairs/k1/{attempt}/data.parquet", f"farm/pairs/k1/{attempt}/note.md"]
    )
    assert ref.uri == f"s3://{bucket_of(s3_uri)}/farm/pairs/k1/{attempt}"
    assert store.files(ref) == {"data.parquet": pytest.approx(store.files(ref)["data.parquet"]), "note.md": 4}

    # a second store object (another process would do the same) sees the same artifact
    assert open_store(s3_uri).get("pairs", "k1") == ref


def test_s3_refuses_bad_tables_and_writes_nothing(s3_server, s3_uri):
    store = open_store(s3_uri)
    with pytest.raises(ValueError, match=r"missing column\(s\) \['output_2'\]"):
        store.put_table("pairs", "k", pairs_table().drop_columns(["output_2"]), "pairs")
    with pytest.raises(ValueError, match="invalid extra file name"):
        store.put_table("pairs", "k", pairs_table(), "pairs", extra_files={"../x": b""})
    assert store.get("pairs", "k") is None and keys_under(s3_server, s3_uri, "farm/") == []


def test_uncommitted_ref_and_deleted_artifact(s3_server, s3_uri):
    store = open_store(s3_uri)
    ghost = ArtifactRef(uri="", stage="pairs", key="ghost", kind="table", format="pairs", created="now")
    assert not store.exists(ghost)
    with pytest.raises(FileNotFoundError, match="pairs/ghost is not committed"):
        store.read_table(ghost)
    ref = store.put_table("pairs", "k", pairs_table(), "pairs")
    store.fs.rm(f"{store.base}/pairs/k", recursive=True)
    assert not store.exists(ref) and store.get("pairs", "k") is None and store.list() == []
    again = store.put_table("pairs", "k", pairs_table(n=2), "pairs")  # recomputed under the same key
    assert again.rows == 2 and store.read_table(again).num_rows == 2


# ----------------------------------------------------------------------------- concurrency

RACE_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import pyarrow as pa
    from farmflow.storage import open_store
    uri, tag, go = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    store = open_store(uri)
    n = 20000
    table = pa.table({"id": [f"{tag}-{i}" for i in range(n)], "split": ["pref"] * n, "instruction": [tag] * n,
                      "input": [""] * n, "output_1": [tag] * n, "output_2": [tag] * n, "task": [None] * n})
    while not go.exists():
        time.sleep(0.005)
    ref = store.put_table("pairs", "race", table, "pairs", metrics={"writer": float(tag[-1])})
    print(ref.model_dump_json())
""")


def test_two_processes_racing_on_one_key_end_with_one_valid_artifact(s3_server, s3_uri, tmp_path):
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACE_SCRIPT, s3_uri, f"w{i}", str(go)],
            env=python_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in (1, 2)
    ]
    time.sleep(1.0)
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [o[1][-2000:] for o in outs]
    refs = [ArtifactRef.model_validate_json(o[0].strip().splitlines()[-1]) for o in outs]

    store = open_store(s3_uri)
    committed = store.get("pairs", "race")
    assert committed is not None and refs == [committed, committed]  # both writers return the winner's ref
    rows = store.read_table(committed).to_pylist()
    writer = f"w{int(committed.metrics['writer'])}"
    assert len(rows) == 20000 and {r["instruction"] for r in rows} == {writer}  # one writer's complete table
    # the loser deleted its attempt: one commit record and one data object remain
    record = store.record(committed)
    assert keys_under(s3_server, s3_uri, "farm/pairs/race/") == sorted(
        [f"farm/pairs/race/{COMMIT_FILE}", f"farm/pairs/race/{record['data']}/data.parquet"]
    )


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from farmflow.storage import open_store
    uri, ready = sys.argv[1], Path(sys.argv[2])
    store = open_store(uri)
    store._finish = lambda *a, **k: (ready.touch(), time.sleep(120))  # dies after uploading, before its commit
    with store.put_model("sft", "killme", "policy") as (folder, metrics):
        (folder / "model.safetensors").write_bytes(b"\\1" * (4 << 20))
""")


@pytest.mark.parametrize("code, status", [("ConditionalRequestConflict", 409), ("PreconditionFailed", 412)])
def test_a_lost_commit_race_in_any_phrasing_returns_the_winner(s3_server, s3_uri, monkeypatch, code, status):
    """Every answer to a refused conditional PUT counts as a lost race, not only the one s3fs maps to FileExistsError:
    AWS also answers with 409 ConditionalRequestConflict (and 412 without the Condition field)."""
    from botocore.exceptions import ClientError

    winner = open_store(s3_uri).put_table("pairs", f"race-{status}", pairs_table(tag="w"), "pairs")
    loser = open_store(s3_uri)
    real_pipe = loser.fs.pipe_file

    def conditional_put(path, data, mode="overwrite", **kw):
        if mode == "create" and path.endswith(COMMIT_FILE):  # what such a server answers: the object exists
            raise OSError(f"conditional PUT refused ({status})") from ClientError(
                {
                    "Error": {"Code": code, "Message": "At least one of the pre-conditions you specified did not hold"},
                    "ResponseMetadata": {"HTTPStatusCode": status},
                },
                "PutObject",
            )
        return real_pipe(path, data, mode=mode, **kw)

    monkeypatch.setattr(loser.fs, "pipe_file", conditional_put)
    assert loser.put_table("pairs", f"race-{status}", pairs_table(tag="l"), "pairs") == winner
    assert all(r["instruction"].startswith("Sort w") for r in loser.read_table(winner).to_pylist())  # the winner's rows


def test_writer_killed_before_its_commit_leaves_nothing_visible(s3_server, s3_uri, tmp_path):
    ready = tmp_path / "ready"
    run_and_kill_when([KILL_SCRIPT, s3_uri, str(ready)], ready.exists, "the upload before the commit", timeout=60)
    store = open_store(s3_uri)
    [weights] = [k for k in keys_under(s3_server, s3_uri, "farm/sft/killme/")]  # uploaded, never committed
    assert weights.endswith("/model/model.safetensors")
    assert store.get("sft", "killme") is None and store.list() == []
    with store.put_model("sft", "killme", "policy") as (folder, metrics):
        (folder / "model.safetensors").write_bytes(b"\2" * 16)
    ref = store.get("sft", "killme")
    assert ref is not None and store.list() == [ref]
    assert (store.model_dir(ref) / "model.safetensors").read_bytes() == b"\2" * 16


# ----------------------------------------------------------------------------- models


def test_model_upload_and_download_once_per_artifact(s3_server, s3_uri, tmp_path):
    store = open_store(s3_uri)
    with store.put_model("sft", "m1", "policy", config={"lr": 1}) as (folder, metrics):
        (folder / "model.safetensors").write_bytes(b"w" * 1000)
        (folder / "config.json").write_text('{"hidden": 4}')
        (folder / "tok").mkdir()
        (folder / "tok" / "vocab.json").write_text("{}")
        metrics["loss"] = 0.5
        assert store.get("sft", "m1") is None  # not visible before the block ends
    ref = store.get("sft", "m1")
    assert ref.kind == "model" and ref.metrics == {"loss": 0.5}
    assert set(store.files(ref)) == {"model/model.safetensors", "model/config.json", "model/tok/vocab.json"}

    # a worker with an empty cache downloads it once, into a folder keyed by the artifact
    worker = open_store(with_cache(s3_uri, tmp_path / "worker-cache"))
    local = worker.model_dir(ref)
    assert local.is_relative_to(tmp_path / "worker-cache") and ref.key in str(local)
    assert (local / "model.safetensors").read_bytes() == b"w" * 1000 and (
        local / "tok" / "vocab.json"
    ).read_text() == "{}"
    # fetched once: with the remote weights gone, the cached copy still serves
    s3_server.client().delete_object(
        Bucket=bucket_of(s3_uri), Key=f"farm/sft/m1/{store.record(ref)['data']}/model/model.safetensors"
    )
    assert open_store(with_cache(s3_uri, tmp_path / "worker-cache")).model_dir(ref) == local
    assert (local / "model.safetensors").read_bytes() == b"w" * 1000
    # the writer kept its upload as its cached copy (no download at all)
    assert store.model_dir(ref).is_relative_to(tmp_path / "cache")

    with pytest.raises(ValueError, match="saved no safetensors"):
        with store.put_model("sft", "m2", "policy") as (folder, metrics):
            (folder / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert store.get("sft", "m2") is None and keys_under(s3_server, s3_uri, "farm/sft/m2/") == []


def test_s3_checkpoints_keep_latest_and_download(s3_server, s3_uri, tmp_path):
    store = open_store(s3_uri)
    assert store.latest_checkpoint("sft", "k") is None
    for step in (10, 20, 30):
        folder = tmp_path / f"c{step}"
        folder.mkdir()
        (folder / "state.json").write_text(json.dumps({"step": step}))
        store.save_checkpoint("sft", "k", step, folder)
    remote = keys_under(s3_server, s3_uri, "farm/_checkpoints/sft/k/")
    assert sorted({k.split("/")[4] for k in remote}) == ["step-000000020", "step-000000030"]  # the newest two
    worker = open_store(with_cache(s3_uri, tmp_path / "worker"))
    step, local = worker.latest_checkpoint("sft", "k")
    assert (
        step == 30
        and json.loads((local / "state.json").read_text()) == {"step": 30}
        and local.is_relative_to(tmp_path / "worker")
    )
    assert sorted(p.name for p in local.iterdir()) == ["state.json"]
    # a checkpoint of a step saved again is downloaded again, never served stale
    (tmp_path / "c30" / "state.json").write_text(json.dumps({"step": 30, "again": True}))
    store.save_checkpoint("sft", "k", 30, tmp_path / "c30")
    assert json.loads((worker.latest_checkpoint("sft", "k")[1] / "state.json").read_text()) == {
        "step": 30,
        "again": True,
    }
    # a re-save whose old files cannot be removed stops with an error, so the two checkpoints' files never mix
    (tmp_path / "c30" / "other.json").write_text("{}")
    real_rm = store.fs.rm
    store.fs.rm = lambda *a, **k: (_ for _ in ()).throw(PermissionError("AccessDenied"))
    with pytest.raises(StoreError, match="access denied"):
        store.save_checkpoint("sft", "k", 30, tmp_path / "c30")
    store.fs.rm = real_rm
    assert "other.json" not in {
        k.rsplit("/", 1)[1] for k in keys_under(s3_server, s3_uri, "farm/_checkpoints/sft/k/step-000000030/")
    }
    worker.clear_checkpoints("sft", "k")
    assert store.latest_checkpoint("sft", "k") is None and keys_under(s3_server, s3_uri, "farm/_checkpoints/") == []
    assert not local.exists()


def test_s3_row_log(s3_server, s3_uri):
    store = open_store(s3_uri)
    assert store.read_rows("annotations/x", "outputs").num_rows == 0
    row = {"id": "a", "instruction": "i", "input": "", "output": "o", "generator": "g", "task": None, "score": 1.0}
    for i in range(3):
        store.append_rows(
            "annotations/x",
            pa.Table.from_pylist([{**row, "id": str(i)}] * (i + 1), schema=SCHEMAS["outputs"]),
            "outputs",
        )
    assert store.read_rows("annotations/x", "outputs").column("id").to_pylist() == ["0", "1", "1", "2", "2", "2"]
    assert len(keys_under(s3_server, s3_uri, "farm/_rows/annotations/x/")) == 3
    with pytest.raises(ValueError, match="namespace"):
        store.read_rows("../escape", "outputs")


# ----------------------------------------------------------------------------- errors


def assert_one_clear_error(err: pytest.ExceptionInfo, *must: str, secret: str = "farmflow-test-secret") -> str:
    message = str(err.value)
    assert isinstance(err.value, StoreError)
    assert "\n" not in message and err.value.__cause__ is None and err.value.__suppress_context__  # no botocore wall
    for text in must:
        assert text in message, (text, message)
    assert secret not in message and secret not in repr(err.value)
    return message


def test_unreachable_endpoint_is_one_clear_error(s3_server):
    endpoint = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(StoreError) as err:
        open_store(f"s3://farm/x?endpoint_url={endpoint}&max_attempts=2")
    assert_one_clear_error(err, endpoint, "'farm'", "cannot connect")
    assert time.monotonic() - start < 30


def test_a_connection_dropped_by_the_http_client_counts_as_cannot_connect():
    """botocore's HTTPClientError (a refused or reset connection) counts as cannot-connect, not as a failed request."""
    from botocore.exceptions import ClientError, HTTPClientError

    from farmflow.storage.s3 import is_connection_error

    assert is_connection_error(HTTPClientError(error=ConnectionRefusedError(111, "Connection refused")))
    assert not is_connection_error(ClientError({"Error": {"Code": "AccessDenied"}}, "ListObjectsV2"))


def test_missing_bucket_is_one_clear_error(s3_server):
    with pytest.raises(StoreError) as err:
        open_store(f"s3://no-such-bucket/x?endpoint_url={s3_server.endpoint}")
    assert_one_clear_error(err, s3_server.endpoint, "bucket 'no-such-bucket' does not exist")


def test_bad_options_are_named(s3_server):
    with pytest.raises(StoreError, match=r"unknown option\(s\) \['colour'\]"):
        open_store(f"s3://farm/x?endpoint_url={s3_server.endpoint}&colour=red")
    with pytest.raises(StoreError, match=r"must not carry credentials \(query parameter secret\)") as err:
        open_store(f"s3://farm/x?endpoint_url={s3_server.endpoint}&secret=hunter2")
    assert "hunter2" not in str(err.value)
    with pytest.raises(StoreError, match="max_attempts must be a positive integer"):
        open_store(f"s3://farm/x?endpoint_url={s3_server.endpoint}&max_attempts=0")


def test_bad_credentials_are_one_clear_error_and_a_profile_or_credentials_block_works(
    s3_server, monkeypatch, prefect_harness, tmp_path
):
    from prefect.blocks.system import Secret

    bucket = s3_server.bucket()
    uri = f"s3://{bucket}/farm?endpoint_url={s3_server.endpoint}"
    with s3_server.authentication() as (key_id, secret):
        # the environment holds someone else's key: refused, one line, no secret in it
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", key_id)
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "WRONG-secret-c0ffee")
        with pytest.raises(StoreError) as err:
            open_store(uri)
        assert_one_clear_error(
            err, s3_server.endpoint, f"bucket {bucket!r}", "access denied", secret="WRONG-secret-c0ffee"
        )
        assert secret not in str(err.value)
        # an unknown key id
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
        with pytest.raises(StoreError) as err:
            open_store(uri)
        assert_one_clear_error(err, "access denied", "InvalidAccessKeyId", secret="WRONG-secret-c0ffee")
        # the right credentials from a named profile
        profiles = tmp_path / "credentials"
        profiles.write_text(f"[farm]\naws_access_key_id = {key_id}\naws_secret_access_key = {secret}\n")
        monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(profiles))
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        assert open_store(uri + "&profile=farm").put_table("pairs", "p", pairs_table(), "pairs").rows == 3
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIANOSUCHKEY0000000")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "WRONG-secret-c0ffee")
        # the right credentials from a Prefect Secret block win over the environment
        Secret(value={"aws_access_key_id": key_id, "aws_secret_access_key": secret}).save(
            "farm-s3-creds", overwrite=True
        )
        store = open_store(uri + "&credentials_block=farm-s3-creds")
        ref = store.put_table("pairs", "k", pairs_table(), "pairs")
        assert store.read_table(ref).num_rows == 3
        assert secret not in repr(store) and secret not in json.dumps(store.record(ref))
    with pytest.raises(StoreError, match="Secret block 'no-such-block'"):
        open_store(uri + "&credentials_block=no-such-block")


def test_missing_credentials_are_named(s3_server, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    with pytest.raises(StoreError) as err:
        open_store(f"s3://farm/x?endpoint_url={s3_server.endpoint}")
    assert_one_clear_error(err, "no credentials found")
    with pytest.raises(StoreError) as err:
        open_store(f"s3://farm/x?endpoint_url={s3_server.endpoint}&profile=nope")
    assert_one_clear_error(err, "profile 'nope' not found")


def test_cli_reports_store_errors_in_one_line(s3_server):
    from typer.testing import CliRunner

    from farmflow.cli import app

    result = CliRunner().invoke(
        app, ["artifacts", "ls", "--store", f"s3://no-such-bucket/x?endpoint_url={s3_server.endpoint}"]
    )
    assert result.exit_code == 2
    assert (
        "does not exist" in result.output
        and "Traceback" not in result.output
        and len(result.output.strip().splitlines()) == 1
    )


def test_transient_errors_are_retried_then_reported_once(s3_server):
    from s3_server import FlakyProxy

    bucket = s3_server.bucket()
    proxy = FlakyProxy(s3_server.endpoint, failures=2)
    try:
        store = open_store(f"s3://{bucket}/farm?endpoint_url={proxy.endpoint}&max_attempts=3")  # 2 x 503, then through
        assert proxy.failed == 2 and proxy.forwarded >= 1
        ref = store.put_table("pairs", "k", pairs_table(), "pairs")
        assert store.read_table(ref).num_rows == 3
        proxy.failures += 1  # one more 503, but only one attempt allowed now
        with pytest.raises(StoreError) as err:
            open_store(f"s3://{bucket}/farm?endpoint_url={proxy.endpoint}&max_attempts=1")
        assert_one_clear_error(err, proxy.endpoint, f"bucket {bucket!r}", "SlowDown")
    finally:
        proxy.stop()


# ----------------------------------------------------------------------------- config


def test_store_config_folds_s3_fields_into_the_location(s3_server):
    from farmflow.config import ConfigError, StoreConfig, load_config

    cfg = StoreConfig(uri="s3://b/p?region=eu-west-1", endpoint_url=s3_server.endpoint, max_attempts=3)
    bucket, prefix, options = __import__("farmflow.storage.s3", fromlist=["x"]).parse_s3_uri(cfg.location)
    assert (bucket, prefix) == ("b", "p") and options == {
        "region": "eu-west-1",
        "endpoint_url": s3_server.endpoint,
        "max_attempts": "3",
    }
    assert StoreConfig(uri="/tmp/x").location == "/tmp/x"
    with pytest.raises(ConfigError, match="endpoint_url only apply to an s3:// store"):
        load_config("synthetic-micro", ["store.uri=/tmp/x", "store.endpoint_url=http://x"])


# ----------------------------------------------------------------------------- flows

FAKE_SECRET = "FARMFLOW-FAKE-SECRET-9d1c2b7e5a"
FRESH_MACHINE = textwrap.dedent("""
    import json, sys
    from farmflow import tasks
    from farmflow.config import load_config
    from farmflow.flows import best_of_n_flow
    from prefect.client.orchestration import get_client
    summary = best_of_n_flow(advanced=load_config("synthetic-micro", sys.argv[1:]))
    with get_client(sync_client=True) as client:  # what Prefect itself did with each task
        states = sorted({(t.name, t.state.name) for t in client.read_task_runs()})
    print(json.dumps({"executed": dict(tasks.EXECUTED), "cached": [s["cached"] for s in summary["stages"]],
                      "leaderboard": summary["leaderboard"], "states": states}))
""")


def _run_flow(cfg):
    from farmflow import tasks
    from farmflow.flows import best_of_n_flow

    tasks.EXECUTED.clear()
    summary = best_of_n_flow(advanced=cfg)
    return summary, dict(tasks.EXECUTED)


@pytest.mark.slow
def test_flow_on_s3_then_reused_from_the_bucket_then_deleted_artifact_recomputed(
    s3_server,
    prefect_harness,
    tmp_path,
    monkeypatch,
    caplog,
    capfd,
):
    import logging

    from prefect.client.orchestration import get_client

    from farmflow.config import load_config

    caplog.set_level(logging.DEBUG)  # botocore's debug log shows every signed request: the secret must not be in it
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", FAKE_SECRET)  # moto accepts any key: a recognizable one to look for
    bucket = s3_server.bucket()

    def config(cache: str):
        return load_config(
            "synthetic-micro",
            [
                f"store.uri=s3://{bucket}/farm",
                f"store.endpoint_url={s3_server.endpoint}",
                f"store.cache_dir={tmp_path / cache}",
            ],
        )

    first, executed = _run_flow(config("cache-1"))
    assert {"data", "base_model", "sft", "sample_pairs", "annotate", "train_reward", "best_of_n", "evaluate"} <= set(
        executed
    )
    assert first["store"] == f"s3://{bucket}/farm" and first["artifacts"]["sft"].startswith(f"s3://{bucket}/farm/sft/")
    assert sorted(r["method"] for r in first["leaderboard"]) == ["best_of_4", "sft", "untrained"]
    objects = s3_server.objects(bucket)
    sft_key = next(s["key"] for s in first["stages"] if s["stage"] == "sft")
    assert f"farm/sft/{sft_key}/{COMMIT_FILE}" in objects
    # Prefect's result records live in the bucket, beside the artifacts, holding the ref as JSON
    record = objects[f"farm/_prefect/sft-{sft_key}"]
    assert json.loads(record) and f'"key":"{sft_key}"'.encode() in record.replace(b" ", b"").replace(b"\\", b"")
    prefect_local = Path(os.environ["PREFECT_HOME"]) / "storage"
    assert not prefect_local.exists() or not list(prefect_local.glob(f"*{sft_key}*"))

    # a fresh worker: an empty download cache; everything is reused from the bucket, nothing runs
    second, executed = _run_flow(config("cache-2"))
    assert executed == {}
    assert all(s["cached"] for s in second["stages"]) and second["leaderboard"] == first["leaderboard"]
    assert not (tmp_path / "cache-2" / "s3").exists()  # not even a download was needed

    # another machine: a new process with a new Prefect home (its own temporary API) and an
    # empty cache finds Prefect's records and the artifacts in the bucket and runs nothing
    env = python_env(
        PREFECT_HOME=str(migrated_home(tmp_path / "prefect-2")), PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="180"
    )
    env.pop("PREFECT_API_URL", None)
    overrides = [
        f"store.uri=s3://{bucket}/farm",
        f"store.endpoint_url={s3_server.endpoint}",
        f"store.cache_dir={tmp_path / 'cache-m2'}",
    ]
    machine = subprocess.run(
        [sys.executable, "-c", FRESH_MACHINE, *overrides], env=env, capture_output=True, text=True, timeout=300
    )
    assert machine.returncode == 0, machine.stderr[-3000:]
    report = json.loads(machine.stdout.strip().splitlines()[-1])
    assert report["executed"] == {} and all(report["cached"]) and report["leaderboard"] == first["leaderboard"]
    # Prefect's cache hits (records read from the bucket), not only store lookups inside the tasks
    stages = {
        "data",
        "base_model",
        "sft",
        "sample_pairs",
        "annotate",
        "train_reward",
        "generate",
        "best_of_n",
        "evaluate",
    }
    stage_states = {
        (name, state) for name, state in report["states"] if name in stages
    }  # not the leaderboard or wrappers
    assert stage_states == {(name, "Cached") for name in stages}, report["states"]
    assert FAKE_SECRET not in machine.stdout + machine.stderr

    # the SFT checkpoint deleted from the bucket behind Prefect's back: recomputed, not trusted
    client = s3_server.client()
    for key in [k for k in objects if k.startswith(f"farm/sft/{sft_key}/")]:
        client.delete_object(Bucket=bucket, Key=key)
    third, executed = _run_flow(config("cache-3"))
    assert executed == {"sft": 1}
    assert (
        third["leaderboard"] == first["leaderboard"]
        and open_store(config("cache-3").store.location).get("sft", sft_key) is not None
    )

    # the secret is nowhere: not in any object (artifacts, Parquet, Prefect records), local file, log or message
    secret = FAKE_SECRET.encode()
    leaked = [k for k, data in s3_server.objects(bucket).items() if secret in data]
    assert leaked == []
    assert [p for p in tmp_path.rglob("*") if p.is_file() and secret in p.read_bytes()] == []
    out, err = capfd.readouterr()
    assert FAKE_SECRET not in out + err + caplog.text
    with get_client(sync_client=True) as prefect:
        logs = prefect.read_logs()
        runs = prefect.read_flow_runs()
    assert not [entry.message for entry in logs if FAKE_SECRET in entry.message]
    assert not [run.id for run in runs if FAKE_SECRET in json.dumps(run.parameters, default=str)]
