"""Runs and their trend: what changed between nights.

Every flow run that ends in a leaderboard appends one row per method to the store's ``runs``
row log (`run_rows`; schema ``runs`` in `farmflow.storage.schemas`). This module picks runs out
of those rows (`pick_preset`, `pick_run`), lays them out as a trend per method across runs
(`trend`, oldest run first) and flags the changes worth a look (`flag_changes`): a method's win
rate moved between two consecutive runs of it by more than two combined standard errors,

    |w₂ − w₁| > 2 · sqrt(se₁² + se₂²),

about a 5% false alarm rate per comparison when nothing changed (two independent estimates).
Renderings: plain text (`trend_text`, never cut to a terminal's width), Markdown
(`trend_markdown`, the Prefect artifact), long rows (`trend_long`, for CSV and JSON) and a plot
(`plot_trend`).
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime
from typing import Any, Sequence

import pyarrow as pa

from farmflow.storage.schemas import SCHEMAS

DEFAULT_PRESET = "synthetic-tiny"
RUN_COLUMNS = (
    "run_id",
    "flow_run_id",
    "flow_run_name",
    "flow",
    "run_at",
    "preset",
    "config_key",
    "history",
    "leaderboard_key",
)
"""The columns of a ``runs`` row that describe the run (the same on each of its method rows)."""
LONG_COLUMNS = (
    "run_id",
    "run_at",
    "preset",
    "config_key",
    "method",
    "win_rate",
    "standard_error",
    "n",
    "lc_win_rate",
    "mean_gold",
    "gold_standard_error",
    "avg_length",
    "delta",
    "flag",
)
"""The columns of `trend_long` (CSV and JSON): one row per run and method; delta and flag against its previous run."""
RISE, DROP = "▲", "▼"


def run_id_of(flow_run_id: str | None) -> str:
    """A run's short id: the last 8 hex digits of its Prefect flow-run id, random ones outside a flow run.

    Prefect's ids are UUIDv7, whose first digits are a timestamp shared by the runs of the same minute;
    the last digits are random."""
    return (str(flow_run_id).replace("-", "") if flow_run_id else uuid.uuid4().hex)[-8:]


def _finite(x: Any) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else float(x)


def run_rows(board: Sequence[dict], run: dict[str, Any]) -> pa.Table:
    """The ``runs`` rows of one run: `run` (the `RUN_COLUMNS`) followed by each leaderboard row; NaN becomes null."""
    leaderboard = SCHEMAS["leaderboard"].names
    rows = [
        run | {k: (_finite(row.get(k)) if isinstance(row.get(k), float) else row.get(k)) for k in leaderboard}
        for row in board
    ]
    return pa.Table.from_pylist(rows, schema=SCHEMAS["runs"])


def runs_of(rows: Sequence[dict]) -> list[dict]:
    """The runs in `rows` (their `RUN_COLUMNS`), oldest first."""
    runs: dict[str, dict] = {}
    for r in rows:
        runs.setdefault(r["run_id"], {k: r.get(k) for k in RUN_COLUMNS})
    return sorted(runs.values(), key=lambda r: (r["run_at"], r["run_id"]))


def pick_preset(rows: Sequence[dict], preset: str | None = None) -> tuple[str, str]:
    """(preset, why) to show: `preset` when given, else `DEFAULT_PRESET`, else the preset of the newest run.

    Raises LookupError (one line) when no run matches."""
    presets = sorted({r["preset"] for r in rows})
    if not presets:
        raise LookupError("no runs recorded in this store yet: run a flow first (e.g. `farmflow demo`)")
    if preset is not None:
        if preset not in presets:
            raise LookupError(f"no runs of preset {preset!r} in this store; presets with runs: {', '.join(presets)}")
        return preset, f"preset {preset}"
    if DEFAULT_PRESET in presets:
        return DEFAULT_PRESET, f"preset {DEFAULT_PRESET} (the default)"
    newest = runs_of(rows)[-1]["preset"]
    return newest, f"preset {newest} (no runs of {DEFAULT_PRESET}; the preset of the newest run)"


def pick_run(rows: Sequence[dict], run: str | None = None, preset: str | None = None) -> tuple[list[dict], str]:
    """(the rows of one run, best win rate first; why that run): the run whose run id or flow-run id starts with
    `run`, else the newest run of `pick_preset(rows, preset)`.

    Raises LookupError (one line) when none or several match."""
    if run is not None:
        wanted = run.strip().lower()
        found = [
            r for r in runs_of(rows) if r["run_id"].startswith(wanted) or (r["flow_run_id"] or "").startswith(wanted)
        ]
        if len(found) != 1:
            some = ", ".join(r["run_id"] for r in (found or runs_of(rows)[-5:]))
            raise LookupError(
                f"{'several runs match' if found else 'no run matches'} {run!r}; "
                f"{'matching' if found else 'newest'} runs: {some or 'none'}"
            )
        chosen, why = found[0], f"run {found[0]['run_id']}"
    else:
        name, why = pick_preset(rows, preset)
        chosen = runs_of([r for r in rows if r["preset"] == name])[-1]
        why = f"the newest run of {why}"
    board = [r for r in rows if r["run_id"] == chosen["run_id"]]
    return sorted(board, key=lambda r: -(r["win_rate"] if r["win_rate"] is not None else -math.inf)), why


def significant(before: dict, after: dict) -> bool:
    """Did the win rate change by more than two combined standard errors? (False when a value is missing.)"""
    w1, w2, s1, s2 = (
        _finite(d.get(k))
        for k, d in (("win_rate", before), ("win_rate", after), ("standard_error", before), ("standard_error", after))
    )
    if None in (w1, w2, s1, s2):
        return False
    return abs(w2 - w1) > 2 * math.sqrt(s1**2 + s2**2)


def flag_changes(rows: Sequence[dict]) -> list[dict]:
    """Every change larger than two combined SEs between consecutive runs of the same method, oldest first:
    method, from_run, to_run, before, after, delta, threshold (2·sqrt(se₁² + se₂²)) and mark (▲ rise, ▼ drop).
    """
    order = {r["run_id"]: i for i, r in enumerate(runs_of(rows))}
    by_method: dict[str, list[dict]] = {}
    for r in sorted(rows, key=lambda r: order[r["run_id"]]):
        by_method.setdefault(r["method"], []).append(r)
    changes = []
    for method, seq in by_method.items():
        for before, after in zip(seq, seq[1:]):
            if significant(before, after):
                delta = after["win_rate"] - before["win_rate"]
                changes.append(
                    {
                        "method": method,
                        "from_run": before["run_id"],
                        "to_run": after["run_id"],
                        "before": before["win_rate"],
                        "after": after["win_rate"],
                        "delta": delta,
                        "threshold": 2 * math.sqrt(before["standard_error"] ** 2 + after["standard_error"] ** 2),
                        "mark": RISE if delta > 0 else DROP,
                    }
                )
    return sorted(changes, key=lambda c: (order[c["to_run"]], c["method"]))


def trend(rows: Sequence[dict], last: int | None = None) -> dict[str, Any]:
    """The trend of each method across the runs in `rows` (the newest `last` runs when given), oldest run first.

    Returns {"runs": [run, ...], "methods": [{"method", "cells": [row or None per run]}], "changes": flag_changes};
    each cell is the method's ``runs`` row in that run plus "delta" (vs its previous shown run) and "flag"
    (▲, ▼ or "").
    Methods are ordered by their win rate in the newest run they appear in, best first."""
    runs = runs_of(rows)
    if last is not None:
        runs = runs[-last:] if last > 0 else []
    ids = [r["run_id"] for r in runs]
    shown = [r for r in rows if r["run_id"] in set(ids)]
    changes = flag_changes(shown)
    marks = {(c["method"], c["to_run"]): c["mark"] for c in changes}
    cells: dict[str, list[dict | None]] = {}
    for r in shown:
        cells.setdefault(r["method"], [None] * len(ids))[ids.index(r["run_id"])] = dict(r)
    for method, seq in cells.items():
        previous = None
        for cell in seq:
            if cell is None:
                continue
            w, p = _finite(cell["win_rate"]), previous and _finite(previous["win_rate"])
            cell["delta"] = None if w is None or p is None else w - p
            cell["flag"] = marks.get((method, cell["run_id"]), "")
            previous = cell

    def newest(method: str) -> tuple[int, float]:
        i, cell = max((i, c) for i, c in enumerate(cells[method]) if c is not None)
        return (-i, -(_finite(cell["win_rate"]) or -math.inf))

    ordered = sorted(cells, key=lambda m: (*newest(m), m))
    return {"runs": runs, "methods": [{"method": m, "cells": cells[m]} for m in ordered], "changes": changes}


def trend_long(t: dict[str, Any]) -> list[dict]:
    """One row per (run, method) of a `trend`, oldest run first: the `LONG_COLUMNS` (for CSV and JSON)."""
    out = []
    for i, run in enumerate(t["runs"]):
        for m in t["methods"]:
            cell = m["cells"][i]
            if cell is not None:
                out.append({k: cell.get(k) for k in LONG_COLUMNS})
    return out


def _time(at: Any) -> str:
    return at.strftime("%Y-%m-%d %H:%M") if isinstance(at, datetime) else str(at)[:16].replace("T", " ")


def _cell(cell: dict | None) -> str:
    if cell is None or _finite(cell["win_rate"]) is None:
        return "—"
    se = _finite(cell["standard_error"])
    return (
        f"{cell['win_rate']:.1f}"
        + (f" ± {se:.1f}" if se is not None else "")
        + (f" {cell['flag']}" if cell["flag"] else "")
    )


def _gold(cell: dict | None) -> str:
    if cell is None or _finite(cell.get("mean_gold")) is None:
        return "—"
    se = _finite(cell.get("gold_standard_error"))
    return f"{cell['mean_gold']:.3f}" + (f" ± {se:.3f}" if se is not None else "")


def _gold_cells(m: dict) -> bool:
    return any(c is not None and _finite(c.get("mean_gold")) is not None for c in m["cells"])


def _has_gold(t: dict[str, Any]) -> bool:
    return any(_gold_cells(m) for m in t["methods"])


def _with_gold(t: dict[str, Any]) -> dict[str, Any]:
    """The trend without the methods that have no gold reward in any run."""
    return t | {"methods": [m for m in t["methods"] if _gold_cells(m)]}


def change_lines(t: dict[str, Any]) -> list[str]:
    """The flagged changes of a `trend`, one line each (or one line saying there are none)."""
    if not t["changes"]:
        return ["No change larger than 2 combined SEs between consecutive runs of a method."]
    lines = ["Changes larger than 2 combined SEs (|Δ| > 2·sqrt(se₁² + se₂²)):"]
    for c in t["changes"]:
        lines.append(
            f"{c['mark']} {c['method']}: {c['before']:.1f} → {c['after']:.1f} (Δ {c['delta']:+.1f}, "
            f"2 combined SEs {c['threshold']:.1f}), run {c['from_run']} → {c['to_run']}"
        )
    return lines


def _grid(t: dict[str, Any], value) -> list[list[str]]:
    """Header rows (run id, time, config key) and one row per method, as strings."""
    runs = t["runs"]
    head = [
        ["run", *[r["run_id"] for r in runs]],
        ["at (UTC)", *[_time(r["run_at"]) for r in runs]],
        ["config", *[r["config_key"] or "?" for r in runs]],
    ]
    return head + [[m["method"], *[value(c) for c in m["cells"]]] for m in t["methods"]]


def _aligned(grid: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in grid) for i in range(len(grid[0]))]
    return [
        "  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()
        for row in grid
    ]


def trend_text(t: dict[str, Any], title: str = "") -> str:
    """Plain-text tables (win rate ± SE, and mean gold ± SE where known), one column per run, then the flagged
    changes."""
    lines = [title] if title else []
    grid = _grid(t, _cell)
    body = _aligned(grid)
    lines += [
        "win rate vs reference outputs (%) ± SE; ▲/▼: a change larger than 2 combined SEs",
        *body[:3],
        "-" * max(len(line) for line in body),
        *body[3:],
    ]
    if _has_gold(t):
        gold = _aligned(_grid(_with_gold(t), _gold))
        lines += ["", "mean gold reward ± SE", gold[0], "-" * max(len(line) for line in gold), *gold[3:]]
    return "\n".join([*lines, "", *change_lines(t)]) + "\n"


def trend_markdown(t: dict[str, Any], title: str = "History") -> str:
    """A Markdown table of a `trend` (one column per run, oldest first) and the list of flagged changes."""
    runs = t["runs"]
    heads = [f"`{r['run_id']}` {_time(r['run_at'])}<br>config `{r['config_key']}`" for r in runs]
    lines = [
        f"### {title}",
        "",
        "Win rate vs reference outputs (%) ± SE; ▲/▼: a change larger than 2 combined SEs.",
        "",
        "| method | " + " | ".join(heads) + " |",
        "|---|" + "---:|" * len(runs),
    ]
    lines += [f"| {m['method']} | " + " | ".join(_cell(c) for c in m["cells"]) + " |" for m in t["methods"]]
    if _has_gold(t):
        lines += [
            "",
            "Mean gold reward ± SE:",
            "",
            "| method | " + " | ".join(f"`{r['run_id']}`" for r in runs) + " |",
            "|---|" + "---:|" * len(runs),
        ]
        lines += [
            f"| {m['method']} | " + " | ".join(_gold(c) for c in m["cells"]) + " |" for m in _with_gold(t)["methods"]
        ]
    return "\n".join([*lines, "", *[f"* {line}" if i else line for i, line in enumerate(change_lines(t))]]) + "\n"


def plot_trend(rows: Sequence[dict] | dict[str, Any], path: str, title: str = "Win rate across runs") -> None:
    """Win rate ± SE of each method across runs (oldest left), flagged changes ringed (PNG).

    `rows`: ``runs`` rows or a `trend`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = rows if isinstance(rows, dict) else trend(rows)
    runs = t["runs"]
    fig, ax = plt.subplots(figsize=(max(6.5, 0.9 * len(runs) + 3), 4.2), dpi=120)
    for m in t["methods"]:
        points = [(i, c) for i, c in enumerate(m["cells"]) if c is not None and _finite(c["win_rate"]) is not None]
        xs = [i for i, _ in points]
        ax.errorbar(
            xs,
            [c["win_rate"] for _, c in points],
            yerr=[_finite(c["standard_error"]) or 0 for _, c in points],
            marker="o",
            ms=4,
            capsize=3,
            lw=1.2,
            label=m["method"],
        )
        flagged = [(i, c["win_rate"]) for i, c in points if c["flag"]]
        if flagged:
            ax.scatter(*zip(*flagged), s=140, facecolors="none", edgecolors="red", zorder=3)
    ax.set_xticks(range(len(runs)), [f"{r['run_id']}\n{_time(r['run_at'])[5:]}" for r in runs], fontsize=7)
    ax.axhline(50, color="black", lw=0.8, ls="--")
    ax.set_xlim(-0.5, len(runs) - 0.5)
    ax.set_ylim(0, 100)
    ax.set_ylabel("win rate vs reference outputs (%), ± 1 SE")
    ax.set_title(title + (" (red ring: a change > 2 combined SEs)" if t["changes"] else ""), fontsize=10)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
