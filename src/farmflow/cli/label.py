"""`farmflow label serve | export | import`: human preference labels (`farmflow.labeling`, docs/labeling.md)."""

from __future__ import annotations

import getpass
import socket
from pathlib import Path
from typing import Optional

import typer

from farmflow.cli.errors import UsageError
from farmflow.cli.output import say
from farmflow.cli.preflight import writable_store
from farmflow.cli.store import STORE_HELP, open_given

label_app = typer.Typer(help="Label pairs by hand in a local web page; export and import labels.", no_args_is_help=True)
PAIRS_HELP = (
    "The pairs: a committed artifact's key (a pairs or preferences table; a unique prefix, or stage/key) "
    "or a .json/.jsonl/.parquet file with instruction, input, output_1, output_2."
)


def default_labeler() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return "labeler"


def check_port(port: int) -> None:
    """Refuse a port that is taken before the server starts (uvicorn would only log it)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError as err:
            raise UsageError(f"--port {port}: cannot listen on 127.0.0.1:{port} ({err.strerror}); pick another port")


@label_app.command("serve")
def serve(
    pairs: str = typer.Option(..., "--pairs", help=PAIRS_HELP),
    labeler: Optional[str] = typer.Option(
        None,
        help="Who labels (annotator human:NAME; default: your user name). "
        "The page's ?labeler=NAME parameter labels as someone else.",
    ),
    port: int = typer.Option(8770, min=1, max=65535, help="Port on 127.0.0.1."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """Serve the labeling page on 127.0.0.1 until Ctrl-C; each label is saved to the store as it is given."""
    from farmflow.labeling.labels import annotator, load_pairs
    from farmflow.labeling.server import serve as run_server

    labeler = labeler or default_labeler()
    annotator(labeler)
    if not 0 < port < 65536:
        raise UsageError(f"--port {port}: use a port between 1 and 65535")
    check_port(port)
    st = writable_store(store)  # labels are saved into it: created when missing
    rows = load_pairs(st, pairs)
    say(f"labeling {len(rows)} pairs as human:{labeler} into {st.root}: http://127.0.0.1:{port}/ (Ctrl-C to stop)")
    run_server(st, rows, labeler, port)


@label_app.command("export")
def export(
    labeler: str = typer.Option(..., help="Whose labels (annotator human:NAME)."),
    output: Path = typer.Option(..., "--output", "-o", help="The file to write."),
    fmt: str = typer.Option("csv", "--format", "-f", help="csv (a header line) or jsonl."),
    pairs: Optional[str] = typer.Option(
        None,
        "--pairs",
        help=PAIRS_HELP + " With it: those pairs' labels in their "
        "order and output order, with their id; without: all labels, oldest first.",
    ),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """Write a labeler's labels in force (undone ones left out) in AlpacaFarm's human-preference layout."""
    from farmflow.labeling.files import FORMATS, export_rows, write_rows
    from farmflow.labeling.labels import annotator, load_pairs

    if fmt not in FORMATS:
        raise UsageError(f"--format: unknown format {fmt!r}; use csv or jsonl")
    annotator(labeler)
    st = open_given(store)
    rows = export_rows(st, labeler, load_pairs(st, pairs) if pairs else None)
    write_rows(rows, output, fmt)
    say(f"{len(rows)} labels of human:{labeler} → {output}")


def import_labels(
    file: Path = typer.Argument(
        ...,
        help="A .csv, .json, .jsonl or .parquet file: instruction, input, output_1, "
        "output_2, preference (1 or 2; 1.5 or 0: a tie).",
    ),
    labeler: str = typer.Option(..., help="Whose labels these are (annotator human:NAME)."),
    store: Optional[str] = typer.Option(None, help=STORE_HELP),
) -> None:
    """Add a file of preference labels to the store as a labeler's (all rows or, on a bad row, none)."""
    from farmflow.labeling.files import import_file

    n = import_file(writable_store(store), file, labeler)
    say(f"imported {n} labels as human:{labeler}")


label_app.command("import")(import_labels)


def register(app: typer.Typer) -> None:
    """Add `label` to the `farmflow` command."""
    app.add_typer(label_app, name="label")
