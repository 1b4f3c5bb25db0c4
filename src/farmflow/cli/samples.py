"""`farmflow samples`: read a method's evaluated responses beside SFT's answer to the same instruction.

Everything comes from what a run committed: the ``runs`` table names each method's evaluation;
the evaluation (``evaluate``) holds the response, the judge's preference against the reference
and, on the synthetic farm, the gold reward of both; the run's ``proxy_reward`` artifact of the
same outputs (compare runs and `farmflow demo` make one per method) holds the reward model's
score. A method run alone has no proxy reward: its reward-model column stays empty.
"""

from __future__ import annotations

import json
import random
from typing import Any, Optional

import typer

from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.output import check_format, console, finite, format_option, text
from farmflow.cli.store import STORE_HELP, open_given

BY = ("gold", "judge", "reward")


def run_row(runs: list[dict], method: str, run: str | None) -> dict:
    """The newest `runs` row of `method` (its leaderboard name, e.g. best_of_16, or the method, e.g. best_of_n)."""
    stem = method.removesuffix("_n")
    rows = [
        r
        for r in runs
        if r["evaluation_key"]
        and (r["method"] == method or (stem != method and r["method"].startswith(stem)))
        and (run is None or (r["run_id"] or "").startswith(run) or (r["flow_run_id"] or "").startswith(run))
    ]
    if not rows:
        known = sorted({r["method"] for r in runs})
        raise CliError(
            f"samples: no evaluated run of {method!r}{f' in run {run!r}' if run else ''} in the store's runs table"
            + (f" (methods there: {', '.join(known)})" if known else " (it is empty: run farmflow demo first)")
        )
    return max(rows, key=lambda r: r["run_at"])


def responses(store: Any, records: list[dict], evaluation_key: str) -> dict[str, dict]:
    """id → {instruction, input, output, judge, gold, reward} of one evaluation (reward: None without a proxy
    reward)."""
    ref = store.get("evaluate", evaluation_key)
    if ref is None:
        raise CliError(f"samples: evaluation {evaluation_key[:12]} is not in the store")
    outputs_key = store.record(ref)["inputs"].get("outputs")
    scores: dict[str, float] = {}
    for r in records:
        if r["ref"]["stage"] == "proxy_reward" and (r.get("inputs") or {}).get("outputs") == outputs_key:
            proxy = store.get("proxy_reward", r["ref"]["key"])
            scores = {row["id"]: row["score"] for row in store.read_table(proxy).to_pylist()}
    return {
        row["id"]: {
            "instruction": row["instruction"],
            "input": row["input"],
            "output": row["output_2"],
            "judge": None if row["preference"] is None else row["preference"] - 1.0,  # P(beats the reference)
            "gold": row["gold_2"],
            "reward": scores.get(row["id"]),
        }
        for row in store.read_table(ref).to_pylist()
    }


def pick(ids: list[str], mine: dict[str, dict], n: int, order: str, by: str, seed: int) -> list[str]:
    """`n` ids: the lowest (worst) or highest (best) by `by` of the method's response (no value: last), or random."""
    if order == "random":
        return random.Random(seed).sample(ids, min(n, len(ids)))
    valued = [i for i in ids if mine[i][by] is not None]
    ranked = sorted(valued, key=lambda i: (mine[i][by], i), reverse=order == "best")
    return (ranked + [i for i in ids if mine[i][by] is None])[:n]


def samples(
    n: int = typer.Argument(5, help="How many instructions to show."),
    method: str = typer.Option(..., "--method", "-m", help="The method (its leaderboard name, e.g. ppo, best_of_16)."),
    worst: bool = typer.Option(False, "--worst", help="The method's lowest-scored responses (see --by)."),
    best: bool = typer.Option(False, "--best", help="The method's highest-scored responses (see --by)."),
    shuffle: bool = typer.Option(False, "--random", help="Random instructions (the default; --seed)."),
    by: Optional[str] = typer.Option(
        None,
        help="What --worst/--best rank by: gold (synthetic farm; the default there), judge (P(beats the "
        "reference); the default on real data) or reward (the reward model's score).",
    ),
    against: str = typer.Option("sft", "--against", help="The method shown beside it (same run)."),
    run: Optional[str] = typer.Option(None, "--run", help="This run (run_id or flow run id prefix; default: newest)."),
    seed: int = typer.Option(0, help="Seed of --random."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
    fmt: str = format_option("Output format: table, json or md."),
) -> None:
    """A method's evaluated responses beside SFT's for the same instructions, with reward-model score, the judge's
    preference against the reference and the gold reward."""
    from rich.table import Table

    check_format(fmt, ("table", "json", "md"))
    if worst + best + shuffle > 1:
        raise UsageError("give one of --worst, --best, --random")
    if by is not None and by not in BY:
        raise UsageError(f"--by: unknown {by!r}; use {', '.join(BY)}")
    st = open_given(store)
    runs = st.read_rows("runs", "runs").to_pylist()
    row = run_row(runs, method, run)
    other = run_row(runs, against, row["run_id"])
    records = st.records()
    mine, theirs = responses(st, records, row["evaluation_key"]), responses(st, records, other["evaluation_key"])
    ids = sorted(set(mine) & set(theirs))
    by = by or ("gold" if any(v["gold"] is not None for v in mine.values()) else "judge")
    chosen = pick(ids, mine, n, "worst" if worst else "best" if best else "random", by, seed)
    a, b = row["method"], other["method"]
    shown = [
        {"id": i, "instruction": mine[i]["instruction"], "input": mine[i]["input"], a: mine[i], b: theirs[i]}
        for i in chosen
    ]
    if fmt == "json":
        for s in shown:
            for side in (a, b):
                s[side] = {k: v for k, v in s[side].items() if k not in ("instruction", "input")}
        print(json.dumps(finite(shown), indent=2))
        return
    figures = [("reward model", "reward"), ("judge: P(beats reference)", "judge"), ("gold reward", "gold")]
    out = console()
    for s in shown:
        prompt = s["instruction"] + (f"\n{s['input']}" if s["input"] else "")
        if fmt == "md":
            lines = [f"### {s['id']}: {prompt}", "", f"| | {a} | {b} |", "|---|---|---|"]
            cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
            lines.append(f"| response | {cell(s[a]['output'])} | {cell(s[b]['output'])} |")
            lines += [f"| {name} | {text(s[a][k])} | {text(s[b][k])} |" for name, k in figures]
            print("\n".join(lines) + "\n")
            continue
        table = Table(title=f"{s['id']}: {prompt}", title_justify="left", show_lines=True, header_style="bold")
        table.add_column("", style="dim")
        table.add_column(a, overflow="fold", ratio=1)
        table.add_column(b, overflow="fold", ratio=1)
        table.add_row("response", s[a]["output"], s[b]["output"])
        for name, k in figures:
            table.add_row(name, text(s[a][k]), text(s[b][k]))
        out.print(table)
    order = "worst" if worst else "best" if best else f"random (seed {seed})"
    out.print(
        f"{len(shown)} of {len(ids)} instructions, {order}"
        + (f" by {by}" if worst or best else "")
        + f"; run {row['run_id']}",
        soft_wrap=True,
    )


def register(app: typer.Typer) -> None:
    """Add `samples` to the `farmflow` command."""
    app.command("samples")(samples)
