"""What the `farmflow` commands print on stdout: tables for people, JSON, CSV or Markdown for programs.

Every table goes through `emit`, so each table command takes the same `--format table|json|csv|md`. Text is
printed with rich markup off: names such as "evaluate sft [p_sim^ann]" are data, shown as written. In a terminal a
table fits its width; anywhere else (a pipe, a file, CI) it is printed at its full width, never cut at 80 columns.
"""

from __future__ import annotations

import csv
import json
import math
import sys
from typing import Any, Callable, Sequence

import typer
from rich.console import Console
from rich.table import Table

FORMATS = ("table", "json", "csv", "md")
FORMAT_HELP = "table (aligned, for people), json (a list of objects), csv or md (a Markdown table)."
UNLIMITED = 100_000  # columns of a console that is not a terminal: wide enough for any table


def format_option(help: str = FORMAT_HELP) -> Any:
    """The `--format/-f` option of a table command."""
    return typer.Option("table", "--format", "-f", help=help)


def check_format(fmt: str, formats: Sequence[str] = FORMATS) -> None:
    from farmflow.cli.errors import UsageError

    if fmt not in formats:
        raise UsageError(f"--format: unknown format {fmt!r}; use {', '.join(formats[:-1])} or {formats[-1]}")


def console(stderr: bool = False) -> Console:
    """A console for this command's output: markup off; in a terminal its width, elsewhere no width limit."""
    stream = sys.stderr if stderr else sys.stdout
    tty = stream.isatty()
    return Console(file=stream, markup=False, highlight=False, soft_wrap=not tty, width=None if tty else UNLIMITED)


def say(text: str) -> None:
    """One line of text on stdout, as written (no markup, no wrapping)."""
    console().print(text, soft_wrap=True)


def finite(x: Any) -> Any:
    """`x` with NaN and infinities (also inside lists and dicts) replaced by None."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [finite(v) for v in x]
    return x


def print_json(obj: Any) -> None:
    """Strict JSON on stdout: NaN and infinities (e.g. mean gold on real data, which has none) become null."""
    print(json.dumps(finite(obj), indent=2, allow_nan=False, default=str))


Cell = Callable[[Any], str]


def exact(x: Any) -> str:
    """A cell as stored: empty for no value."""
    return "" if x is None else str(x)


def text(x: Any) -> str:
    """A cell as people read it: a dash for no value, floats with three decimals."""
    if x is None or (isinstance(x, float) and x != x):
        return "—"
    return f"{x:.3f}" if isinstance(x, float) else str(x)


def emit(
    columns: Sequence[str],
    rows: Sequence[Sequence[Any]],
    fmt: str = "table",
    *,
    title: str | None = None,
    caption: str | None = None,
    cells: dict[str, Cell] | None = None,
    right: Sequence[str] = (),
    fold: dict[str, int] | None = None,
    default: Cell = text,
    keys: Sequence[str] | None = None,
) -> None:
    """Print a table on stdout in `fmt` (FORMATS).

    `rows` hold values. json and csv print them as they are (no value: null, an empty cell), under `keys` (default:
    the columns); table and md print each through `cells[column]` (else `default`) under the columns. `right`:
    right-aligned columns; `fold`: columns that wrap at the given minimum width in a narrow terminal instead of
    squeezing the others.
    """
    check_format(fmt)
    cells = cells or {}
    if fmt == "json":
        print_json([dict(zip(keys or columns, r)) for r in rows])
        return
    if fmt == "csv":
        writer = csv.writer(sys.stdout, lineterminator="\n")
        writer.writerow(keys or columns)
        writer.writerows([["" if finite(v) is None else v for v in r] for r in rows])
        return
    shown = [[cells.get(c, default)(v) for c, v in zip(columns, r)] for r in rows]
    if fmt == "md":
        cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        lines = ([f"### {cell(title)}", ""] if title else []) + [
            "| " + " | ".join(cell(c) for c in columns) + " |",
            "|" + "|".join("---:" if c in right else "---" for c in columns) + "|",
            *("| " + " | ".join(cell(v) for v in r) + " |" for r in shown),
        ]
        print("\n".join(lines + (["", cell(caption)] if caption else [])))
        return
    table = Table(title=title, caption=caption, header_style="bold")
    for c in columns:
        width = (fold or {}).get(c)
        table.add_column(
            c, justify="right" if c in right else "left", overflow="fold" if width else "ellipsis", min_width=width
        )
    for r in shown:
        table.add_row(*r)
    console().print(table)
