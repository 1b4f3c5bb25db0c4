"""Training curves as pictures: one panel per figure, one line per stage (`plot`), and their summary (`summary`).

`farmflow plot curves` writes them to a PNG; each training stage run inside a Prefect flow run
publishes them there (`publish`): a Markdown artifact ``<stage>-curves`` with the PNG embedded
(a data URI: the picture needs no server of its own) above the summary table, and a table
artifact ``<stage>-summary``. The figures are drawn with matplotlib's object API (no pyplot
state), so methods running in parallel threads can draw at once.
"""

from __future__ import annotations

import base64
import io
import logging
import math
from typing import Any, Sequence

import pyarrow as pa

from farmflow import training_metrics
from farmflow.progress import in_prefect_run

logger = logging.getLogger("farmflow")

FIRST = ["loss", "reward", "kl", "accuracy", "margin", "value_loss", "policy_loss", "entropy"]
"""Figures drawn first (in this order) when a stage has them; the others follow by name."""
SKIP = {"step", "epoch", "split", "tokens", "wall_s"}
"""Columns that are axes or counters, not curves."""
PANEL_IN = (4.2, 2.8)
"""Width and height of one panel's share of the figure, in inches."""
MARGIN_IN = (0.75, 0.15, 0.45, 0.3)
"""Figure margins in inches (left, right, bottom, top): room for tick labels such as 0.00010, the step label, and a
title or a scale factor (1e-5) above the top panels."""
TICKS = 5
"""Most intervals between ticks on an axis."""


def panels(tables: Sequence[tuple[str, pa.Table]], only: Sequence[str] | None = None, limit: int = 16) -> list[str]:
    """The figures to draw: `only` (those present), else every column some table has data for, `FIRST` first."""
    present = {
        name
        for _, t in tables
        for name in t.column_names
        if name not in SKIP and any(v is not None for v in t.column(name).to_pylist())
    }
    if only:
        return [n for n in only if n in present]
    rest = sorted(present - set(FIRST))
    return ([n for n in FIRST if n in present] + rest)[:limit]


def plot(
    tables: Sequence[tuple[str, pa.Table]], path: Any = None, only: Sequence[str] | None = None, dpi: int = 80
) -> bytes:
    """Draw the curves of `tables` ((label, metrics table) pairs) against the step; write them to `path` if given.

    Returns the PNG's bytes. Validation rows (``split='val'``) are drawn as points.

    Margins are fixed in inches, titles placed explicitly and axes get about five ticks: matplotlib's automatic layout
    and title placement measure every tick label again before the figure is drawn (most of a picture's cost), and every
    training stage run in a flow draws one.
    """
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    names = panels(tables, only)
    if not names:
        raise ValueError("no training figure to draw: the tables have no metric values")
    cols = min(3, len(names))
    rows = math.ceil(len(names) / cols)
    width, height = PANEL_IN[0] * cols, PANEL_IN[1] * rows
    fig = Figure(figsize=(width, height), dpi=dpi)
    left, right, bottom, top = MARGIN_IN
    fig.subplots_adjust(  # space between panels: a fraction of a panel's mean width and height
        left=left / width,
        right=1 - right / width,
        bottom=bottom / height,
        top=1 - top / height,
        wspace=0.35,
        hspace=0.5,
    )
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax, name in zip(axes, names):
        for label, t in tables:
            if name not in t.column_names:
                continue
            data = t.select(["step", "split", name]).to_pylist()
            for split, style in (("train", "-"), ("val", "o")):
                pts = [(r["step"], r[name]) for r in data if r["split"] == split and r[name] is not None]
                if pts:
                    ax.plot(*zip(*pts), style, label=label if split == "train" else f"{label} (val)", markersize=4)
        ax.set_title(name, fontsize=10, y=1.0)  # an explicit y: no search for a place above the tick labels
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=TICKS, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(nbins=TICKS))
        if len(tables) > 1 and ax.lines:
            ax.legend(fontsize=6)
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    data = buf.getvalue()
    if path is not None:
        with open(path, "wb") as f:
            f.write(data)
    return data


def summary(table: pa.Table) -> list[dict[str, Any]]:
    """Per figure of the training rows: first, last (mean of the last tenth of the steps), min, max; val rows as is."""
    rows = table.to_pylist()
    train = [r for r in rows if r["split"] == "train"]
    out = []
    for name in panels([("", table)], limit=100):
        values = [r[name] for r in train if r[name] is not None]
        if values:
            tail = values[-max(1, len(values) // 10) :]
            out.append(
                {
                    "figure": name,
                    "first": values[0],
                    "last": sum(tail) / len(tail),
                    "min": min(values),
                    "max": max(values),
                }
            )
    for r in rows:
        if r["split"] != "train":
            out += [
                {"figure": f"{r['split']}/{k}", "first": None, "last": v, "min": None, "max": None}
                for k, v in r.items()
                if k not in SKIP and v is not None
            ]
    return out


def _fmt(v: Any) -> str:
    return "" if v is None else f"{v:.4g}"


def markdown(stage: str, key: str, png: bytes, rows: list[dict[str, Any]]) -> str:
    """The Markdown artifact: the curves (embedded PNG) and the summary table."""
    lines = [
        f"### {stage} `{key[:12]}`: training curves",
        "",
        f"![{stage} training curves](data:image/png;base64,{base64.b64encode(png).decode()})",
        "",
        "| figure | first | last | min | max |",
        "|---|---:|---:|---:|---:|",
    ]
    lines += [
        f"| {r['figure']} | {_fmt(r['first'])} | {_fmt(r['last'])} | {_fmt(r['min'])} | {_fmt(r['max'])} |"
        for r in rows
    ]
    return "\n".join(lines) + "\n"


def publish(store_uri: str, ref: Any) -> bool:
    """Inside a Prefect flow or task run: publish a training stage's curves and summary as artifacts (see module doc).

    Returns whether it published. A stage without a metrics table, or no run context, publishes nothing.
    """
    if ref is None or not (ref.metrics or {}).get(training_metrics.ROWS_METRIC) or not in_prefect_run():
        return False
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from farmflow.storage import open_store

    table = training_metrics.read(open_store(store_uri), ref)
    if table is None or table.num_rows == 0:
        return False
    rows = summary(table)
    slug = ref.stage.replace("_", "-").lower()
    desc = f"{ref.stage} {ref.key[:12]}: per-step training metrics (farmflow plot curves {ref.stage} {ref.key[:12]})"
    try:
        png = plot([(ref.stage, table)], dpi=64)  # small: the picture is stored in Prefect's database
        create_markdown_artifact(markdown(ref.stage, ref.key, png, rows), f"{slug}-curves", desc)
        create_table_artifact(
            [{k: (_fmt(v) if k != "figure" else v) for k, v in r.items()} for r in rows], f"{slug}-summary", desc
        )
    except Exception as err:  # noqa: BLE001 - the stage is committed: a picture that cannot be published fails nothing
        logger.warning("%s: could not publish its training curves (%s: %s)", ref.stage, type(err).__name__, err)
        return False
    return True
