"""`trainmedic config show`: the effective settings and where each came from."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainmedic.settings import config_path, provenance, unknown_env

config_app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="The settings model: environment TRAINMEDIC_*, the config file, flags.",
)

ConfigOpt = Annotated[
    Path | None,
    typer.Option("--config", help="Config file (default: TRAINMEDIC_CONFIG, else /etc/trainmedic/config.yaml)."),
]


@config_app.command("show")
def show(
    config: ConfigOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per setting.")] = False,
) -> None:
    """Print every setting's effective value (secrets masked) and its origin."""
    rows = provenance(config)
    unknown = unknown_env()
    if as_json:
        out = {
            "config_file": str(config_path(config) or ""),
            "unknown_env": unknown,
            "settings": [{"name": n, "value": v, "origin": o} for n, v, o in rows],
        }
        typer.echo(json.dumps(out, indent=2))
        return
    table = Table(title=f"settings (config file: {config_path(config) or 'none'})")
    for column in ("setting", "value", "from"):
        table.add_column(column)
    for name, value, origin in rows:
        table.add_row(name, value, origin)
    console = Console()
    console.print(table)
    for name in unknown:
        console.print(f"[yellow]warning:[/] {name} is set but names no setting (ignored)")
