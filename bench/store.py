"""Store throughput: the local store and the S3 store (moto on loopback), each beside a plain peer.

1. a 200k-row annotations table appended to the row log and read back;
2. a 50 MB checkpoint committed with `put_model` and fetched with `model_dir` (for S3:
   into an empty download cache);
3. a DuckDB aggregate (cost and mean preference per annotator) over the `annotations`
   view of those 200k rows.

Peers, same bytes: local: pyarrow writing/reading the Parquet file and a plain file copy;
S3: boto3 `upload_file`/`download_file`. MB/s count the bytes of the Parquet file or the
checkpoint. The S3 server is moto in this process
(pure Python), so the S3 numbers measure farmflow + s3fs + moto on loopback, not S3 or
MinIO. Every comparison runs farmflow and its peer interleaved (`bench.harness.interleave`: one warm-up each,
then A B, B A, ... for --rounds rounds) and reports MB/s medians with their range and the ratio (farmflow / peer,
higher is better) as `entries`. ``--smoke`` (CI): 2,000 rows, a 1 MB checkpoint, one round, in seconds.
Writes bench/results/store.json.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import pyarrow as pa
import pyarrow.parquet as pq

from bench.harness import arguments, entry, interleave, machine, save

OUT = Path(__file__).parent / "results" / "store.json"
ROWS, CHECKPOINT_MB, ROUNDS = 200_000, 50, 5


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


def timed(fn: Callable[[], object], mb: Callable[[], float], setup: Callable[[], object] | None = None):
    """A contender: one run of `fn` (after an untimed `setup`), measured in MB/s of `mb()` bytes."""

    def run() -> float:
        if setup:
            setup()
        start = time.perf_counter()
        fn()
        return mb() / (time.perf_counter() - start)

    return run


def comparisons(local, s3, client, table: pa.Table, weights: Path, tmp: Path, cache: Path, checkpoint_mb: float):
    """(what, farmflow contender, peer contender) for every comparison; each contender returns MB/s."""
    parquet = tmp / "peer.parquet"
    pq.write_table(table, parquet)
    size = {"parquet": parquet.stat().st_size / 1e6}
    names = iter(range(10**6))

    def append(store) -> Callable[[], object]:
        return lambda: store.append_rows(f"annotations/w{next(names)}", table, "annotations")

    for store in (local, s3):
        store.append_rows("annotations", table, "annotations")  # what the read contenders (and DuckDB) read
        with store.put_model("bench", "ckpt-r", "policy") as (folder, _):
            shutil.copyfile(weights, folder / "model.safetensors")
    keys = iter(range(10**6))

    def put_model(store) -> Callable[[], object]:
        def put() -> None:
            with store.put_model("bench", f"ckpt-{next(keys)}", "policy") as (folder, _):
                shutil.copyfile(weights, folder / "model.safetensors")

        return put

    client.upload_file(str(parquet), "bench", "peer/r.parquet")
    client.upload_file(str(weights), "bench", "peer/r.safetensors")
    table_mb, ckpt_mb = (lambda: size["parquet"]), (lambda: checkpoint_mb)
    fresh_s3_cache = lambda: shutil.rmtree(cache / "s3", ignore_errors=True)  # noqa: E731
    return [
        (
            f"local table write ({table.num_rows:,} annotation rows)",
            timed(append(local), table_mb),
            timed(lambda: pq.write_table(table, tmp / "w.parquet"), table_mb),
            "pyarrow write_table",
        ),
        (
            "local table read",
            timed(lambda: local.read_rows("annotations", "annotations"), table_mb),
            timed(lambda: pq.read_table(parquet), table_mb),
            "pyarrow read_table",
        ),
        (
            f"local checkpoint write ({checkpoint_mb:g} MB)",
            timed(put_model(local), ckpt_mb),
            timed(lambda: shutil.copyfile(weights, tmp / "copy.safetensors"), ckpt_mb),
            "file copy",
        ),
        (
            "S3 table write (moto, loopback)",
            timed(append(s3), table_mb),
            timed(
                lambda: (
                    pq.write_table(table, tmp / "u.parquet"),
                    client.upload_file(str(tmp / "u.parquet"), "bench", "peer/u.parquet"),
                ),
                table_mb,
            ),
            "pyarrow + boto3 upload_file",
        ),
        (
            "S3 table read (moto, loopback)",
            timed(lambda: s3.read_rows("annotations", "annotations"), table_mb),
            timed(
                lambda: (
                    client.download_file("bench", "peer/r.parquet", str(tmp / "d.parquet")),
                    pq.read_table(tmp / "d.parquet"),
                ),
                table_mb,
            ),
            "boto3 download_file + pyarrow",
        ),
        (
            "S3 checkpoint write (moto, loopback)",
            timed(put_model(s3), ckpt_mb),
            timed(lambda: client.upload_file(str(weights), "bench", "peer/w"), ckpt_mb),
            "boto3 upload_file",
        ),
        (
            "S3 checkpoint read into an empty cache (moto, loopback)",
            timed(
                lambda: (s3.model_dir(s3.get("bench", "ckpt-r")) / "model.safetensors").stat(), ckpt_mb, fresh_s3_cache
            ),
            timed(lambda: client.download_file("bench", "peer/r.safetensors", str(tmp / "w")), ckpt_mb),
            "boto3 download_file",
        ),
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = arguments(
        __doc__, OUT, ROUNDS, "CI: 2,000 rows, a 1 MB checkpoint, one round", "interleaved rounds per comparison"
    )
    args = parser.parse_args(argv)
    rows, checkpoint_mb = (2_000, 1) if args.smoke else (ROWS, CHECKPOINT_MB)
    rounds = 1 if args.smoke else args.rounds
    os.environ.setdefault("PREFECT_HOME", tempfile.mkdtemp(prefix="farmflow-bench-prefect-"))
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1")
    import boto3
    from moto.server import ThreadedMotoServer

    from farmflow.storage import LocalStore, open_store
    from farmflow.storage.sql import connect

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="bench")
    results: dict = {
        "machine": machine(),
        "setup": {
            "rows": rows,
            "checkpoint_mb": checkpoint_mb,
            "rounds": rounds,
            "s3": "moto ThreadedMotoServer in this process on 127.0.0.1 (pure Python): not S3 or MinIO",
        },
        "entries": [],
        "runs": {},
    }
    tmp = Path(tempfile.mkdtemp(prefix="farmflow-bench-store-"))
    try:
        table = annotations_table(rows)
        weights = tmp / "weights.safetensors"
        weights.write_bytes(os.urandom(int(checkpoint_mb * 10**6)))
        local, cache = LocalStore(tmp / "local"), tmp / "s3-cache"
        s3 = open_store(f"s3://bench/farm?endpoint_url={endpoint}&cache_dir={cache}")
        for what, ours, peer, peer_name in comparisons(local, s3, client, table, weights, tmp, cache, checkpoint_mb):
            runs = interleave({"farmflow": ours, peer_name: peer}, rounds=rounds)
            results["runs"][what] = runs
            results["entries"].append(entry(what, "MB/s", runs))
            e = results["entries"][-1]
            print(f"{what}: farmflow / {peer_name} {e['ratio']:.2f}x", flush=True)
        con = connect(local)
        query = (
            "SELECT annotator, count(*) AS n, sum(price_usd) AS cost, avg(preference) AS pref "
            "FROM annotations GROUP BY annotator"
        )
        rows_seen = sum(r[1] for r in con.sql(query).fetchall())
        start = time.perf_counter()
        con.sql(query).fetchall()
        results["duckdb_aggregate"] = {"rows": rows_seen, "seconds": time.perf_counter() - start}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        server.stop()
    results["machine"]["load_average_at_end"] = list(os.getloadavg())
    return save(results, args.out)


if __name__ == "__main__":
    main()
