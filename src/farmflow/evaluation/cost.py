"""What a leaderboard row cost: compute seconds to train and to answer the evaluation set, API spend, wall time.

A method's cost is read from the commit records of the artifacts behind its evaluation (each records its stage's
``seconds``, and an annotate stage its API ``cost_usd`` and ``requests``): the evaluated outputs' artifact, and
everything upstream of it through the records' ``inputs``. So a row's cost is what it takes to produce that row from
nothing, shared stages included (the SFT model and the reward model count for every method built on them):

* ``train_seconds``: every stage upstream of the evaluated outputs (data, base model, SFT, pairs, annotation, reward
  model, the method's own training);
* ``answer_seconds``: the stage that wrote the evaluation-set outputs (generate, or best-of-n's sampling and
  scoring; best-of-k derived from best-of-N's candidates counts k/N of that sampling);
* ``judge_seconds``: the evaluate stage;
* ``api_usd`` / ``api_requests``: the annotation stages upstream (their recorded run totals) plus, when the row
  cache is given, the cache rows of the evaluation's pairs by the judges that labeled them (price_usd; a request
  that judged `items` pairs counts 1/items per pair);
* ``wall_seconds``: train + answer + judge, i.e. the row's compute time with its stages run one after the other.

`pareto` marks the rows no cheaper row beats; `plot_cost` draws win rate against wall seconds with the frontier and
best-of-n as a curve over n.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable, Sequence

from farmflow.evaluation.analysis import pair_key
from farmflow.evaluation.leaderboard import FAMILY_COLOURS, method_family

COST_COLUMNS = ("train_seconds", "answer_seconds", "judge_seconds", "wall_seconds", "api_usd", "api_requests")
ANSWER_STAGES = ("generate", "best_of_n", "best_of_n_prefix", "best_of_n_rescore")


def index(records: Iterable[dict]) -> dict[str, dict]:
    """Artifact key → its commit record (keys are unique across stages: the stage name is part of each)."""
    return {r["ref"]["key"]: r for r in records}


def seconds(record: dict) -> float:
    return float(record["ref"].get("metrics", {}).get("seconds", 0.0))


def upstream(by_key: dict[str, dict], keys: Iterable[str]) -> dict[str, dict]:
    """The records of `keys` and of everything they were made from, each once."""
    found: dict[str, dict] = {}
    todo = list(keys)
    while todo:
        key = todo.pop()
        if key in found or key not in by_key:
            continue
        found[key] = by_key[key]
        todo += list((by_key[key].get("inputs") or {}).values())
    return found


def best_of_n_size(record: dict) -> int | None:
    """n of a best-of-n outputs artifact (best_of_n: its config's; best_of_n_prefix: the k it kept)."""
    config = record.get("config") or {}
    if record["ref"]["stage"] == "best_of_n":
        return int((config.get("best_of_n") or {}).get("n", 0)) or None
    if record["ref"]["stage"] == "best_of_n_prefix":
        return int(config.get("n", 0)) or None
    return None


def annotation_spend(evaluation: Sequence[dict], cache_rows: Sequence[dict]) -> tuple[float, float]:
    """(USD, requests) of the row cache's labels of an evaluation's pairs by the judges named in it."""
    wanted = {pair_key(r)[0] for r in evaluation}
    judges = {r["annotator"] for r in evaluation}
    usd = requests = 0.0
    for row in cache_rows:
        if row["annotator"] in judges and pair_key(row)[0] in wanted:
            usd += float(row.get("price_usd") or 0.0)
            requests += 1.0 / max(1, int(row.get("items") or 1))
    return usd, requests


def method_cost(by_key: dict[str, dict], evaluation_key: str, judge_spend: tuple[float, float] = (0.0, 0.0)) -> dict:
    """The cost columns (module doc) of the evaluation `evaluation_key`; `judge_spend`: its judges' (USD, requests)."""
    evaluation = by_key[evaluation_key]
    outputs = by_key[evaluation["inputs"]["outputs"]]
    answer = seconds(outputs)
    roots = list((outputs.get("inputs") or {}).values())
    if outputs["ref"]["stage"] in ("best_of_n_prefix", "best_of_n_rescore"):
        parent = by_key.get(outputs["inputs"]["best_of_n"])
        if parent is not None:  # the candidates were sampled once for all k: this k's share of that sampling
            big, k = best_of_n_size(parent) or 1, best_of_n_size(outputs) or best_of_n_size(parent) or 1
            answer += seconds(parent) * k / big
            roots = [v for n, v in outputs["inputs"].items() if n != "best_of_n"] + list(parent["inputs"].values())
    train = upstream(by_key, roots)
    metric = lambda r, name: float(r["ref"].get("metrics", {}).get(name, 0.0))  # noqa: E731
    annotate = [r for r in train.values() if r["ref"]["stage"] == "annotate"]
    out = {
        "train_seconds": sum(seconds(r) for r in train.values()),
        "answer_seconds": answer,
        "judge_seconds": seconds(evaluation),
        "api_usd": sum(metric(r, "cost_usd") for r in annotate) + judge_spend[0],
        "api_requests": sum(metric(r, "requests") for r in annotate) + judge_spend[1],
    }
    return out | {"wall_seconds": out["train_seconds"] + out["answer_seconds"] + out["judge_seconds"]}


def pareto(costs: Sequence[float], qualities: Sequence[float]) -> list[bool]:
    """Which points no other point beats: none at most as costly with a higher quality (NaN quality: never)."""
    return [
        not math.isnan(q)
        and not any(c2 <= c and q2 > q for c2, q2 in zip(costs, qualities) if not math.isnan(q2))
        and not any(c2 < c and q2 == q for c2, q2 in zip(costs, qualities))
        for c, q in zip(costs, qualities)
    ]


def cost_rows(rows: Sequence[dict], records: Iterable[dict], cache_rows: Sequence[dict] = (), evaluations=None) -> list:
    """Leaderboard rows with their cost columns and ``pareto`` (on the win rate vs wall seconds frontier).

    `evaluations`: evaluation key → its rows (for the judges' API spend from `cache_rows`); None: not counted."""
    by_key = index(records)
    out = []
    for r in rows:
        spend = (0.0, 0.0)
        if evaluations is not None and cache_rows:
            spend = annotation_spend(evaluations.get(r["evaluation_key"], []), cache_rows)
        record = by_key.get(r["evaluation_key"])
        known = record is not None and (record.get("inputs") or {}).get("outputs") in by_key
        cost = method_cost(by_key, r["evaluation_key"], spend) if known else dict.fromkeys(COST_COLUMNS, math.nan)
        out.append(dict(r) | cost)
    marks = pareto([r["wall_seconds"] for r in out], [float(r["win_rate"]) for r in out])
    return [r | {"pareto": m} for r, m in zip(out, marks)]


def settled(config):
    """A recorded config without its null fields: a field added later with a null default reads the same."""
    if isinstance(config, dict):
        return {k: settled(v) for k, v in config.items() if v is not None}
    if isinstance(config, list):
        return [settled(v) for v in config]
    return config


def best_of_n_curve(records: Iterable[dict], evaluation_key: str) -> list[dict]:
    """Every best-of-n evaluation in the records judged like `evaluation_key` (same evaluate config, same data) whose
    candidates were chosen by the same reward model: n, win rate ± SE and cost, by n (one point per n: the
    cheapest)."""
    records = list(records)
    by_key = index(records)
    if evaluation_key not in by_key:
        return []
    board = by_key[evaluation_key]
    scorer = by_key.get(board["inputs"].get("outputs", ""), {}).get("inputs", {}).get("reward")
    points: dict[int, dict] = {}
    for r in records:
        if r["ref"]["stage"] != "evaluate" or settled(r.get("config")) != settled(board.get("config")):
            continue
        if r["inputs"].get("data") != board["inputs"].get("data"):
            continue
        outputs = by_key.get(r["inputs"].get("outputs", ""))
        n = outputs and best_of_n_size(outputs)
        if not n or (outputs.get("config") or {}).get("split", "eval") != "eval":
            continue
        if outputs["inputs"].get("reward") != scorer:  # the same reward model as the board's best-of-n
            continue
        m = r["ref"]["metrics"]
        point = {"n": n, "win_rate": m["win_rate"], "standard_error": m.get("standard_error", math.nan)}
        point |= method_cost(by_key, r["ref"]["key"])
        if n not in points or point["wall_seconds"] < points[n]["wall_seconds"]:
            points[n] = point
    return [points[n] for n in sorted(points)]


def cost_markdown(rows: Sequence[dict], title: str = "Quality and cost") -> str:
    """A Markdown table of cost rows: win rate beside its compute seconds, API spend and wall time."""
    num = lambda x, f: "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, f)  # noqa: E731
    lines = [
        f"### {title}",
        "",
        "| method | win rate | ± SE | train s | answer s | judge s | wall s | API $ | API requests | Pareto |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:-:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['method']} | {num(r['win_rate'], '.1f')} | {num(r['standard_error'], '.1f')} "
            f"| {num(r['train_seconds'], '.1f')} | {num(r['answer_seconds'], '.1f')} "
            f"| {num(r['judge_seconds'], '.2f')} "
            f"| {num(r['wall_seconds'], '.1f')} | {num(r['api_usd'], '.4f')} | {num(r['api_requests'], '.0f')} "
            f"| {'★' if r.get('pareto') else ''} |"
        )
    lines += [
        "",
        "Seconds are compute time recorded by each stage, shared stages (SFT, reward model) counted in every row built "
        "on them; wall s = train + answer + judge. ★: no cheaper row has a higher win rate.",
    ]
    return "\n".join(lines) + "\n"


def _text_box(label: Any, renderer: Any) -> Any:
    """A label's text extent in pixels, without its connecting line (an annotation's own extent includes it)."""
    from matplotlib.text import Text

    label.update_positions(renderer)
    return Text.get_window_extent(label, renderer)


def label_points(ax, points: Sequence[tuple[str, float, float, float]]) -> None:
    """Name each point (name, x, y, font size) beside it. Where points crowd together (methods of similar cost and win
    rate) a label takes the nearest free place, right or left of its point and up or down by whole lines of its
    measured size, with a thin line back to the point. Call once the layout is final."""
    ax.figure.canvas.draw()  # settles the axis limits, so data positions are the final pixels
    renderer = ax.figure.canvas.get_renderer()
    placed: list[Any] = []
    for name, x, y, size in sorted(points, key=lambda p: -p[2]):
        label = ax.annotate(
            name,
            (x, y),
            textcoords="offset points",
            xytext=(5, 4),
            size=size,
            arrowprops={"arrowstyle": "-", "lw": 0.5, "color": "0.5", "shrinkA": 0, "shrinkB": 3},
        )
        width = _text_box(label, renderer).width * 72 / ax.figure.dpi  # in points
        lines = [0] + [d * k for k in range(1, 4 * len(points)) for d in (-1, 1)]
        for dx, dy in ((dx, 4 + 1.1 * size * k) for k in lines for dx in (5, -5 - width)):
            label.xyann = (dx, dy)
            box = _text_box(label, renderer)
            if not any(box.overlaps(other) for other in placed):
                break
        label.arrow_patch.set_visible(label.xyann != (5, 4))
        placed.append(box)


def plot_cost(rows: Sequence[dict], path: str, curve: Sequence[dict] = (), title: str = "Win rate vs cost") -> None:
    """Win rate ± SE against wall seconds (log scale), coloured by family, the Pareto frontier as a step line, and
    best-of-n over n as a curve (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if not math.isnan(r["wall_seconds"]) and r["wall_seconds"] > 0]
    fig, ax = plt.subplots(figsize=(8, 5.5), dpi=100)
    se = lambda x: 0 if x is None or math.isnan(x) else x  # noqa: E731
    for r in shown:
        colour = FAMILY_COLOURS[method_family(r["method"])]
        ax.errorbar(r["wall_seconds"], r["win_rate"], yerr=se(r["standard_error"]), fmt="o", color=colour, capsize=3)
    front = sorted((r["wall_seconds"], r["win_rate"]) for r in shown if r.get("pareto"))
    if front:
        ax.step([c for c, _ in front], [q for _, q in front], where="post", color="black", lw=1, ls="--")
        ax.plot([], [], color="black", lw=1, ls="--", label="Pareto frontier")
    if len(curve) >= 2:
        ax.plot(
            [p["wall_seconds"] for p in curve],
            [p["win_rate"] for p in curve],
            "-s",
            color=FAMILY_COLOURS["reward model"],
            ms=4,
            lw=1,
            alpha=0.7,
            label="best-of-n over n",
        )
    ax.set_xscale("log")
    ax.set_xlabel("compute seconds to train, answer and judge (log)")
    ax.set_ylabel("win rate vs reference (%), ± 1 SE")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if front or len(curve) >= 2:
        ax.legend(loc="best", fontsize=7)
    fig.tight_layout()
    labels = [(r["method"], r["wall_seconds"], r["win_rate"], 8) for r in shown]
    if len(curve) >= 2:
        labels += [(f"n={p['n']}", p["wall_seconds"], p["win_rate"], 7) for p in curve]
    label_points(ax, labels)
    fig.savefig(path, bbox_inches="tight")
    plt.close(fig)


def cost_report(
    rows: Sequence[dict], records: Iterable[dict], title: str, cache_rows: Sequence[dict] = (), evaluations=None
) -> tuple[list[dict], str, bytes]:
    """(cost rows, their Markdown, the quality–cost plot as PNG bytes) of leaderboard rows, from the records (and the
    row cache's prices of the evaluation pairs: `cost_rows`)."""
    import tempfile
    from pathlib import Path

    records = list(records)
    costed = cost_rows(rows, records, cache_rows, evaluations)
    bon = next((r for r in costed if r["method"].startswith("best_of_")), None)
    curve = best_of_n_curve(records, bon["evaluation_key"]) if bon else []
    with tempfile.TemporaryDirectory() as tmp:
        plot_cost(costed, f"{tmp}/cost.png", curve, title)
        png = Path(f"{tmp}/cost.png").read_bytes()
    return costed, cost_markdown(costed, title), png


def by_evaluation(store, rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Evaluation key → its ``evaluation`` rows, for the rows of a leaderboard (missing artifacts left out)."""
    out: dict[str, list[dict]] = defaultdict(list)
    for r in rows:
        ref = store.get("evaluate", r["evaluation_key"])
        if ref is not None:
            out[r["evaluation_key"]] = store.read_table(ref).to_pylist()
    return dict(out)


__all__ = [
    "ANSWER_STAGES",
    "COST_COLUMNS",
    "annotation_spend",
    "best_of_n_curve",
    "by_evaluation",
    "cost_markdown",
    "cost_report",
    "cost_rows",
    "index",
    "method_cost",
    "pareto",
    "plot_cost",
    "upstream",
]
