"""`farmflow plot curves`: the per-step training metrics of stages as one PNG (see docs/training-metrics.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from farmflow.cli.errors import CliError, UsageError
from farmflow.cli.output import say
from farmflow.cli.store import STORE_HELP, open_given

plot_app = typer.Typer(help="Pictures of what is in the store.", no_args_is_help=True)


def trained(store: Any, ref: Any) -> bool:
    from farmflow.training_metrics import ROWS_METRIC

    return bool((ref.metrics or {}).get(ROWS_METRIC))


def run_stages(store: Any, run_id: str) -> list[Any]:
    """The training artifacts upstream of a run's evaluations (`runs` rows whose run_id or flow run id starts with
    `run_id`), in commit order."""
    runs = store.read_rows("runs", "runs").to_pylist()
    keys = {r["evaluation_key"] for r in runs if r["evaluation_key"] and run_id in (r["run_id"], r["flow_run_id"])}
    keys |= {
        r["evaluation_key"] for r in runs if r["evaluation_key"] and not keys and (r["run_id"] or "").startswith(run_id)
    }
    if not keys:
        raise CliError(f"plot curves: no run {run_id!r} in the store's runs (see `farmflow history`)")
    records = {r["ref"]["key"]: r for r in store.records()}
    seen, todo = set(), list(keys)
    while todo:  # walk the inputs upstream of every evaluation
        key = todo.pop()
        if key in seen or key not in records:
            continue
        seen.add(key)
        todo += [k for k in (records[key].get("inputs") or {}).values() if isinstance(k, str)]
    from farmflow.storage import ArtifactRef

    refs = [ArtifactRef.model_validate(r["ref"]) for k, r in records.items() if k in seen]
    return sorted((r for r in refs if trained(store, r)), key=lambda r: r.created)


def named_stages(store: Any, pairs: list[str]) -> list[Any]:
    """STAGE KEY... (a key may be a unique prefix; a STAGE alone: its newest artifact)."""
    refs = store.list()
    out, i = [], 0
    while i < len(pairs):
        stage = pairs[i]
        key = pairs[i + 1] if i + 1 < len(pairs) and not any(r.stage == pairs[i + 1] for r in refs) else ""
        i += 2 if key else 1
        found = [r for r in refs if r.stage == stage and r.key.startswith(key) and trained(store, r)]
        if not found:
            raise CliError(f"plot curves: no {stage} artifact {key or ''} with training metrics in the store".strip())
        if key and len(found) > 1:
            raise CliError(f"plot curves: {len(found)} {stage} artifacts start with {key!r}; give more of the key")
        out.append(found[-1])
    return out


@plot_app.command("curves")
def curves_cmd(
    stages: Optional[list[str]] = typer.Argument(
        None,
        help="STAGE [KEY] pairs (KEY: a unique prefix; a STAGE alone: its newest artifact). Default: every "
        "training stage in the store, newest artifact of each.",
    ),
    run: Optional[str] = typer.Option(
        None,
        "--run",
        help="The training stages upstream of this run's evaluations "
        "(a run_id or flow run id from `farmflow history`).",
    ),
    output: Path = typer.Option(Path("curves.png"), "--output", "-o", help="The PNG to write."),
    only: Optional[list[str]] = typer.Option(
        None, "--metric", "-m", help="Only these figures (repeat), e.g. -m reward -m kl. Default: every figure."
    ),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """Draw the per-step training metrics of training stages (one panel per figure, one line per stage) as a PNG."""
    from farmflow import curves, training_metrics

    if run and stages:
        raise UsageError("give either --run or STAGE KEY pairs, not both")
    st = open_given(store)
    if run:
        refs = run_stages(st, run)
    elif stages:
        refs = named_stages(st, stages)
    else:
        newest = {r.stage: r for r in st.list() if trained(st, r)}
        refs = list(newest.values())
    if not refs:
        raise CliError("plot curves: no training stage with metrics in the store (train one first, e.g. farmflow demo)")
    labels = [r.stage if sum(x.stage == r.stage for x in refs) == 1 else f"{r.stage} {r.key[:8]}" for r in refs]
    tables = [(label, training_metrics.read(st, r)) for label, r in zip(labels, refs)]
    try:
        curves.plot(tables, output, only)
    except ValueError as err:
        raise CliError(f"plot curves: {err}") from None
    say(f"wrote {output} ({', '.join(labels)})")


def register(app: typer.Typer) -> None:
    """Add `plot` to the `farmflow` command."""
    app.add_typer(plot_app, name="plot")
