"""`trainmedic config show`: the effective settings and where each came from."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from trainmedic.cli.base import config_file, new_app
from trainmedic.settings import config_path, provenance, unknown_env

config_app = new_app(help="The settings model: flags, then TRAINMEDIC_* environment, then the config file.")


@config_app.command("show")
def show(as_json: Annotated[bool, typer.Option("--json", help="One JSON object per setting.")] = False) -> None:
    """Print every setting's effective value (secrets masked) and its origin (`trainmedic --config FILE config show`
    for another config file)."""
    config = config_file()
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
