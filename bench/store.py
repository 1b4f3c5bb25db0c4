"""Store throughput: the local store and the S3 store (moto on loopback), each beside a plain peer.

1. a 200k-row annotations table appended to the row log and read back;
2. a 50 MB checkpoint committed with `put_model` and fetched with `model_dir` (for S3:
   into an empty download cache);
3. a DuckDB aggregate (cost and mean preference per annotator) over the `annotations`
   view of those 200k rows.

Peers, same bytes: local: pyarrow writing/reading the Parquet file and a plain file copy;
S3: boto3 `upload_file`/`download_file`. MB/s count the bytes of the Parquet file or the
checkpoint; each number is the median of 3 runs. The S3 server is moto in this process
(pure Python), so the S3 numbers measure farmflow + s3fs + moto on loopback, not S3 or
MinIO. Writes bench/results/store.json.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import shutil
import statistics
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

OUT = Path(__file__).parent / "results" / "store.json"
ROWS, CHECKPOINT_MB, REPEATS = 200_000, 50, 3


def annotations_table(n: int) -> pa.Table:
    """n annotation rows with realistic text lengths; columns not set here are null."""
    from farmflow.storage.schemas import SCHEMAS

    words = ["sort", "list", "reverse", "max", "sum", "categorize"]
    col = lambda fmt: [fmt.format(k, words[k % 6]) for k in range(n)]  # noqa: E731
    cols = {
        "key": col("key-{}-{}"),
        "annotator": [f"annotator-{k % 13}" for k in range(n)],
        "annotator_hash": [f"h{k % 13}" for k in range(n)],
        "model": ["gpt-4"] * n,
        "instruction": col("Please {1} the following numbers, instance {0}."),
        "input": col("{0}, 3, 17, 2"),
        "output_1": col("Here is the answer to {1} #{0}: 2, 3, 17, and that is all."),
        "output_2": col("I think {1} of {0} gives 17, 3, 2."),
        "preference": [1.0 + (k % 2) for k in range(n)],
        "status": ["ok"] * n,
        "raw_completion": col("Output ({0}) is better for {1}."),
        "prompt_tokens": [120 + k % 50 for k in range(n)],
        "completion_tokens": [5] * n,
        "price_usd": [0.0021] * n,
        "latency_s": [0.8] * n,
        "created": [datetime(2026, 1, 1, tzinfo=timezone.utc)] * n,
    }
    schema = SCHEMAS["annotations"]
    return pa.Table.from_arrays([pa.array(cols.get(f.name, [None] * n), f.type) for f in schema], schema=schema)


def median_time(fn, setup=None) -> float:
    times = []
    for _ in range(REPEATS):
        if setup:
            setup()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def bench_store(store, table: pa.Table, weights: Path, fresh_cache) -> dict:
    """Write/read the table and the checkpoint through one store; the DuckDB aggregate."""
    from farmflow.storage.sql import connect

    out: dict = {}
    ns = iter(range(100))
    names: list[str] = []
    out["table_write_s"] = median_time(
        lambda: names.append(store.append_rows(f"annotations/w{next(ns)}", table, "annotations"))
    )
    first = store.row_chunks("annotations/w0")[0]
    out["parquet_mb"] = store.fs.size(first) / 1e6
    out["table_read_s"] = median_time(lambda: store.read_rows("annotations/w0", "annotations"))
    assert store.read_rows("annotations/w0", "annotations").num_rows == ROWS

    keys = iter(range(100))

    def put_model():
        with store.put_model("bench", f"ckpt-{next(keys)}", "policy") as (folder, metrics):
            shutil.copyfile(weights, folder / "model.safetensors")

    out["checkpoint_write_s"] = median_time(put_model)
    ref = store.get("bench", "ckpt-0")
    out["checkpoint_read_s"] = median_time(
        lambda: (store.model_dir(ref) / "model.safetensors").read_bytes(), setup=fresh_cache
    )

    # the aggregate over exactly one 200k-row chunk
    for k in range(1, len(names)):
        store.fs.rm(store.row_chunks(f"annotations/w{k}"))
    con = connect(store)
    query = (
        "SELECT annotator, count(*) AS n, sum(price_usd) AS cost, avg(preference) AS pref "
        "FROM annotations GROUP BY annotator"
    )
    assert sum(r[1] for r in con.sql(query).fetchall()) == ROWS
    out["duckdb_aggregate_s"] = median_time(lambda: con.sql(query).fetchall())
    out["table_write_mb_s"] = out["parquet_mb"] / out["table_write_s"]
    out["table_read_mb_s"] = out["parquet_mb"] / out["table_read_s"]
    out["checkpoint_write_mb_s"] = CHECKPOINT_MB / out["checkpoint_write_s"]
    out["checkpoint_read_mb_s"] = CHECKPOINT_MB / out["checkpoint_read_s"]
    return out


def main() -> None:
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="farmflow-bench-prefect-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import boto3
    from moto.server import ThreadedMotoServer

    from farmflow.storage import LocalStore, open_store

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")

    tmp = Path(tempfile.mkdtemp(prefix="farmflow-bench-store-"))
    try:
        table = annotations_table(ROWS)
        weights = tmp / "weights.safetensors"
        weights.write_bytes(os.urandom(CHECKPOINT_MB * 10**6))

        local = LocalStore(tmp / "local")
        results: dict = {
            "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform()},
            "rows": ROWS,
            "checkpoint_mb": CHECKPOINT_MB,
            "repeats": REPEATS,
            "local": bench_store(local, table, weights, fresh_cache=None),
        }
        cache = tmp / "s3-cache"
        s3 = open_store(f"s3://bench/farm?endpoint_url={endpoint}&cache_dir={cache}")
        results["s3_moto_loopback"] = bench_store(
            s3, table, weights, fresh_cache=lambda: shutil.rmtree(cache / "s3", ignore_errors=True)
        )

        # peers: plain pyarrow and file copies locally, plain boto3 against the same server
        parquet = tmp / "peer.parquet"
        peer: dict = {"pyarrow_write_s": median_time(lambda: pq.write_table(table, parquet))}
        peer["pyarrow_read_s"] = median_time(lambda: pq.read_table(parquet))
        peer["copy_checkpoint_s"] = median_time(lambda: shutil.copyfile(weights, tmp / "copy.safetensors"))
        peer["boto3_upload_parquet_s"] = median_time(
            lambda: client.upload_file(str(parquet), "bench", "peer/t.parquet")
        )
        peer["boto3_download_parquet_s"] = median_time(
            lambda: client.download_file("bench", "peer/t.parquet", str(tmp / "t.parquet"))
        )
        peer["boto3_upload_checkpoint_s"] = median_time(lambda: client.upload_file(str(weights), "bench", "peer/w"))
        peer["boto3_download_checkpoint_s"] = median_time(
            lambda: client.download_file("bench", "peer/w", str(tmp / "w"))
        )
        results["peers"] = peer

        lo, s3r = results["local"], results["s3_moto_loopback"]
        results["ratios"] = {
            "local_table_write_vs_pyarrow": lo["table_write_s"] / peer["pyarrow_write_s"],
            "local_table_read_vs_pyarrow": lo["table_read_s"] / peer["pyarrow_read_s"],
            "local_checkpoint_write_vs_copy": lo["checkpoint_write_s"] / peer["copy_checkpoint_s"],
            "s3_table_write_vs_boto3_upload": s3r["table_write_s"]
            / (peer["pyarrow_write_s"] + peer["boto3_upload_parquet_s"]),
            "s3_table_read_vs_boto3_download": s3r["table_read_s"]
            / (peer["boto3_download_parquet_s"] + peer["pyarrow_read_s"]),
            "s3_checkpoint_write_vs_boto3_upload": s3r["checkpoint_write_s"] / peer["boto3_upload_checkpoint_s"],
            "s3_checkpoint_read_vs_boto3_download": s3r["checkpoint_read_s"] / peer["boto3_download_checkpoint_s"],
            "s3_vs_local_duckdb_aggregate": s3r["duckdb_aggregate_s"] / lo["duckdb_aggregate_s"],
        }
        results["notes"] = (
            "ratios are seconds (farmflow / peer): 1.0 = as fast as the peer, 2.0 = twice as slow; peers for tables "
            "include the Parquet encode/decode with pyarrow. S3 = moto in-process on 127.0.0.1."
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        server.stop()

    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(results, indent=2) + "\n")
    for where in ("local", "s3_moto_loopback"):
        r = results[where]
        print(
            f"{where:17s} table ({r['parquet_mb']:.1f} MB Parquet, {ROWS} rows): "
            f"write {r['table_write_mb_s']:.1f} MB/s, "
            f"read {r['table_read_mb_s']:.1f} MB/s | checkpoint {CHECKPOINT_MB} MB: "
            f"write {r['checkpoint_write_mb_s']:.1f} MB/s, "
            f"read {r['checkpoint_read_mb_s']:.1f} MB/s | DuckDB aggregate {r['duckdb_aggregate_s'] * 1000:.0f} ms"
        )
    for name, ratio in results["ratios"].items():
        print(f"  {name}: {ratio:.2f}x")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
