"""What a run leaves besides its leaderboard: the ``runs`` row log, the history trend, the over-optimization curve
as Prefect artifacts."""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import pyarrow as pa
from prefect import task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from farmflow.flows.runner import StageRunner
from farmflow.storage import ArtifactRef, open_store
from farmflow.storage.schemas import SCHEMAS
from farmflow.tasks.core import log


def publish_curve(run: StageRunner, curve: ArtifactRef, title: str) -> list[dict]:
    """The over-optimization curve as Prefect markdown and table artifacts (with where its files are)."""
    rows = run.store.read_table(curve).to_pylist()
    markdown = run.store.read_file(curve, "curve.md").decode()
    create_markdown_artifact(
        markdown + f"\nParquet, Markdown and plot (curve.png): `{curve.uri}`\n",
        key="overoptimization",
        description=title,
    )
    cols = (
        "label",
        "family",
        "pressure",
        "labeller",
        "annotator",
        "proxy_reward",
        "win_rate",
        "standard_error",
        "mean_gold",
        "avg_length",
    )
    create_table_artifact(
        [{k: (None if r[k] != r[k] else r[k]) for k in cols} for r in rows],
        key="overoptimization-table",
        description=title,
    )
    return rows


@task(name="record_run", cache_policy=NO_CACHE, persist_result=False)
def record_run_task(store_uri: str, board: ArtifactRef, preset: str, key: str, history: bool = False) -> dict[str, Any]:
    """Append the run's leaderboard rows to the store's ``runs`` row log; returns its run id and the rows appended."""
    from prefect.runtime import flow_run

    from farmflow.evaluation.history import run_id_of, run_rows

    store = open_store(store_uri)
    run = {
        "run_id": run_id_of(flow_run.id),
        "flow_run_id": str(flow_run.id or ""),
        "flow_run_name": flow_run.name or "",
        "flow": flow_run.flow_name or "",
        "run_at": datetime.now(timezone.utc),
        "preset": preset,
        "config_key": key,
        "history": history,
        "leaderboard_key": board.key,
    }
    table = run_rows(store.read_table(board).to_pylist(), run)
    store.append_rows("runs", table, "runs")
    log("runs: run %s, %d rows appended", run["run_id"], table.num_rows)
    return {"run_id": run["run_id"], "rows": table.num_rows}


HISTORY_RUNS = 10
"""How many of a preset's newest runs the published trend shows."""


@task(name="history", cache_policy=NO_CACHE, persist_result=False)
def history_task(store_uri: str, preset: str) -> ArtifactRef | None:
    """The trend of the preset's newest runs (`HISTORY_RUNS`) as a ``history`` artifact (the runs rows, ``history.md``,
    ``history.png``) and a Prefect markdown artifact (key ``history``); nothing with fewer than 2 runs of the preset."""
    import tempfile
    from pathlib import Path

    from farmflow.evaluation.history import plot_trend, trend, trend_markdown
    from farmflow.storage import stage_key

    store = open_store(store_uri)
    rows = [r for r in store.read_rows("runs", "runs").to_pylist() if r["preset"] == preset]
    t = trend(rows, last=HISTORY_RUNS)
    if len(t["runs"]) < 2:
        log("history: %d run(s) of %s so far, no trend to publish", len(t["runs"]), preset)
        return None
    ids = [r["run_id"] for r in t["runs"]]
    title = f"History: {preset}, the newest {len(ids)} runs"
    markdown = trend_markdown(t, title)
    key = stage_key("history", "1", {"preset": preset, "runs": ids})
    ref = store.get("history", key)
    if ref is None:
        with tempfile.TemporaryDirectory() as tmp:
            plot_trend(t, f"{tmp}/history.png", f"Win rate across runs: {preset}")
            png = Path(f"{tmp}/history.png").read_bytes()
        table = pa.Table.from_pylist([r for r in rows if r["run_id"] in set(ids)], schema=SCHEMAS["runs"])
        ref = store.put_table(
            "history",
            key,
            table,
            "runs",
            config={"preset": preset, "runs": ids},
            extra_files={"history.md": markdown.encode(), "history.png": png},
        )
    where = f"\nRows, Markdown and plot (history.png): `{ref.uri}`\n"
    create_markdown_artifact(markdown + where, key="history", description=title)
    log("history: %d runs of %s, %d flagged change(s), plot in %s", len(ids), preset, len(t["changes"]), ref.uri)
    return ref
