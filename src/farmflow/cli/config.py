"""`farmflow config presets | show | diff`: the named presets and how they differ from the paper's settings."""

from __future__ import annotations

import typer

from farmflow.cli.output import check_format, emit, format_option, say

config_app = typer.Typer(help="Inspect presets and configurations.", no_args_is_help=True)


@config_app.command("presets")
def presets() -> None:
    """List the named presets."""
    from farmflow.config import PRESETS

    for name, factory in sorted(PRESETS.items()):
        first = " ".join((factory.__doc__ or "").strip().split("\n\n")[0].split())  # its first paragraph
        say(f"{name}: {first}")
    say(
        "(`farmflow config show NAME` prints one in full; `farmflow config diff NAME` how it differs from the defaults)"
    )


@config_app.command("show")
def show(
    preset: str = typer.Argument("synthetic-tiny", help="Preset name."),
    set_: list[str] = typer.Option([], "--set", help="Override a field (section.field=value)."),
) -> None:
    """Print a preset (with overrides) as JSON."""
    from farmflow.config import load_config

    print(load_config(preset, list(set_)).model_dump_json(indent=2))


@config_app.command("diff")
def diff(
    preset: str = typer.Argument("synthetic-tiny", help="Preset to compare with the defaults (the paper's settings)."),
    section: list[str] = typer.Option(
        [], "--section", help="Only these sections (repeatable), e.g. --section dpo --section ppo."
    ),
    all_: bool = typer.Option(False, "--all", help="Also list the settings the preset leaves at the paper's value."),
    fmt: str = format_option(),
) -> None:
    """Settings of a preset side by side with the defaults, which follow the paper (Appendix B)."""
    from farmflow.config import FarmConfig, load_config

    check_format(fmt)

    def flat(value, prefix: str) -> dict:
        if isinstance(value, dict):
            return {
                k: v for key, sub in value.items() for k, v in flat(sub, f"{prefix}.{key}" if prefix else key).items()
            }
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):  # annotator pools
            return {k: v for i, sub in enumerate(value) for k, v in flat(sub, f"{prefix}[{i}]").items()}
        return {prefix: value}

    cfg = load_config(preset)
    paper, chosen = flat(FarmConfig().model_dump(), ""), flat(cfg.model_dump(), "")
    # an annotator preset fixes its pool: its row says so, the pool's ~100 fields would only repeat it
    by_preset = tuple(
        f"{where}.api_pool"
        for where, ann in (("annotation", cfg.annotation), ("evaluation.annotator", cfg.evaluation.annotator))
        if ann.preset
    )
    rows = []
    for key in dict.fromkeys([*paper, *chosen]):  # both: a preset's pool may be longer than the default's
        top = key.split(".")[0].split("[")[0]
        if (
            top in ("name", "store", "checkpoints", "execution")
            or (section and top not in section)
            or key.startswith(by_preset)
        ):
            continue
        if all_ or chosen.get(key, "—") != paper.get(key, "—"):
            rows.append([key, paper.get(key, "—"), chosen.get(key, "—")])
    title = (
        f"{preset} vs the defaults (the methods' defaults are the paper's; "
        "data and model default to the synthetic farm)"
    )
    emit(["setting", "default", preset], rows, fmt, title=title, cells={"default": repr, preset: repr})


def register(app: typer.Typer) -> None:
    """Add `config` to the `farmflow` command."""
    app.add_typer(config_app, name="config")
